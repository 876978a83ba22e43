"""The self-test and its gate, on the CPU: a stand-in sm_100 device and stand-in children.

The gate's children here are small Python scripts (pass, exit 1, hang) installed with
``gate.use_child_command``; the real child runs in the CLI tests (the reference backend).
"""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from gdn_dispatch import GDNDispatchError, gate, registry
from gdn_dispatch.contract import make_problem
from gdn_dispatch.device import CPU, assumed_device, use_probe
from gdn_dispatch.registry import QWEN35_CALL, call_reason, explain, load_registry, select
from gdn_dispatch.selftest import cases_for, picked_backends
from gdn_dispatch.testing import random_call

B200 = assumed_device("sm_100")

#: A stand-in self-test child: appends its backend to a log file, then passes, fails or hangs.
FAKE_CHILD = r"""
import json, sys, time
log, behaviour, backend = sys.argv[1:4]
with open(log, "a") as f:
    f.write(backend + "\n")
if behaviour == "no-start":
    print("ModuleNotFoundError: No module named 'gdn_dispatch'", file=sys.stderr)
    sys.exit(1)
print("GDN_SELFTEST_START", flush=True)
if behaviour == "fail":
    print("Traceback: illegal memory access", file=sys.stderr)
    sys.exit(1)
if behaviour == "hang":
    time.sleep(120)
print("GDN_SELFTEST_CASE " + json.dumps({"id": "fake-case", "ok": True, "error": 1e-6}), flush=True)
print("GDN_SELFTEST_RESULT " + json.dumps({"status": "passed", "total": 1}), flush=True)
"""


