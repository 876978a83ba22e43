"""The self-test gate: a backend unverified on a device's capability earns its calls first.

A registry row may list ``verified_on`` capabilities, those where the backend has been run
against the reference on real hardware. On any other capability the first call that would
select the backend runs the quick self-test (:mod:`gdn_dispatch.selftest`) in a child
process with a timeout, so that a hang or a fault cannot take the caller down, and the
registry uses the backend only if it passed. The verdict is kept in memory for the process
and as JSON in the user cache directory for the machine, keyed by device model,
capability, driver, gdn-dispatch and triton versions: a new driver or release tests again.

``GDN_SELFTEST=0`` trusts unverified backends without testing; ``GDN_SELFTEST=1`` re-runs
their self-tests (once per process). ``GDN_SELFTEST_CACHE`` names the cache directory
(default ``$XDG_CACHE_HOME/gdn_dispatch`` or ``~/.cache/gdn_dispatch``) and
``GDN_SELFTEST_TIMEOUT`` the child's time limit in seconds (default 300). Each is read at
call time.

This module imports nothing of the registry's: the registry asks it, and
:mod:`gdn_dispatch.selftest` (which reads the registry) writes its verdicts here.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "GDN_SELFTEST"
CACHE_ENV_VAR = "GDN_SELFTEST_CACHE"
TIMEOUT_ENV_VAR = "GDN_SELFTEST_TIMEOUT"
#: Seconds the gate's child may run: a cold Triton cache compiles a few kernels first.
DEFAULT_TIMEOUT_S = 300.0
#: Markers of the child's machine-readable stdout lines (one JSON object each after the
#: case and result markers). The start line comes once the child has imported the package
#: and found the backend: a child that ends without it never began testing.
START_MARKER = "GDN_SELFTEST_START"
CASE_MARKER = "GDN_SELFTEST_CASE "
RESULT_MARKER = "GDN_SELFTEST_RESULT "

log = logging.getLogger("gdn_dispatch")


@dataclass(frozen=True)
class ChildResult:
    """What one self-test child reported.

    Attributes
    ----------
    backend : str, the backend tested.
    status : "passed", "failed" (wrong numbers, an exception, a crash, a timeout) or
        "inconclusive" (the child could not test: it did not start, no device, out of
        memory); an inconclusive verdict is kept for the process only, never on disk.
    passed, total : int, cases passed and cases run.
    worst_error : float, the largest relative RMS error of any case (inf for a case that
        raised or wrote NaN), NaN when no case ran.
    seconds : float, wall time of the child.
    reason : str, why it failed ("" when it passed).
    cases : tuple of dict, each case's report as the child printed it.
    """

    backend: str
    status: str
    passed: int
    total: int
    worst_error: float
    seconds: float
    reason: str = ""
    cases: tuple = ()


@dataclass(frozen=True)
class GateVerdict:
    """The gate's answer for one backend on one device: may it be selected, and why."""

    allowed: bool
    note: str


def _default_child_command(backend: str, device_label: str, quick: bool) -> list[str]:
    """``python -m gdn_dispatch.selftest --child ...``: the self-test of one backend."""
    command = [sys.executable, "-m", "gdn_dispatch.selftest", "--child", backend, "--device", device_label]
    return command + (["--quick"] if quick else [])


_CHILD_COMMAND: contextvars.ContextVar = contextvars.ContextVar("gdn_selftest_child", default=None)


def child_command(backend: str, device_label: str, quick: bool) -> list[str]:
    """The argv that self-tests ``backend`` on ``device_label`` ("cuda:0", "cpu"): the
    default command, or the one installed by :func:`use_child_command`."""
    return (_CHILD_COMMAND.get() or _default_child_command)(backend, device_label, quick)


@contextlib.contextmanager
def use_child_command(factory):
    """Within the block, self-test children run ``factory(backend, device_label, quick)``
    (an argv list) instead of the real self-test: how tests stand in a hanging or failing
    child without GPU work."""
    token = _CHILD_COMMAND.set(factory)
    try:
        yield factory
    finally:
        _CHILD_COMMAND.reset(token)


def command_text(backend: str) -> str:
    """The child's command, short, for messages."""
    return " ".join(child_command(backend, "cuda:0", True)[1:4])


def child_env(device_label: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: the caller's (CUDA_VISIBLE_DEVICES and the Triton cache
    included), with no GDN_BACKEND (the child names its backend), the gate off inside the
    child, this package importable, and Triton's interpreter on for a CPU device."""
    child = dict(os.environ if env is None else env)
    child.pop("GDN_BACKEND", None)
    child[ENV_VAR] = "0"
    root = str(Path(__file__).resolve().parents[1])
    child["PYTHONPATH"] = os.pathsep.join(p for p in (root, child.get("PYTHONPATH")) if p)
    if device_label == "cpu":
        child["TRITON_INTERPRET"] = "1"
    return child


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child and anything it started (it leads its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, AttributeError):
        proc.kill()


