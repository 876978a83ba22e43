"""Routes (:mod:`gdn_dispatch.routes`) against the public call's Python path.

The public call runs on CPU tensors taken for an sm_90 / sm_100 device's (the probe and the
backend's CUDA check stood in), its launches stubbed as in ``test_call_program.py``: each
call of a fuzz of forms runs through the Python path (routes off) and through its route,
and both must make the same launches (kernel, grid, every argument, addresses named by the
tensor they point at) and return outputs pointing where the launches wrote. A form whose
program takes the call must be taken by its route once its first calls have bound the
kernels (state pools, read and written back in place, among them); every other form (an
fp16 initial state, strided views) must be left to the Python path. Then what a route must
not decide: the debug checks, a forced segment count, a changed environment, a cleared plan
cache, another current device, a broken call; and a call its runner declines keeps the
form's registry choice. Needs the native layer built.
"""

from __future__ import annotations

import contextlib
import importlib
import random
from unittest import mock

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch import api, contract, op, routes  # noqa: E402
from gdn_dispatch.context_parallel import plan_for_problem  # noqa: E402
from gdn_dispatch.contract import GDNInputError, make_problem  # noqa: E402
from gdn_dispatch.device import assumed_device  # noqa: E402
from gdn_dispatch.routes import ROUTE_CALLS  # noqa: E402
from gdn_dispatch.testing import random_call  # noqa: E402

from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache  # noqa: E402
from gdn_dispatch.backends.triton_generic import call_program as tg_program  # noqa: E402

from test_call_program import _labels, _random_form, stubbed_segmented_launches, stubbed_triton_launches  # noqa: E402
from test_gluon_host_path import stubbed_launches  # noqa: E402

pytestmark = pytest.mark.slow

TG = importlib.import_module("gdn_dispatch.backends.triton_generic.forward")


@contextlib.contextmanager
def public_calls(backend: str, device):
    """The public call with ``backend`` forced on CPU tensors taken for ``device``'s (offsets
    in device memory included: no host copy unless the call gives one)."""
    module = importlib.import_module(f"gdn_dispatch.backends.{backend}")

    class Probe:
        def for_torch_device(self, _):
            return device

    routes.clear()
    with mock.patch.object(op, "default_probe", Probe), mock.patch.object(module, "unsupported_reason", lambda p: None), \
            mock.patch.object(contract, "_in_host_memory", lambda t: False):
        yield
    routes.clear()


def _inputs(call: dict) -> dict:
    """The call's tensors by name, and the offsets the kernels read (a uniform batch's kept ones)."""
    inputs = {name: call.get(name) for name in ("q", "k", "v", "g", "beta", "initial_state", "state_indices")}
    inputs["cu_seqlens"] = make_problem(**call).chunks.cu_seqlens
    return inputs


def _compare(call: dict, runs: list, i: int) -> int:
    """Launches and outputs of ``call`` routed and on the Python path, which must agree;
    returns 1 where the route took the call, else 0."""
    for _ in range(3):  # binds the form's kernels, builds its program and its route
        api.chunk_gated_delta_rule(**call)
    inputs = _inputs(call)
    with mock.patch.object(api, "routed_call", lambda *a: None):
        runs.clear()
        expected = _labels(runs, api.chunk_gated_delta_rule(**call), inputs)
    before = ROUTE_CALLS["taken"]
    runs.clear()
    got = _labels(runs, api.chunk_gated_delta_rule(**call), inputs)
    assert got == expected, f"call {i}: {sorted(k for k, v in call.items() if v is not None)}"
    return ROUTE_CALLS["taken"] - before


@pytest.mark.parametrize("capability", [(9, 0), (10, 0)], ids=["sm90", "sm100"])
def test_routed_calls_launch_what_the_python_path_launches(native_built, capability):
    clear_plan_cache()
    backend = "gluon_sm90" if capability == (9, 0) else "gluon_sm100"
    rng = random.Random(2468 + capability[0])
    routed = pools = 0
    with stubbed_launches() as stub, public_calls(backend, assumed_device(f"sm_{capability[0]}{capability[1]}")):
        for i in range(80):
            call, takes = _random_form(rng)
            taken = _compare(dict(call, backend=backend), stub.runs, i)
            assert taken == int(takes), f"call {i}: routed {taken}, expected {int(takes)}"
            routed += taken
            pools += taken and "state_indices" in call
    assert 30 <= routed <= 75 and pools >= 2  # routed (pools among them) and Python-path forms both drawn