class Children:
    """Installs the stand-in child; ``runs`` lists the backends it was started for."""

    def __init__(self, tmp_path, behaviours):
        self.log = tmp_path / "children.log"
        self.behaviours = behaviours

    def __call__(self, backend, device_label, quick):
        assert quick and device_label == "cuda:0"
        return [sys.executable, "-c", FAKE_CHILD, str(self.log), self.behaviours.get(backend, "pass"), backend]

    @property
    def runs(self):
        return self.log.read_text().split() if self.log.exists() else []


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A private verdict cache, no verdicts in memory, no kept selections."""
    gate.forget_verdicts()
    monkeypatch.setattr(registry, "_selections", {})
    environ = {"GDN_SELFTEST_CACHE": str(tmp_path / "cache")}
    yield environ
    gate.forget_verdicts()


class OneGpuProbe:
    """One stand-in GPU, no driver needed."""

    unavailable_reason = None

    def __init__(self, device):
        self.device = device

    def count(self):
        return 1

    def info(self, index):
        return self.device

    def all(self):
        return [self.device, CPU]

    def for_torch_device(self, device):
        return CPU if device.type == "cpu" else self.device


def _verdict(explanation, name):
    return next(v for v in explanation.verdicts if v.name == name)


def test_passed_self_test_runs_once_then_its_verdict_is_reused(tmp_path, env, caplog):
    children = Children(tmp_path, {})
    with gate.use_child_command(children), caplog.at_level("WARNING", logger="gdn_dispatch"):
        first = explain(B200, QWEN35_CALL, env=env, run_selftest=True)
        assert first.selected == "gluon_sm100" and children.runs == ["gluon_sm100"]
        assert "self-test passed on B200 (assumed) (1/1 cases)" in _verdict(first, "gluon_sm100").reason
        assert "self-testing gluon_sm100 on cuda:0" in caplog.text  # visible, not a silent pause
        explain(B200, QWEN35_CALL, env=env, run_selftest=True)  # memory
        gate.forget_verdicts()
        again = explain(B200, QWEN35_CALL, env=env, run_selftest=True)  # the cache file
        assert again.selected == "gluon_sm100" and children.runs == ["gluon_sm100"]
    cached = list((tmp_path / "cache").glob("selftest-gluon_sm100-*.json"))
    assert len(cached) == 1
    record = json.loads(cached[0].read_text())
    assert record["status"] == "passed"
    assert set(record["key"]) == {"backend", "device", "capability", "driver", "gdn_dispatch", "triton"}


def test_select_runs_the_gate_once_and_keeps_the_choice(tmp_path, env, monkeypatch):
    problem = make_problem(**random_call(batch=(1, 8), K=64, V=64, dtype=torch.bfloat16))
    module, _ = registry._import_backend("gdn_dispatch.backends.gluon_sm100")
    monkeypatch.setattr(module, "unsupported_reason", lambda problem: None)  # CPU tensors stand in
    children = Children(tmp_path, {})
    with gate.use_child_command(children):
        first = select(B200, problem, env=env)
        assert select(B200, problem, env=env) is first
    assert first.spec.name == "gluon_sm100" and children.runs == ["gluon_sm100"]


def test_failed_self_test_routes_to_the_next_backend_with_the_reason(tmp_path, env, monkeypatch, capsys):
    children = Children(tmp_path, {"gluon_sm100": "fail"})
    with gate.use_child_command(children):
        explanation = explain(B200, QWEN35_CALL, env=env, run_selftest=True)
    # triton_generic is unverified on sm_100 too: it is tested next, and passes.
    assert children.runs == ["gluon_sm100", "triton_generic"]
    assert explanation.selected == "triton_generic"
    verdict = _verdict(explanation, "gluon_sm100")
    assert verdict.status == "rejected"
    assert verdict.reason == ("sm_100 not in verified_on; self-test failed on B200 (assumed): the child exited "
                              "with code 1 after 0 cases: Traceback: illegal memory access; GDN_SELFTEST=1 re-runs it")
    # info reads the recorded verdict (and runs nothing).
    from gdn_dispatch.__main__ import main

    monkeypatch.setenv("GDN_SELFTEST_CACHE", env["GDN_SELFTEST_CACHE"])
    monkeypatch.delenv("GDN_BACKEND", raising=False)
    monkeypatch.delenv("GDN_SELFTEST", raising=False)
    gate.forget_verdicts()
    with use_probe(OneGpuProbe(B200)):
        assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "gluon_sm100     rejected       sm_100 not in verified_on; self-test failed on B200 (assumed)" in out
    assert "selected: triton_generic" in out
    assert children.runs == ["gluon_sm100", "triton_generic"]


def test_hanging_child_is_killed_at_its_timeout(tmp_path, env):
    children = Children(tmp_path, {"gluon_sm100": "hang"})
    start = time.perf_counter()
    with gate.use_child_command(children):
        explanation = explain(B200, QWEN35_CALL, env={**env, "GDN_SELFTEST_TIMEOUT": "2"}, run_selftest=True)
    assert time.perf_counter() - start < 60
    assert explanation.selected == "triton_generic"
    assert "self-test failed on B200 (assumed): timed out after 2 s (0 cases done)" in _verdict(
        explanation, "gluon_sm100").reason


def test_hanging_child_takes_its_own_children_down(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    script = f"sleep 120 & echo $! > {pid_file}; wait"
    with gate.use_child_command(lambda backend, label, quick: ["sh", "-c", script]):
        result = gate.run_child("gluon_sm100", "cuda:0", quick=True, timeout_s=2)
    assert result.status == "failed" and result.reason.startswith("timed out after 2 s")
    pid = int(pid_file.read_text())
    for _ in range(50):  # SIGKILL is asynchronous; a killed process may linger as a zombie briefly
        try:
            state = open(f"/proc/{pid}/status").read()
        except FileNotFoundError:
            break
        if "\nState:\tZ" in state:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {pid} still running after the timeout")


def test_gdn_selftest_0_trusts_and_1_reruns_once(tmp_path, env):
    children = Children(tmp_path, {})
    with gate.use_child_command(children):
        trusted = explain(B200, QWEN35_CALL, env={**env, "GDN_SELFTEST": "0"}, run_selftest=True)
        assert trusted.selected == "gluon_sm100" and children.runs == []
        assert "trusted without self-test (GDN_SELFTEST=0)" in _verdict(trusted, "gluon_sm100").reason
        explain(B200, QWEN35_CALL, env=env, run_selftest=True)
        gate.forget_verdicts()
        rerun = {**env, "GDN_SELFTEST": "1"}
        explain(B200, QWEN35_CALL, env=rerun, run_selftest=True)  # ignores the cache file
        explain(B200, QWEN35_CALL, env=rerun, run_selftest=True)  # once per process
    assert children.runs == ["gluon_sm100", "gluon_sm100"]


def test_malformed_gdn_selftest_is_an_error(env):
    with pytest.raises(GDNDispatchError, match=r"GDN_SELFTEST='yes': expected 0 .* 1 .* or unset"):
        explain(B200, QWEN35_CALL, env={**env, "GDN_SELFTEST": "yes"})
    with pytest.raises(GDNDispatchError, match=r"GDN_SELFTEST_TIMEOUT='-3': expected a positive number"):
        with gate.use_child_command(lambda *a: ["true"]):
            explain(B200, QWEN35_CALL, env={**env, "GDN_SELFTEST_TIMEOUT": "-3"}, run_selftest=True)


def test_verified_capability_forced_backend_and_cpu_are_not_gated(tmp_path, env):
    children = Children(tmp_path, {})
    with gate.use_child_command(children):
        assert explain(assumed_device("sm_90"), QWEN35_CALL, env=env, run_selftest=True).selected == "gluon_sm90"
        forced = explain(B200, QWEN35_CALL, env=env, backend="gluon_sm100", run_selftest=True)
        assert forced.selected == "gluon_sm100"
        assert explain(CPU, QWEN35_CALL, env=env, run_selftest=True).selected == "reference"
    assert children.runs == []


def test_explain_without_running_notes_the_first_call_test(tmp_path, env):
    children = Children(tmp_path, {})
    with gate.use_child_command(children):
        explanation = explain(B200, QWEN35_CALL, env=env)
    assert explanation.selected == "gluon_sm100" and children.runs == []
    assert "not yet self-tested on B200 (assumed): its first call runs the quick self-test" in _verdict(
        explanation, "gluon_sm100").reason


def test_registry_verified_on():
    rows = {r.name: r for r in load_registry()}
    assert rows["gluon_sm100"].verified_on == ()
    assert rows["gluon_sm90"].verified_on == ((9, 0),) and rows["triton_generic"].verified_on == ((9, 0),)
    assert rows["reference"].verified_on is None


@pytest.mark.parametrize("quick", [True, False], ids=["quick", "full"])
@pytest.mark.parametrize("name", [r.name for r in load_registry()])
def test_cases_are_admitted_and_cover_the_contract(name, quick):
    spec = next(r for r in load_registry() if r.name == name)
    for small in (False, True):
        cases = cases_for(spec, quick=quick, small=small)
        assert len({c.id for c in cases}) == len(cases)
        assert all(call_reason(spec, c.call_spec()) is None for c in cases), [c.id for c in cases]
        assert {c.layout for c in cases} == {"kv", "vk"}
        assert any(c.l2 for c in cases) and any(not c.h0 for c in cases)
        assert any(c.HV != c.H for c in cases) and any(c.HV == c.H for c in cases)
        assert any(c.K < c.V for c in cases) and any(c.K > c.V for c in cases)
        assert any(c.lengths and 0 in c.lengths for c in cases)
        assert any(c.lengths and any(n % 64 for n in c.lengths) for c in cases)  # ragged tails
        if not quick and "state_pool" in spec.features:
            assert any(c.pool for c in cases)


def test_picked_backends():
    assert picked_backends(CPU, small=True) == {"reference"}
    assert picked_backends(assumed_device("sm_90")) == {"gluon_sm90", "triton_generic"}
    assert picked_backends(B200) == {"gluon_sm100", "triton_generic"}


def test_child_result_names_the_failing_case():
    cases = [{"id": "a", "ok": True, "error": 1e-6}, {"id": "b", "ok": False, "error": 1.2, "message": "rel. RMS error 1.20e+00 > 5e-03"}]
    result = gate._child_result("x", cases, {"status": "failed", "total": 2}, 1, False, 10, 1.0, [])
    assert (result.status, result.passed, result.total, result.worst_error) == ("failed", 1, 2, 1.2)
    assert result.reason == "case b: rel. RMS error 1.20e+00 > 5e-03"


@pytest.mark.slow
def test_triton_generic_under_the_interpreter_when_named(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("GDN_BACKEND", "TRITON_INTERPRET")}
    env["GDN_SELFTEST_CACHE"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-m", "gdn_dispatch", "selftest", "--backend", "triton_generic", "--quick"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    row = next(line for line in done.stdout.splitlines() if line.startswith("triton_generic"))
    assert row.split()[:3] == ["triton_generic", "no", "3/3"] and row.endswith("PASS")


def test_child_that_never_starts_is_inconclusive_and_not_cached(tmp_path, env):
    children = Children(tmp_path, {"gluon_sm100": "no-start"})
    with gate.use_child_command(children):
        explanation = explain(B200, QWEN35_CALL, env=env, run_selftest=True)
        assert explanation.selected == "triton_generic"
        reason = _verdict(explanation, "gluon_sm100").reason
        assert "self-test could not run on B200 (assumed): the child (-c " in reason
        assert reason.endswith("ended with code 1 before testing: ModuleNotFoundError: No module named 'gdn_dispatch'")
        explain(B200, QWEN35_CALL, env=env, run_selftest=True)  # kept for this process
        assert children.runs == ["gluon_sm100", "triton_generic"]
    assert not list((tmp_path / "cache").glob("selftest-gluon_sm100-*.json"))  # not on disk
