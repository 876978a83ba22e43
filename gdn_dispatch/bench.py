"""``python -m gdn_dispatch bench``: every backend side by side, against fla and the speed of light.

One run times, on one CUDA device, every gdn-dispatch backend that can run there (each
forced with ``backend=name``) and flash-linear-attention's ``chunk_gated_delta_rule``
when it is importable, over a table of Qwen3.5-shaped prefill calls. Each time is put
next to two yardsticks measured on the same device in the same run:

* the *speed of light* (SOL): ``max(min_bytes / copy bandwidth, flops / matmul rate)``,
  where ``min_bytes`` reads every input and writes every output exactly once and
  ``flops`` is fla's pipeline count (see :func:`flop_count`);
* fla's own time on the same inputs.

Timing protocol: a few warm-up calls (so Triton compiles and autotunes outside the
measurement), then ``--iters`` calls, each bracketed by a pair of CUDA events, with no
host synchronization in between; the median is reported. The calls rotate among enough
input sets that the sets together exceed the L2 cache several times over, so every call
reads its inputs from HBM as a real prefill would.

The jobs live in their own modules: :mod:`gdn_dispatch.bench_shapes` (shape table, byte
and FLOP counts, the bound), :mod:`gdn_dispatch.bench_ceiling` (the two measured ceilings),
:mod:`gdn_dispatch.bench_timing` (input sets, callers, the timer, one shape) and
:mod:`gdn_dispatch.bench_report` (results, the table, the JSON report, the plot). This module
is the command line and the run over every shape. The pure parts are tested on the CPU;
only the timers and :func:`run` need a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import sys

import torch

from gdn_dispatch import bench_cp, native
from gdn_dispatch.bench_ceiling import COPY_BYTES, MATMUL_N, measure_copy_bandwidth, measure_matmul_rate
from gdn_dispatch.bench_report import (
    FLA,
    ShapeResult,
    build_report,
    command_line,
    format_columns,
    format_shape_block,
    write_json,
    write_plot,
)
from gdn_dispatch.bench_shapes import (
    BOUND_FORMULA,
    FLOP_FORMULA,
    HEAD_DIM,
    BenchShape,
    io_bytes,
    shapes_for,
)
from gdn_dispatch.bench_timing import (
    Caller,
    Timer,
    bench_shape,
    cuda_event_timer,
    fla_caller,
    launches_note,
    load_fla,
    make_input_sets,
    ours_caller,
    rotation_count,
)
from gdn_dispatch.contract import CHUNK_SIZE
from gdn_dispatch.registry import CallSpec, backend_names, explain, load_registry

REFERENCE = "reference"

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``python -m gdn_dispatch bench``."""
    parser.add_argument("--backends", metavar="LIST",
                        help="comma-separated backends to time: registry names and 'fla' "
                             "(default: every registry backend that can run here except "
                             f"'{REFERENCE}', plus fla when importable)")
    parser.add_argument("--shapes", metavar="LIST",
                        help="comma-separated shape names or glob patterns (default: all; see --list-shapes)")
    parser.add_argument("--list-shapes", action="store_true", help="print the shape table and exit")
    parser.add_argument("--context-parallel", type=bench_cp.parse_mode, default="auto", metavar="auto|off|N|compare",
                        help="context_parallel of our calls (default auto); compare: each backend with off and "
                             "auto side by side, then the crossover table")
    parser.add_argument("--iters", type=_positive_int, default=30, help="timed calls per backend and shape (default 30)")
    parser.add_argument("--warmup", type=_non_negative_int, default=5,
                        help="untimed calls first, to compile and autotune (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--device", type=_cuda_index, default=0, metavar="cuda[:N]",
                        help="the CUDA device to bench (default cuda:0)")
    parser.add_argument("--qk-l2norm", action="store_true",
                        help="pass raw q, k with use_qk_l2norm_in_kernel=True (default: pre-normalized, False)")
    parser.add_argument("--check", action="store_true",
                        help="also report each backend's rel. RMS error of o and final state against fla "
                             f"(against '{REFERENCE}' when fla is unavailable)")
    parser.add_argument("--json", metavar="FILE", help="write every result to FILE as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="write a bar chart of fraction of SOL (needs matplotlib)")
    parser.add_argument("--host", action="store_true",
                        help="instead of the shape table: host cost per call (eager enqueue, per-step breakdown) "
                             "beside GPU time (CUDA-graph replay) for uniform and varlen calls, and the median of "
                             "a ragged stream of synchronized calls, per backend and fla")
    parser.add_argument("--host-calls", type=_positive_int, default=50, metavar="N",
                        help="back-to-back calls per --host measurement round (default 50)")
    parser.add_argument("--host-rounds", type=_positive_int, default=5, metavar="R",
                        help="rounds per --host measurement, the median reported (default 5)")
    parser.add_argument("--host-passes", type=_positive_int, default=3, metavar="P",
                        help="passes of --host enqueue rounds over every case, summarized last with each "
                             "row's median at the host's full speed (default 3)")
    parser.add_argument("--startup", action="store_true",
                        help="instead: start-up figures (imports, first calls and warmup from a cold and a warm "
                             "Triton cache, compiles after warmup), each from a fresh process")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def _cuda_index(text: str) -> int:
    """"cuda" -> 0, "cuda:N" or "N" -> N; the bench runs on CUDA devices only."""
    head, _, index = text.strip().partition(":")
    if head.isdigit() and not index:
        return int(head)
    if head == "cuda" and (not index or index.isdigit()):
        return int(index or 0)
    raise argparse.ArgumentTypeError(f"expected cuda or cuda:N, got {text!r}")


def requested_backends(text: str | None, names: list[str]) -> tuple[list[str], bool]:
    """Registry backends to try, in registry order, and whether fla is wanted.

    Default: every registry name but the reference, plus fla. Raises ValueError for an
    unknown name, listing the valid ones.
    """
    if not text:
        return [n for n in names if n != REFERENCE], True
    wanted = [w.strip() for w in text.split(",") if w.strip()]
    for w in wanted:
        if w != FLA and w not in names:
            raise ValueError(f"--backends: unknown backend {w!r}; valid names: {', '.join(names + [FLA])}")
    return [n for n in names if n in wanted], FLA in wanted


def no_device_reason(probe, index: int) -> str | None:
    """Why the benchmark cannot run on CUDA device ``index``, or None."""
    count = probe.count()
    if count == 0:
        return probe.unavailable_reason or "the CUDA driver reports 0 devices"
    if index >= count:
        return f"--device cuda:{index} asked, but only {count} CUDA device(s) present"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} was built without CUDA support"
    return None