@pytest.mark.parametrize("fused_solve", [True, False])
def test_triton_generic_routed_calls_launch_what_the_python_path_launches(native_built, monkeypatch, fused_solve):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(TG, "fuse_solve_into_wu", lambda capability: fused_solve)
    monkeypatch.setattr(tg_program, "fuse_solve_into_wu", lambda capability: fused_solve)
    rng = random.Random(1357 + fused_solve)
    routed = pools = 0
    with stubbed_triton_launches() as runs, public_calls("triton_generic", assumed_device("sm_90")):
        for i in range(60):
            call, takes = _random_form(rng, head_dims=((128, 128), (64, 64), (96, 80), (64, 128)),
                                       dtypes=(torch.bfloat16, torch.float16, torch.float32))
            taken = _compare(dict(call, backend="triton_generic"), runs, i)
            assert taken == int(takes), f"call {i}: routed {taken}, expected {int(takes)}"
            routed += taken
            pools += taken and "state_indices" in call
    assert 25 <= routed <= 55 and pools >= 2


@pytest.mark.parametrize("backend", ["gluon_sm90", "gluon_sm100", "triton_generic"])
def test_segmented_calls_are_routed(native_built, monkeypatch, backend):
    """Calls context parallelism segments (``"auto"``: a long prompt on a few heads) go
    through their route and program: one packed sequence with or without a host copy of
    the offsets, a uniform batch, ragged batches with a host copy (the Gluon backends'
    pass 2 plans on the segment slots it fills) and without one (its segments' tails
    assumed). Each with random flags: the launches must equal the Python path's."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    clear_plan_cache()
    capability = (10, 0) if backend == "gluon_sm100" else (9, 0)
    device = assumed_device(f"sm_{capability[0]}{capability[1]}")
    rng = random.Random(97 + capability[0] + len(backend))
    # (lengths or uniform batch, host copy, H, HV, routed)
    cases = [([5000], True, 2, 4, 1), ([4096], True, 2, 4, 1), ([6100], False, 1, 2, 1), ((2, 4160), None, 1, 2, 1),
             ((1, 4100), None, 2, 4, 1), ([3000, 6000], False, 1, 2, 1), ([3000, 6000], True, 1, 2, 1),
             ([4500, 0, 4700], False, 1, 1, 1), ([4500, 0, 4700, 64], True, 1, 1, 1)]
    stub = stubbed_triton_launches() if backend == "triton_generic" else stubbed_segmented_launches()
    with stub as launched, public_calls(backend, device):
        runs = launched if backend == "triton_generic" else launched.runs
        for i, (shape, host_copy, H, HV, routed) in enumerate(cases * 2):
            dims = rng.choice([(128, 128), (64, 128), (128, 64), (64, 64)])
            shaped = dict(batch=shape) if isinstance(shape, tuple) else dict(lengths=shape)
            call = random_call(**shaped, H=H, HV=HV, K=dims[0], V=dims[1], dtype=rng.choice([torch.bfloat16,
                               torch.float16]), seed=i, initial_state=rng.random() < 0.7,
                               state_layout=rng.choice(["kv", "vk"]))
            if host_copy is False:
                call.pop("cu_seqlens_cpu")
            if call["initial_state"] is not None and rng.random() < 0.5:
                call["initial_state"] = call["initial_state"].to(torch.bfloat16)
            call.update(output_final_state=rng.random() < 0.7, use_qk_l2norm_in_kernel=rng.random() < 0.5,
                        backend=backend)
            assert make_problem(**call).context_parallel == "auto"
            assert plan_for_problem(make_problem(**call), device.sm_count).enabled, f"case {i}"
            taken = _compare(call, runs, i)
            assert taken == routed, f"case {i}: routed {taken}, expected {routed}"
            assert "_segment_scan_fwd_kernel" in [name for name, *_ in _labels(runs, (), {})[0]]


def _plain_call(rng) -> dict:
    """A call every route takes: contiguous inputs, a float32 initial state, no pool."""
    while True:
        call, takes = _random_form(rng)
        if takes and call.get("initial_state") is not None and "state_indices" not in call:
            return dict(call, backend="gluon_sm90")


def test_a_route_leaves_to_the_python_path_what_it_does_not_decide(native_built, monkeypatch):
    clear_plan_cache()
    rng = random.Random(99)
    with stubbed_launches() as stub, public_calls("gluon_sm90", assumed_device("sm_90")):
        call = _plain_call(rng)
        assert _compare(call, stub.runs, 0) == 1

        def routed(**changes):
            c = dict(call, **changes)
            return routes.routed_call(c["q"], c["k"], c["v"], c["g"], c["beta"], c.get("scale"),
                                      c.get("initial_state"), c.get("output_final_state", False), c.get("cu_seqlens"),
                                      c.get("cu_seqlens_cpu"), c.get("use_qk_l2norm_in_kernel", False),
                                      c.get("state_layout"), c["backend"], c.get("context_parallel", "auto"),
                                      c.get("state_indices"), c.get("inplace_final_state", False))

        assert routed() is not None
        counted = dict(ROUTE_CALLS)
        monkeypatch.setenv("GDN_DEBUG_CHECKS", "1")  # checks that read the device: the Python path's
        assert routed() is None
        api.chunk_gated_delta_rule(**call)
        monkeypatch.delenv("GDN_DEBUG_CHECKS")
        monkeypatch.setenv("GDN_DISPATCH_ROUTES", "0")  # routes off
        assert routed() is None
        monkeypatch.delenv("GDN_DISPATCH_ROUTES")
        assert routed(context_parallel=2) is None  # a forced segment count
        assert routed(scale=1) is None  # an int scale: the contract converts it
        assert routed(state_layout="KV ") is None  # spellings the contract reads or rejects
        assert routed(inplace_final_state=True) is None  # a write-back without a pool: the contract raises
        assert routed(inplace_final_state=1) is None
        assert dict(ROUTE_CALLS) == counted  # none of them reached a route

        routes_made = len(routes._ROUTES)
        monkeypatch.setenv("GDN_SELFTEST", "0")  # the environment the registry reads: another form
        api.chunk_gated_delta_rule(**call)
        assert len(routes._ROUTES) == routes_made + 1
        monkeypatch.delenv("GDN_SELFTEST")

        # Whether some sequence ends inside a chunk picks the kernels' specialization (a
        # constexpr, which the launch records do not show): each its own form and route.
        # Without a host copy of the offsets the kernels assume tails: the tails' form.
        for lengths, host_copy, new in (([64, 128], True, 1), ([64, 100], True, 1), ([64, 128], False, 0)):
            tails_call = random_call(lengths=lengths, H=2, HV=4, K=64, V=64, device="cpu", seed=len(routes._ROUTES))
            if not host_copy:
                tails_call.pop("cu_seqlens_cpu")
            made = len(routes._ROUTES)
            api.chunk_gated_delta_rule(**tails_call, output_final_state=True, backend="gluon_sm90")
            assert len(routes._ROUTES) == made + new, (lengths, host_copy)
        for T in (128, 100):
            made = len(routes._ROUTES)
            api.chunk_gated_delta_rule(**random_call(batch=(2, T), H=2, HV=4, K=64, V=64, device="cpu", seed=T),
                                       output_final_state=True, backend="gluon_sm90")
            assert len(routes._ROUTES) == made + 1, T

        before = ROUTE_CALLS["declined"]
        with mock.patch.object(torch.cuda, "current_device", lambda: 3):  # not the tensors' device
            problem = make_problem(**call)
            route, _ = next(iter(routes._ROUTES.values()))
            assert route(problem.q, problem.k, problem.v, problem.g, problem.beta, call.get("cu_seqlens"),
                         problem.initial_state, None, problem.B, problem.T, problem.N, None, 0.5) is None
        assert ROUTE_CALLS["declined"] == before  # the runner alone: nothing counted, nothing launched

        broken = dict(call, k=call["k"][:, :, :1])  # a broken call raises the contract's message
        with pytest.raises(GDNInputError) as routed_error:
            api.chunk_gated_delta_rule(**broken)
        with mock.patch.object(api, "routed_call", lambda *a: None), pytest.raises(GDNInputError) as python_error:
            api.chunk_gated_delta_rule(**broken)
        assert str(routed_error.value) == str(python_error.value)

        assert routes._ROUTES
        clear_plan_cache()  # the plans a route leads to are gone, and the routes with them
        assert not routes._ROUTES
        tg_program.clear_programs()


def test_a_declined_call_keeps_the_forms_registry_choice(native_built, monkeypatch):
    """A call the runner declines (here one whose program refuses its float16 initial
    state, which the Python path converts; context parallelism on: a long prompt on a
    2/4-head shard) runs the Python path from the contract on with the route's registry
    choice: the same launches as with routes off, and no second registry choice."""
    from gdn_dispatch import registry

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    chosen = []
    real_select = registry.select

    def counting_select(*args, **kwargs):
        chosen.append(1)
        return real_select(*args, **kwargs)

    with stubbed_triton_launches() as runs, public_calls("triton_generic", assumed_device("sm_90")), \
            mock.patch.object(op, "select", counting_select), mock.patch.object(routes, "select", counting_select):
        call = dict(random_call(lengths=[20000, 3000], H=2, HV=4, K=64, V=64, device="cpu", seed=21),
                    output_final_state=True, backend="triton_generic")
        call["initial_state"] = call["initial_state"].to(torch.float16)
        assert make_problem(**call).chunks.num_seqs == 2
        declined = ROUTE_CALLS["declined"]
        assert _compare(call, runs, 0) == 0  # the route declines it; launches as without routes
        assert ROUTE_CALLS["declined"] > declined
        assert any("segment" in name for name, *_ in _labels(runs, (), {})[0])  # context parallelism ran
        chosen.clear()
        api.chunk_gated_delta_rule(**call)
        assert chosen == []  # the route's kept choice: no registry call
        with mock.patch.object(api, "routed_call", lambda *a: None):
            api.chunk_gated_delta_rule(**call)
        assert chosen == [1]  # the Python path without routes chooses