def run_child(backend: str, device_label: str, *, quick: bool, timeout_s: float,
              env: dict[str, str] | None = None, on_case=None) -> ChildResult:
    """Run one self-test child and read its report; never raises for what the child does.

    Parameters
    ----------
    backend : str, registry name of the backend to test.
    device_label : str, "cuda:N" or "cpu".
    quick : bool, the quick case set (the gate's) instead of the full one.
    timeout_s : float, the child is killed (with its process group) after this many seconds.
    env : dict, the environment to derive the child's from (default os.environ).
    on_case : callable(dict) or None, called with each case's report as it arrives.
    """
    command = child_command(backend, device_label, quick)
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=child_env(device_label, env), start_new_session=True)
    cases, result, tail, started = [], {}, [], []

    def read_stdout():
        for line in proc.stdout:
            if line.startswith(START_MARKER):
                started.append(True)
            elif line.startswith(CASE_MARKER):
                case = json.loads(line[len(CASE_MARKER):])
                cases.append(case)
                if on_case is not None:
                    on_case(case)
            elif line.startswith(RESULT_MARKER):
                result.update(json.loads(line[len(RESULT_MARKER):]))

    def read_stderr():
        for line in proc.stderr:
            tail.append(line.rstrip())
            del tail[:-20]

    readers = [threading.Thread(target=fn, daemon=True) for fn in (read_stdout, read_stderr)]
    for thread in readers:
        thread.start()
    try:
        code = proc.wait(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        code, timed_out = proc.wait(), True
    for thread in readers:
        thread.join(timeout=5)
    seconds = time.perf_counter() - start
    return _child_result(backend, cases, result, code, timed_out, timeout_s, seconds, tail, bool(started))


def _child_result(backend, cases, result, code, timed_out, timeout_s, seconds, tail, started=True) -> ChildResult:
    """The verdict from what the child printed and how it ended."""
    passed = sum(1 for c in cases if c.get("ok"))
    errors = [float(c.get("error", float("inf"))) for c in cases]
    worst = max(errors) if errors else float("nan")
    last = next((line for line in reversed(tail) if line.strip()), "")
    if timed_out:
        status, reason = "failed", f"timed out after {timeout_s:g} s ({len(cases)} cases done)"
    elif result.get("status") == "inconclusive":
        status, reason = "inconclusive", result.get("reason", "the child could not test")
    elif not started:
        status = "inconclusive"
        reason = f"the child ({command_text(backend)}) ended with code {code} before testing" + (
            f": {last}" if last else "")
    elif code != 0 and not result:
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        status, reason = "failed", f"the child {how} after {len(cases)} cases" + (f": {last}" if last else "")
    elif not result:
        status, reason = "failed", "the child printed no result"
    else:
        failures = [c for c in cases if not c.get("ok")]
        ok = code == 0 and not failures and passed == result.get("total", passed)
        status = "passed" if ok else "failed"
        if ok:
            reason = ""
        elif failures:
            reason = f"case {failures[0]['id']}: {failures[0].get('message', '')}"
        else:
            reason = result.get("reason") or f"the child exited with code {code} after {passed} passed cases"
    return ChildResult(backend=backend, status=status, passed=passed, total=int(result.get("total", len(cases))),
                       worst_error=worst, seconds=seconds, reason=reason, cases=tuple(cases))


def mode(env: dict[str, str] | None = None) -> str:
    """GDN_SELFTEST as "auto" (unset), "trust" (0) or "rerun" (1); ValueError otherwise."""
    value = (os.environ if env is None else env).get(ENV_VAR)
    if value is None or value.strip() == "":
        return "auto"
    if value.strip() in ("0", "1"):
        return "trust" if value.strip() == "0" else "rerun"
    raise ValueError(f"{ENV_VAR}={value!r}: expected 0 (trust unverified backends without testing), "
                     f"1 (re-run their self-tests) or unset")


def timeout_s(env: dict[str, str] | None = None) -> float:
    """The child's time limit: GDN_SELFTEST_TIMEOUT seconds, default 300."""
    value = (os.environ if env is None else env).get(TIMEOUT_ENV_VAR)
    if value is None:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"{TIMEOUT_ENV_VAR}={value!r}: expected a positive number of seconds")
    return seconds


def cache_dir(env: dict[str, str] | None = None) -> Path:
    """Where verdicts live: GDN_SELFTEST_CACHE, else $XDG_CACHE_HOME/gdn_dispatch, else
    ~/.cache/gdn_dispatch."""
    env = os.environ if env is None else env
    if env.get(CACHE_ENV_VAR):
        return Path(env[CACHE_ENV_VAR])
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gdn_dispatch"


@functools.cache
def driver_version() -> str:
    """The CUDA driver's version ("12080"), or "none" where there is no driver."""
    try:
        from cuda.bindings import driver

        err, version = driver.cuDriverGetVersion()
        return str(version) if err == driver.CUresult.CUDA_SUCCESS else "none"
    except Exception:  # no cuda-python or no driver: the key says so
        return "none"


@functools.cache
def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def verdict_key(backend: str, device) -> dict[str, str]:
    """What a verdict depends on: the backend, the device model and capability, the
    driver, and the gdn-dispatch and triton versions."""
    from gdn_dispatch import __version__

    major, minor = device.capability or (0, 0)
    return {"backend": backend, "device": device.name, "capability": f"{major}.{minor}",
            "driver": driver_version(), "gdn_dispatch": __version__, "triton": _package_version("triton")}