# The least every shape asks of a backend. Varlen is left out on purpose: a backend
# without it still runs the uniform shapes, and the ragged one reports why it cannot.
_BENCH_CALL = CallSpec(dtype="bfloat16", K=HEAD_DIM, V=HEAD_DIM, varlen=False, grouped_value_heads=True,
                       initial_state=True, final_state=True)


def discover_backends(device_info, names: list[str], qk_l2norm: bool) -> tuple[list[str], dict[str, str]]:
    """Which of ``names`` can run on this device (each forced, as a call would), and why not."""
    call = dataclasses.replace(_BENCH_CALL, qk_l2norm=qk_l2norm)
    runnable, skipped = [], {}
    for name in names:
        exp = explain(device_info, call, backend=name)
        if exp.selected == name:
            runnable.append(name)
        else:
            skipped[name] = next(v.reason for v in exp.verdicts if v.name == name)
    return runnable, skipped


def run(args: argparse.Namespace, *, probe=None, out=None) -> int:
    """Run the benchmark; returns the exit code.

    0: done; 1: one of our backends raised on some shape, or nothing could run; 2: no CUDA
    device, or bad flags.
    ``probe`` (a DeviceProbe) and ``out`` (a text stream) are for tests.
    """
    out = out or sys.stdout
    try:
        shapes = shapes_for(args.shapes, listing=args.list_shapes)
        names, want_fla = requested_backends(args.backends, backend_names())
    except ValueError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.startup:
        from gdn_dispatch import bench_startup
        return bench_startup.run(args, names, want_fla, probe=probe, out=out)
    if args.list_shapes:
        for s in shapes:
            print(f"{s.name:<22} {s.describe()}", file=out)
        return EXIT_OK

    if probe is None:
        from gdn_dispatch.device import default_probe
        probe = default_probe()
    reason = no_device_reason(probe, args.device)
    if reason is not None:
        print(f"bench needs a CUDA device; found none: {reason}", file=sys.stderr)
        return EXIT_USAGE

    if getattr(args, "host", False):
        return _run_host(args, names, want_fla, probe, out)
    with torch.inference_mode():
        return _run_on_device(args, shapes, names, want_fla, probe, out)


