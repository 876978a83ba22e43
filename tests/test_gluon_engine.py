"""The matrix engines the Gluon backends hand the shared pipeline (no GPU needed).

Each backend package holds its engine (gluon_sm100: tcgen05 + TMEM, gluon_sm90: wgmma) and
passes it to every pipeline kernel as the ``ENGINE`` constexpr; the shared kernels never
import a backend. The compiles of both engines run in tests/test_gluon_aot.py.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch.backends import gluon_sm90, gluon_sm100  # noqa: E402
from gdn_dispatch.backends.gluon_common.engine import ENGINE_API, GluonEngine  # noqa: E402
from gdn_dispatch.backends.gluon_common.launch_plan import resolve_engine  # noqa: E402
from gdn_dispatch.device import assumed_device  # noqa: E402

ENGINES = [pytest.param(gluon_sm100, True, id="gluon_sm100"), pytest.param(gluon_sm90, False, id="gluon_sm90")]


@pytest.mark.parametrize("backend, is_sm100", ENGINES)
def test_engine_provides_the_contract(backend, is_sm100):
    engine = backend.ENGINE
    assert engine.is_sm100 is is_sm100 and engine.IS_SM100.value is is_sm100
    for name in ENGINE_API:
        fn = getattr(engine, name)
        assert hasattr(fn, "cache_key"), f"{engine}.{name} is not a jit / constexpr function"
        assert fn.fn.__module__ == f"{backend.__name__}.engine", f"{engine}.{name} comes from {fn.fn.__module__}"


def test_an_engine_names_every_function():
    with pytest.raises(TypeError, match=r"engine 'half': missing \['acc_alloc_tf32'"):
        GluonEngine("half", is_sm100=False, **{n: getattr(gluon_sm90.ENGINE, n) for n in ENGINE_API
                                                 if n != "acc_alloc_tf32"})


def test_engine_constexprs_survive_json():
    """Launch hooks (e.g. torch's nvshmem one) serialize a kernel's constexprs to JSON."""
    assert json.loads(json.dumps({"ENGINE": gluon_sm100.ENGINE})) == {"ENGINE": "tcgen05"}


def test_engines_key_the_compile_cache_apart():
    """A kernel's compile cache is keyed on the constexpr's cache_key / repr: the two engines
    must differ, and each must be stable."""
    a, b = gluon_sm100.ENGINE, gluon_sm90.ENGINE
    assert a.cache_key != b.cache_key and repr(a) != repr(b)
    assert repr(a).startswith("GluonEngine(tcgen05, ") and a.cache_key[:16] in repr(a)


@pytest.mark.parametrize("arch, backend", [("sm_90", gluon_sm90), ("sm_100", gluon_sm100), ("sm_103", gluon_sm100)])
def test_dry_runs_take_the_engine_of_the_admitted_backend(arch, backend):
    assert resolve_engine(assumed_device(arch)) is backend.ENGINE
    assert resolve_engine(assumed_device(arch), gluon_sm90.ENGINE) is gluon_sm90.ENGINE


@pytest.mark.parametrize("arch", ["sm_80", "sm_120"])
def test_dry_runs_refuse_parts_without_a_gluon_engine(arch):
    with pytest.raises(ValueError, match="the Gluon kernels need sm_90 or sm_100/sm_103"):
        resolve_engine(assumed_device(arch))
