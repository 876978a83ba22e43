"""Kernel build flags set for a whole run (:func:`gdn_dispatch.testing.set_build_flags`,
the ``--build-flag`` option of pytest and of tests/sanitize.py): a GPU run of the test
tier or the sanitizer on a build not shipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gdn_dispatch.testing import call_in_fresh_process, set_build_flags

pytest.importorskip("triton.experimental.gluon")

from gdn_dispatch.backends.gluon_common import blocked_inverse  # noqa: E402
from gdn_dispatch.backends.gluon_sm90 import fused  # noqa: E402

#: Set in the child run of :func:`test_the_option_sets_flags_in_every_worker`.
PROBE = "GDN_BUILD_FLAG_PROBE"


def test_flags_keep_their_type(monkeypatch):
    for module, name in ((blocked_inverse, "HALF_TABLES"), (fused, "AUX_T"), (fused, "AUX_REGS")):
        monkeypatch.setattr(module, name, getattr(module, name))
    done = set_build_flags(["gluon_common.blocked_inverse.HALF_TABLES=0", "gluon_sm90.fused.AUX_T = off",
                            "gluon_sm90.fused.AUX_REGS=96"])
    assert done == {"gluon_common.blocked_inverse.HALF_TABLES": False, "gluon_sm90.fused.AUX_T": False,
                    "gluon_sm90.fused.AUX_REGS": 96}
    assert type(blocked_inverse.HALF_TABLES).__name__ == "constexpr" and blocked_inverse.HALF_TABLES.value is False
    assert fused.AUX_T is False
    assert type(fused.AUX_REGS).__name__ == "constexpr" and fused.AUX_REGS.value == 96
    set_build_flags(["gluon_common.blocked_inverse.HALF_TABLES=true"])
    assert blocked_inverse.HALF_TABLES.value is True


@pytest.mark.parametrize("setting, words", [
    ("HALF_TABLES=1", "expected MODULE.NAME=VALUE"),
    ("gluon_common.blocked_inverse.HALF_TABLES", "expected MODULE.NAME=VALUE"),
    ("gluon_common.no_such_module.FLAG=1", "no module gdn_dispatch.backends.gluon_common.no_such_module"),
    ("gluon_common.blocked_inverse.NO_SUCH_FLAG=1", "has no flag NO_SUCH_FLAG"),
    ("gluon_common.blocked_inverse.HALF_TABLES=yes", "does not replace"),
    ("gluon_sm90.fused.AUX_REGS=on", "does not replace"),
])
def test_bad_settings_are_named(setting, words, monkeypatch):
    monkeypatch.setattr(blocked_inverse, "HALF_TABLES", blocked_inverse.HALF_TABLES)
    with pytest.raises(ValueError, match=words) as raised:
        set_build_flags([setting])
    assert repr(setting) in str(raised.value)


def test_the_option_sets_flags_in_every_worker():
    """``pytest --build-flag`` with pytest-xdist: each worker process sees the flag (set off:
    it ships on)."""
    tests = Path(__file__).resolve().parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                          "--build-flag", "gluon_common.blocked_inverse.HALF_TABLES=0",
                          str(tests / "test_build_flags.py"), "-k", "probe"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, PROBE: "1"},
                         cwd=tests.parent)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "4 passed" in run.stdout, run.stdout[-3000:]


def test_a_fresh_process_sees_the_flags():
    """:func:`call_in_fresh_process`: the flags set before the module loads, the value back
    through JSON, a failing call raised with its stderr."""
    here = Path(__file__)
    flag = "gluon_common.blocked_inverse.HALF_TABLES"
    assert call_in_fresh_process(here, "m.blocked_inverse.HALF_TABLES.value", [f"{flag}=1"]) is True
    assert call_in_fresh_process(here, "m.blocked_inverse.HALF_TABLES.value", [f"{flag}=0"]) is False
    assert call_in_fresh_process(here, "(m.PROBE, 2)") == ["GDN_BUILD_FLAG_PROBE", 2]
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        call_in_fresh_process(here, "1 / 0")


if os.environ.get(PROBE):
    @pytest.mark.parametrize("i", range(4))
    def test_probe(i):
        assert blocked_inverse.HALF_TABLES.value is False