def _key_path(key: dict[str, str], env: dict[str, str] | None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(env) / f"selftest-{key['backend']}-{digest}.json"


_memory: dict[str, dict] = {}
_lock = threading.Lock()


def _memory_key(key: dict[str, str]) -> str:
    return json.dumps(key, sort_keys=True)


def read_verdict(key: dict[str, str], env: dict[str, str] | None = None) -> dict | None:
    """The recorded verdict for ``key`` (memory first, then the cache file), or None."""
    found = _memory.get(_memory_key(key))
    if found is not None:
        return found
    try:
        record = json.loads(_key_path(key, env).read_text())
    except (OSError, ValueError):
        return None
    if record.get("key") != key:
        return None
    _memory[_memory_key(key)] = record
    return record


def record_verdict(key: dict[str, str], result: ChildResult, env: dict[str, str] | None = None) -> dict:
    """Keep ``result`` as the verdict for ``key``: in memory, and (unless inconclusive) in
    the cache file, written atomically. Returns the record."""
    record = {"key": key, "status": result.status, "reason": result.reason, "passed": result.passed,
              "total": result.total, "worst_error": result.worst_error, "seconds": round(result.seconds, 2),
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _memory[_memory_key(key)] = record
    if result.status != "inconclusive":
        path = _key_path(key, env)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("gdn_dispatch: could not write the self-test verdict to %s: %s", path, exc)
    return record


def forget_verdicts() -> None:
    """Drop the verdicts kept in memory (the cache files stay)."""
    _memory.clear()


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive lock on ``path`` across processes (where fcntl exists), so that ranks
    starting together run one self-test and the others read its verdict."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: each process may test
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "w")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _describe(record: dict, device) -> str:
    if record["status"] == "passed":
        return f"self-test passed on {device.name} ({record['passed']}/{record['total']} cases)"
    if record["status"] == "inconclusive":
        return f"self-test could not run on {device.name}: {record['reason']}"
    return f"self-test failed on {device.name}: {record['reason']}; {ENV_VAR}=1 re-runs it"


def needs_gate(verified_on, device) -> bool:
    """True when ``device`` is a CUDA device whose capability the row has not verified
    (``verified_on`` None: the row is not gated)."""
    return verified_on is not None and device.kind == "cuda" and tuple(device.capability or ()) not in verified_on


def check(backend: str, verified_on, device, *, run: bool, env: dict[str, str] | None = None) -> GateVerdict:
    """May ``backend`` be selected on ``device``? Runs its self-test when ``run`` and no
    verdict is known; with ``run`` False (``info``, :func:`~gdn_dispatch.registry.explain`),
    an unknown verdict allows the backend and says that its first call will test it.

    Parameters
    ----------
    backend : str, registry name.
    verified_on : tuple of (major, minor) or None, the row's verified capabilities.
    device : DeviceInfo, the device the call runs on.
    run : bool, run the self-test now if no verdict is known.
    env : dict, the environment (GDN_SELFTEST, the cache directory); default os.environ.
    """
    if not needs_gate(verified_on, device):
        return GateVerdict(True, "")
    unverified = f"{device.arch} not in verified_on"
    how = mode(env)
    if how == "trust":
        return GateVerdict(True, f"{unverified}; trusted without self-test ({ENV_VAR}=0)")
    key = verdict_key(backend, device)
    record = None if how == "rerun" and _memory.get(_memory_key(key)) is None else read_verdict(key, env)
    if record is None and run:
        record = _run_gate(backend, device, key, env, rerun=how == "rerun")
    if record is None:
        return GateVerdict(True, f"{unverified}, not yet self-tested on {device.name}: its first call runs "
                                 f"the quick self-test (or run python -m gdn_dispatch selftest)")
    return GateVerdict(record["status"] == "passed", f"{unverified}; {_describe(record, device)}")


def _run_gate(backend: str, device, key: dict[str, str], env, *, rerun: bool) -> dict:
    """Run the quick self-test once for ``key`` (one thread, one process on the machine at
    a time; the others then read its verdict)."""
    path = _key_path(key, env)
    with _lock, _file_lock(path.with_suffix(".lock")):
        record = _memory.get(_memory_key(key))
        if record is None and not rerun:
            record = read_verdict(key, env)
        if record is not None:
            return record
        limit = timeout_s(env)
        log.warning("gdn_dispatch: self-testing %s on %s (%s, %s is not in its verified_on) in a child process "
                    "before its first call; once per machine (verdict cached in %s), up to %g s",
                    backend, device.label, device.name, device.arch, path.parent, limit)
        result = run_child(backend, device.label, quick=True, timeout_s=limit, env=env)
        record = record_verdict(key, result, env)
        outcome = "passed" if result.status == "passed" else f"{result.status}: {result.reason}"
        log.warning("gdn_dispatch: self-test of %s on %s %s (%.1f s)", backend, device.label, outcome,
                    result.seconds)
        return record