def _run_host(args, names, want_fla, probe, out) -> int:
    """``--host``: :mod:`gdn_dispatch.bench_host` on the chosen device."""
    from gdn_dispatch.bench_host import run_host

    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    info = probe.for_torch_device(device)
    runnable, skipped = discover_backends(info, names, args.qk_l2norm)
    fla_fn, _, fla_reason = load_fla() if want_fla else (None, None, "not requested")
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", file=out)
    if want_fla and fla_fn is None:
        print(f"skipping fla: {fla_reason}", file=out)
    if not runnable and fla_fn is None:
        print(f"bench --host: nothing to time on {info.label} ({info.arch})", file=sys.stderr)
        return EXIT_FAILED
    print(f"gdn-dispatch bench --host on {info.name} ({info.arch})", file=out)
    return run_host(runnable, fla_fn, device, seed=args.seed, calls=args.host_calls, out=out,
                    rounds=args.host_rounds, passes=args.host_passes)


def _run_on_device(args, shapes, names, want_fla, probe, out) -> int:
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    info = probe.for_torch_device(device)
    props = torch.cuda.get_device_properties(device)
    l2_bytes = int(getattr(props, "L2_cache_size", 0) or 0)

    runnable, skipped = discover_backends(info, names, args.qk_l2norm)
    cp_mode = getattr(args, "context_parallel", "auto")
    callers: dict[str, Caller] = bench_cp.make_callers(runnable, cp_mode, ours_caller)
    fla_fn, fla_version, fla_reason = load_fla() if want_fla else (None, None, "not requested")
    if fla_fn is not None:
        callers[FLA] = fla_caller(fla_fn)

    if not callers:
        reasons = "; ".join(f"{k}: {v}" for k, v in skipped.items()) or "none requested"
        print(f"bench: nothing to time on {info.label} ({info.arch}): {reasons}; fla: {fla_reason}",
              file=sys.stderr)
        return EXIT_FAILED

    versions = {"python": sys.version.split()[0], "torch": torch.__version__,
                "triton": _dist_version("triton"), "gdn_dispatch": _gdn_version(), "fla": fla_version}
    bandwidth, matmul_rate = measure_copy_bandwidth(device), measure_matmul_rate(device)
    ceilings = {"copy_bandwidth_GBps": bandwidth / 1e9, "copy_bytes": COPY_BYTES,
                "matmul_bf16_TFLOPs": matmul_rate / 1e12, "matmul_n": MATMUL_N,
                "chunk": CHUNK_SIZE, "flop_formula": FLOP_FORMULA, "bound_formula": BOUND_FORMULA}
    check_against = None
    if args.check:
        check_against = (FLA, callers[FLA]) if FLA in callers else (REFERENCE, ours_caller(REFERENCE))

    # Our calls' host time depends on it (the launch paths' Python launchers otherwise).
    native_status = native.status()
    _print_header(out, info, versions, bandwidth, matmul_rate, args, skipped, want_fla, fla_reason,
                  check_against, native_status)
    results = bench_all(shapes, callers, device, bandwidth=bandwidth, matmul_rate=matmul_rate,
                        timer=cuda_event_timer, warmup=args.warmup, iters=args.iters, seed=args.seed,
                        qk_l2norm=args.qk_l2norm, l2_bytes=l2_bytes, check_against=check_against,
                        describe=launch_describer(device, info, cp_mode if cp_mode != bench_cp.COMPARE else "auto"),
                        out=out)
    report = build_report(
        results,
        device={"name": info.name, "capability": f"{info.capability[0]}.{info.capability[1]}",
                "arch": info.arch, "sm_count": info.sm_count, "l2_bytes": l2_bytes},
        versions=versions, ceilings=ceilings,
        settings={"iters": args.iters, "warmup": args.warmup, "seed": args.seed, "qk_l2norm": args.qk_l2norm,
                  "check_against": None if check_against is None else check_against[0],
                  "skipped": skipped, "fla_unavailable": fla_reason if fla_fn is None else None,
                  "native_host_layer": native_status},
        command=command_line(sys.argv),
    )
    report["settings"]["context_parallel"] = cp_mode
    if cp_mode == bench_cp.COMPARE:
        features = {spec.name: spec.features for spec in load_registry()}
        rows = bench_cp.crossover_rows(results, runnable, info.sm_count,
                                       lambda name: "context_parallel" in features.get(name, ()))
        print("\ncontext parallelism, off vs auto:\n" + "\n".join(bench_cp.format_crossover(rows)), file=out)
        report["context_parallel"] = [dataclasses.asdict(r) for r in rows]
    return finish_run(args, results, report, out)


