"""``python -m gdn_dispatch bench --startup``: what a server pays before its first token.

Each figure comes from a fresh Python process (nothing imported, compiled or cached in
memory beforehand), on one CUDA device:

* import time of ``gdn_dispatch`` and of fla (``fla.ops.gated_delta_rule``);
* the first call of each GPU backend (forced) and of fla's ``chunk_gated_delta_rule``, a
  Qwen3.5-shaped ragged bf16 call: from a cold Triton cache (``TRITON_CACHE_DIR`` an empty
  folder) and from a warm one (the same folder, filled by the cold run);
* ``warmup`` with the same dims, cold and warm, then the compiles over 60 random ragged
  batches after it (plain, pooled, fused-projection, both varlen forms), counted through
  Triton's compile listener as ``tests/test_warmup.py`` counts them (0 expected).

A child prints one line ``RESULT_MARK {json}`` on stdout; its stderr (progress, Triton's
messages) goes to the terminal. The pure parts (table, JSON, the harness around a child
process) are tested on the CPU with stand-in children.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

from gdn_dispatch.progress import Progress

RESULT_MARK = "GDN_STARTUP_RESULT"
#: Longest a child may run (a cold warm-up compiles every specialization of the dims).
CHILD_TIMEOUT_S = 1800
#: Fresh processes per import figure (the median is reported).
IMPORT_REPEATS = 3
#: Per-device dims of the calls (Qwen3.5 at tensor parallel 1): H, HV, K, V.
DIMS = dict(H=16, HV=32, K=128, V=128)
#: Sequence lengths of the first call: a ragged prefill with long, short and partial chunks.
FIRST_CALL_LENGTHS = (2048, 1000, 513, 64, 1)
#: Most sequences per call, for warmup and the stream after it.
MAX_NUM_SEQS = 32
STREAM_BATCHES = 60
FLA = "fla"


@dataclass
class StartupRow:
    """One line of the table: seconds from a cold and from a warm Triton cache (None: not
    measured there), compiles counted (where counted), a note, and the error that kept a
    figure from being measured ("" when none)."""

    what: str
    cold_s: float | None = None
    warm_s: float | None = None
    cold_compiles: int | None = None
    warm_compiles: int | None = None
    note: str = ""
    error: str = ""


@dataclass
class StartupReport:
    device: str
    versions: dict
    rows: list[StartupRow] = field(default_factory=list)


# --- the child processes ----------------------------------------------------------------

def import_source(module: str) -> str:
    """A child that times ``import module`` from a bare interpreter."""
    return (f"import json, time\nt0 = time.perf_counter()\nimport {module}\n"
            f"print({RESULT_MARK!r}, json.dumps({{'seconds': time.perf_counter() - t0}}))\n")


def task_source(task: str, **params) -> str:
    """A child that runs :func:`child_task` ``task`` with ``params``."""
    return (f"import json\nfrom gdn_dispatch.bench_startup import child_task\n"
            f"print({RESULT_MARK!r}, json.dumps(child_task({task!r}, **json.loads({json.dumps(params)!r}))))\n")


def run_child(source: str, env: dict, timeout: float = CHILD_TIMEOUT_S) -> dict:
    """Run ``source`` in a fresh ``python -c`` with ``env`` added to this environment; its
    result dict, or ``{"error": why}`` (exit status, no result line, time limit)."""
    try:
        done = subprocess.run([sys.executable, "-c", source], env={**os.environ, **env}, stdout=subprocess.PIPE,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARK + " ")]
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stdout.strip().splitlines()[-3:])
        return {"error": f"exit status {done.returncode}, no result line" + (f" (stdout: {tail})" if tail else "")}
    return json.loads(lines[-1][len(RESULT_MARK) + 1:])


def _first_call_kwargs(device: str) -> dict:
    from gdn_dispatch.warmup_plan import WarmupCall, WarmupSpec, make_call

    spec = WarmupSpec(**DIMS)
    return make_call(spec, WarmupCall(FIRST_CALL_LENGTHS, None, True, True), device, random=True)


def child_task(task: str, *, device: str, backend: str | None = None) -> dict:
    """Runs in the child. ``first_call``: one call on ``backend`` (``"fla"``: fla's op),
    timed with its import; ``warmup``: :func:`gdn_dispatch.warmup` with :data:`DIMS`,
    then the compiles over :data:`STREAM_BATCHES` random ragged batches."""
    started = time.perf_counter()
    import torch

    if task == "first_call":
        if backend == FLA:
            from gdn_dispatch.bench_timing import load_fla

            fn, _, reason = load_fla()
            if fn is None:
                return {"error": reason}
        else:
            from gdn_dispatch import chunk_gated_delta_rule as fn
        kwargs = _first_call_kwargs(device)
        if backend == FLA:
            kwargs = {k: kwargs[k] for k in ("q", "k", "v", "g", "beta", "initial_state", "output_final_state",
                                             "cu_seqlens", "use_qk_l2norm_in_kernel")}
        else:
            kwargs["backend"] = backend
        imported = time.perf_counter()
        fn(**kwargs)
        torch.cuda.synchronize(device)
        return {"import_s": imported - started, "seconds": time.perf_counter() - imported}
    if task == "warmup":
        from gdn_dispatch import chunk_gated_delta_rule
        from gdn_dispatch.warmup import CompileCounter, warmup
        from gdn_dispatch.warmup_plan import WarmupSpec, make_call, random_ragged_stream

        report = warmup(num_heads=DIMS["H"], num_v_heads=DIMS["HV"], head_k_dim=DIMS["K"], head_v_dim=DIMS["V"],
                        device=device, max_num_seqs=MAX_NUM_SEQS)
        spec = WarmupSpec(**DIMS, max_num_seqs=MAX_NUM_SEQS)
        with CompileCounter() as counter, torch.inference_mode():
            for i, call in enumerate(random_ragged_stream(STREAM_BATCHES, seed=11, spec=spec, max_len=600)):
                chunk_gated_delta_rule(**make_call(spec, call, device, random=True, seed=i))
            torch.cuda.synchronize(device)
        return {"seconds": report.seconds, "compiles": report.compiles, "calls": report.calls,
                "backends": list(report.backends), "stream_compiles": counter.count}
    raise ValueError(f"task: expected 'first_call' or 'warmup', got {task!r}")


# --- the parent -------------------------------------------------------------------------

Runner = Callable[[str, dict], dict]


def measure(device: str, backends: list[str], want_fla: bool, *, runner: Runner = run_child,
            progress: bool = True) -> list[StartupRow]:
    """Every figure of the table, each from fresh children run by ``runner(source, env)``."""
    steps = 2 * IMPORT_REPEATS + 2 * (len(backends) + int(want_fla)) + 2
    bar = Progress(steps, "startup") if progress else None

    def child(label: str, source: str, env: dict) -> dict:
        result = runner(source, env)
        if bar:
            bar.step(label)
        return result

    rows = []
    for what, module in (("import gdn_dispatch", "gdn_dispatch"), ("import fla", "fla.ops.gated_delta_rule")):
        results = [child(what, import_source(module), {}) for _ in range(IMPORT_REPEATS)]
        errors = [r["error"] for r in results if "error" in r]
        rows.append(StartupRow(what, cold_s=None if errors else statistics.median(r["seconds"] for r in results),
                               note=f"median of {IMPORT_REPEATS} fresh processes",
                               error=errors[0] if errors else ""))
    for name in [*backends, *([FLA] if want_fla else [])]:
        with tempfile.TemporaryDirectory(prefix="gdn-startup-") as cache:
            env = {"TRITON_CACHE_DIR": cache}
            cold = child(f"first call {name} (cold)", task_source("first_call", device=device, backend=name), env)
            warm = child(f"first call {name} (warm)", task_source("first_call", device=device, backend=name), env)
        rows.append(_row(f"first call: {name}", cold, warm,
                         note=lambda r: f"after import {r['import_s']:.1f} s" if "import_s" in r else ""))
    with tempfile.TemporaryDirectory(prefix="gdn-startup-") as cache:
        env = {"TRITON_CACHE_DIR": cache}
        cold = child("warmup (cold)", task_source("warmup", device=device), env)
        warm = child("warmup (warm)", task_source("warmup", device=device), env)
    rows.append(_row("warmup", cold, warm, compiles="compiles",
                     note=lambda r: f"{r['calls']} calls on {', '.join(r['backends'])}" if "calls" in r else ""))
    rows.append(StartupRow(f"compiles over {STREAM_BATCHES} ragged batches after warmup",
                           cold_compiles=cold.get("stream_compiles"), warm_compiles=warm.get("stream_compiles"),
                           note="0 expected", error=cold.get("error") or warm.get("error") or ""))
    if bar:
        bar.close()
    return rows


def _row(what: str, cold: dict, warm: dict, *, compiles: str | None = None, note=lambda r: "") -> StartupRow:
    return StartupRow(what, cold_s=cold.get("seconds"), warm_s=warm.get("seconds"),
                      cold_compiles=cold.get(compiles) if compiles else None,
                      warm_compiles=warm.get(compiles) if compiles else None,
                      note=note(cold), error=cold.get("error") or warm.get("error") or "")


def _cell(seconds: float | None, compiles: int | None) -> str:
    text = "-" if seconds is None else f"{seconds:.2f} s"
    if compiles is not None:
        text = f"{compiles}" if seconds is None else f"{text} ({compiles} compiles)"
    return text


def format_table(report: StartupReport) -> str:
    """The figures as a fixed-width table, with the device and versions above it."""
    versions = ", ".join(f"{k} {v}" for k, v in report.versions.items())
    lines = [f"start-up on {report.device} ({versions}); every figure from a fresh process",
             f"{'':<46}{'cold Triton cache':>24}{'warm Triton cache':>24}  note"]
    for row in report.rows:
        lines.append(f"{row.what:<46}{_cell(row.cold_s, row.cold_compiles):>24}"
                     f"{_cell(row.warm_s, row.warm_compiles):>24}  {row.error or row.note}")
    return "\n".join(lines)


def write_json(report: StartupReport, path: str) -> None:
    with open(path, "w") as f:
        json.dump(asdict(report), f, indent=2)
        f.write("\n")


def gpu_backends(info, names: list[str]) -> list[str]:
    """Of ``names``, the kernel backends the registry lets run the first call on ``info``
    (each forced, as the child forces it)."""
    from gdn_dispatch.registry import CallSpec, explain

    call = CallSpec(K=DIMS["K"], V=DIMS["V"], qk_l2norm=True)
    return [n for n in names if n != "reference" and explain(info, call, backend=n).selected == n]


def run(args, names: list[str], want_fla: bool, *, probe=None, runner: Runner = run_child, out=None) -> int:
    """``bench --startup`` over the registry backends ``names`` (and fla when ``want_fla``
    and importable): 0 when every figure of ours was measured and no batch compiled after
    warmup, 1 otherwise, 2 without the CUDA device ``args.device``."""
    out = out or sys.stdout
    if probe is None:
        from gdn_dispatch.device import default_probe
        probe = default_probe()
    if probe.count() <= args.device:
        reason = probe.unavailable_reason or f"cuda:{args.device} asked, {probe.count()} CUDA device(s) present"
        print(f"bench --startup needs a CUDA device; found none: {reason}", file=sys.stderr)
        return 2
    info = probe.info(args.device)
    device = f"cuda:{args.device}"
    if want_fla:
        from gdn_dispatch.bench_timing import load_fla
        want_fla = load_fla()[0] is not None
    report = StartupReport(device=f"{info.name} ({device})", versions=_versions(),
                           rows=measure(device, gpu_backends(info, names), want_fla, runner=runner))
    print(format_table(report), file=out)
    if args.json:
        write_json(report, args.json)
    return exit_status(report.rows)


def exit_status(rows: list[StartupRow]) -> int:
    """1 when a figure of ours (fla's rows aside: fla is optional) could not be measured or
    a batch compiled after warmup, else 0."""
    failed = any(row.error and "fla" not in row.what for row in rows)
    stream = rows[-1]
    return 1 if failed or stream.cold_compiles != 0 or stream.warm_compiles != 0 else 0


def _versions() -> dict:
    import importlib.metadata

    from gdn_dispatch.bench_timing import fla_version

    found = {}
    for dist in ("gdn-dispatch", "torch", "triton"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "not installed"
    found["fla"] = fla_version() or "not installed"
    return found