def bench_all(shapes: list[BenchShape], callers: dict[str, Caller], device: torch.device | str, *,
              bandwidth: float, matmul_rate: float, timer: Timer, warmup: int, iters: int, seed: int,
              qk_l2norm: bool = False, l2_bytes: int = 0, check_against: tuple[str, Caller] | None = None,
              describe=None, out=None) -> list[ShapeResult]:
    """Each shape in turn: fresh rotating input sets, every caller timed, its block printed
    (``describe``: each of our rows' note, :func:`launch_describer`).

    The table is printed as it grows, so a long run shows progress and a crash mid-run
    still leaves the finished shapes on screen.
    """
    out = out or sys.stdout
    check = check_against is not None
    print(format_columns(check), file=out)
    results = []
    for shape in shapes:
        count = rotation_count(io_bytes(shape)[0], l2_bytes)
        sets = make_input_sets(shape, count, device, seed, qk_l2norm)
        result = bench_shape(shape, sets, callers, bandwidth=bandwidth, matmul_rate=matmul_rate,
                             timer=timer, warmup=warmup, iters=iters, check_against=check_against,
                             describe=describe)
        del sets
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()  # the next shape's sets may be larger; give the memory back
        results.append(result)
        print("\n".join(format_shape_block(result, check)), file=out, flush=True)
    return results


def launch_describer(device, info=None, context_parallel: str | int = "auto"):
    """The note of each of our rows on a CUDA ``device``: the kernels its backend launches
    for the shape with ``context_parallel`` (:func:`.bench_timing.launches_note`: the
    warp-specialized path or the pipeline, segmented or not), or None off CUDA. ``info``:
    the DeviceInfo to plan for (default: the probed one). Rows under another name (the
    labels of ``--context-parallel compare``) get no note; nor does a backend that cannot
    say: a note never costs a measurement."""
    if info is None:
        if torch.device(device).type != "cuda":
            return None
        from gdn_dispatch.device import default_probe

        info = default_probe().for_torch_device(torch.device(device))
    names = set(backend_names())

    def describe(name: str, inputs) -> str:
        if name not in names:
            return ""
        try:
            return launches_note(name, inputs, info, context_parallel)
        except Exception:  # an annotation of the table, not part of the measurement
            return ""
    return describe


def finish_run(args: argparse.Namespace, results: list[ShapeResult], report: dict, out) -> int:
    """Write --json and --plot, and return the exit code: 1 when one of ours raised."""
    if args.json:
        write_json(args.json, report)
        print(f"wrote {args.json}", file=out)
    if args.plot:
        note = write_plot(args.plot, report)
        print(note or f"wrote {args.plot}", file=out)
    failed = [f"{r.shape.name}/{m.backend}" for r in results for m in r.measurements if m.failed]
    if failed:
        print(f"bench: failed: {', '.join(failed)}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _print_header(out, info, versions, bandwidth, matmul_rate, args, skipped, want_fla, fla_reason,
                  check_against, native_status: str) -> None:
    print(f"gdn-dispatch bench on {info.name} ({info.arch}, {info.sm_count} SMs); "
          + ", ".join(f"{k} {v}" for k, v in versions.items() if v is not None), file=out)
    print(f"native host layer: {native_status}", file=out)
    print(f"ceilings: copy {bandwidth / 1e12:.2f} TB/s ({COPY_BYTES >> 20} MiB device-to-device, "
          f"read + written), bf16 matmul {matmul_rate / 1e12:.1f} TFLOP/s ({MATMUL_N}^3 torch.matmul)", file=out)
    print(f"FLOPs {FLOP_FORMULA}; {BOUND_FORMULA}", file=out)
    print("x SOL = time / bound, x fla = time / fla's time (both: lower is better); "
          f"ms = median of {args.iters} CUDA-event-timed calls after {args.warmup} warm-up calls, "
          "rotating input sets larger together than the L2 cache", file=out)
    for name, reason in skipped.items():
        print(f"skipping {name}: {reason}", file=out)
    if want_fla and fla_reason is not None:
        print(f"skipping fla: {fla_reason}", file=out)
    if check_against is not None:
        print(f"--check: err = ||x - {check_against[0]}|| / ||{check_against[0]}|| (float64) on input set 0",
              file=out)


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gdn_version() -> str:
    import gdn_dispatch
    return gdn_dispatch.__version__
