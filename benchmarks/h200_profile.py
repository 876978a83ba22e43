"""H200 profile: where the time of a chunk_gated_delta_rule call goes, per backend.

Run from the repository root on the GPU, with fla-core 0.6.0 importable from /tmp/site::

    PYTHONPATH=.:/tmp/site FLA_FLASH_QLA=0 python3 benchmarks/h200_profile.py [--shapes NAMES] [--budget SECONDS]

--shapes: names or globs of gdn_dispatch.bench's shape table (default H16-HV32-1x8192,
H16-HV32-1x32768,H16-HV64-8x4096; --list-shapes shows them, no GPU needed). --budget (default
150 s): part 1 starts nothing new past 60 % of it, part 2 past 80 %, part 3 past 100 %; what
is skipped is printed. Also --backends, --parts, --sweep-shape. Inputs as in ``python -m
gdn_dispatch bench`` (bf16 q/k/v, q/k pre-normalized, K = V = 128, fp32 g, bf16 beta, fp32
initial state, final state returned); ours via ``chunk_gated_delta_rule(..., backend=NAME)``.

One progress line per measurement as it goes; the tables print at the end:

1. Per shape and backend (triton_generic, gluon_sm90, fla): 3 warm-up calls, the CUDA-event
   median of 20 calls, then torch.profiler (CUDA activity) over 10 calls: per CUDA kernel
   (name cut to 40 chars) mean GPU us per call, share of the total, launches per call; the
   kernels' total per call. Event time well above the kernel total = idle GPU (host-bound).
2. Host overhead: (a) 50 back-to-back calls at the smallest shape, one synchronize at the end
   (enqueue = host time until the 50th call returned; wall = until the GPU finished), per
   call; (b) the same for a tiny call (B=1, T=64, H=16, HV=32): pure host + launch cost;
   (c) gluon_sm90 and triton_generic: cProfile of 50 tiny calls, top 25 by tottime.
3. triton_generic's fused w/u kernel (wu_fwd) alone at H16-HV32-1x32768, num_warps {4, 8} x
   num_stages {1, 2, 3}, BK/BV from intra_config (* = the library's default): median
   CUDA-event ms of 20 launches; a config that fails to compile prints its error.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
import traceback

T0 = time.time()  # the budget counts from here, imports of torch and triton included
os.environ.setdefault("FLA_FLASH_QLA", "0")  # fla's plain Triton path is the baseline

import torch  # noqa: E402

from gdn_dispatch.bench import (  # noqa: E402
    BenchShape, default_shapes, fla_caller, load_fla, make_input_sets, ours_caller, select_shapes,
)

DEFAULT_SHAPES = "H16-HV32-1x8192,H16-HV32-1x32768,H16-HV64-8x4096"
DEFAULT_BACKENDS = "triton_generic,gluon_sm90,fla"  # ours first: the budget is for them
OURS = ("triton_generic", "gluon_sm90")
TINY = BenchShape(name="tiny-H16-HV32-1x64", H=16, HV=32, B=1, T=64)
WARMUP, EVENT_ITERS, PROF_ITERS, HOST_ITERS, SWEEP_ITERS = 3, 20, 10, 50, 20
PART_END = {1: 0.6, 2: 0.8, 3: 1.0}  # fraction of --budget past which a part starts nothing new
NAME_W, PATH_W, TOP, SEED = 40, 44, 25, 1234
REPORT: list[str] = []  # the tables, printed at the end
SKIPPED: list[str] = []
BUDGET_S = 150.0


def say(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def brief(exc: BaseException) -> str:
    """Type, first line of the message and the innermost frame of ``exc``."""
    lines = str(exc).strip().splitlines()
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" [{os.path.basename(tb[-1].filename)}:{tb[-1].lineno}]" if tb else ""
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}{where}"


def over(part: int, what: str) -> bool:
    if time.time() - T0 > PART_END[part] * BUDGET_S:
        SKIPPED.append(f"part {part}: {what}")
        say(f"SKIPPED (budget {BUDGET_S:.0f} s; part {part} stops at {PART_END[part]:.0%}): {what}")
        return True
    return False


def event_times(fn, n_sets: int, warmup: int, iters: int) -> list[float]:
    """Per-call CUDA-event ms of ``fn(i)``, i rotating over the input sets."""
    for i in range(warmup):
        fn(i % n_sets)
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (a, b) in enumerate(ev):
        a.record()
        fn(i % n_sets)
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in ev]


def kernel_rows(prof, ncalls: int) -> list[tuple[str, float, float]]:
    """(kernel name, mean GPU us per call, launches per call) of the CUDA events, largest first."""
    from torch.autograd import DeviceType
    acc: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            slot = acc.setdefault(e.name, [0.0, 0])
            slot[0] += e.time_range.elapsed_us()
            slot[1] += 1
    return sorted(((n, us / ncalls, c / ncalls) for n, (us, c) in acc.items()), key=lambda r: -r[1])


def short(name: str) -> str:
    """At most NAME_W chars: the head and the tail, so that kernels differing at the end stay apart."""
    name = name.removeprefix("void ").replace("at::native::", "")
    name = name.split("<")[0] + "<..>" if "<" in name else name  # C++ templates: rows stay apart anyway
    return name if len(name) <= NAME_W else name[:NAME_W - 15] + "..." + name[-12:]


def profile_one(shape: BenchShape, name: str, call, sets, kern_us: dict, summary: list) -> None:
    from torch.profiler import ProfilerActivity, profile
    n = len(sets)
    ms = statistics.median(event_times(lambda i: call(sets[i]), n, WARMUP, EVENT_ITERS))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(PROF_ITERS):
            call(sets[i % n])
        torch.cuda.synchronize()
    rows = kernel_rows(prof, PROF_ITERS)
    total, launches = sum(r[1] for r in rows), sum(r[2] for r in rows)
    kern_us[(shape.name, name)] = total
    summary.append(f"  {shape.name:18s} {name:15s} {ms:9.3f} {total:11.1f} {launches:8.1f} {ms * 1e3 - total:9.1f}")
    say(f"part 1 {shape.name:17s} {name:15s} event {ms:.3f} ms/call; kernels {total:.1f} us/call, "
        f"{launches:.1f} launches")
    REPORT.append(f"\n{shape.name} / {name}: kernels {total:.1f} us/call in {launches:.1f} launches; event "
                  f"{ms * 1e3:.1f} us/call (GPU idle or overhead ~{ms * 1e3 - total:.1f} us)")
    REPORT.append(f"  {'us/call':>9} {'share':>6} {'n/call':>6}  kernel")
    for kname, us, cnt in rows:
        REPORT.append(f"  {us:9.1f} {us / total if total else 0:6.1%} {cnt:6.1f}  {short(kname)}")
    if not rows:
        REPORT.append("  (the profiler recorded no CUDA kernels)")


def part1(shapes, callers, dev, kern_us: dict) -> None:
    REPORT.append(f"\n=== part 1: CUDA kernels per call (torch.profiler over {PROF_ITERS} calls; "
                  f"event = median of {EVENT_ITERS} CUDA-event-timed calls; 2 input sets rotated)")
    summary = [f"\npart 1 summary:\n  {'shape':18s} {'backend':15s} {'event ms':>9} {'kernels us':>11} "
               f"{'launches':>8} {'idle us':>9}"]
    for shape in shapes:
        if over(1, f"kernel breakdown of {shape.name}"):
            continue
        try:
            sets = make_input_sets(shape, 2, dev, SEED)
        except Exception as exc:
            say(f"part 1 {shape.name}: inputs FAILED: {brief(exc)}")
            continue
        for name, call in callers.items():
            if over(1, f"kernel breakdown of {shape.name} / {name}"):
                continue
            try:
                profile_one(shape, name, call, sets, kern_us, summary)
            except Exception as exc:
                say(f"part 1 {shape.name} {name} FAILED: {brief(exc)}")
                REPORT.append(f"\n{shape.name} / {name}: FAILED: {brief(exc)}")
        del sets
        torch.cuda.empty_cache()
    REPORT.extend(summary)


def host_times(call, x) -> tuple[float, float]:
    """(enqueue ms, wall ms) per call of HOST_ITERS back-to-back calls, one synchronize at the end."""
    for _ in range(WARMUP):
        call(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(HOST_ITERS):
        call(x)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / HOST_ITERS * 1e3, (t2 - t0) / HOST_ITERS * 1e3


def cprofile_lines(call, x) -> list[str]:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(HOST_ITERS):
        call(x)
    torch.cuda.synchronize()
    pr.disable()
    st, n = pstats.Stats(pr), HOST_ITERS
    lines = [f"  total {st.total_tt / n * 1e6:.1f} us/call under cProfile ({n} calls)",
             f"  {'n/call':>7} {'tot us/call':>11} {'cum us/call':>11}  function"]
    for (path, line, func), (_cc, nc, tt, ct, _) in sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:TOP]:
        path = path if len(path) <= PATH_W else "..." + path[-(PATH_W - 3):]
        lines.append(f"  {nc / n:7.1f} {tt / n * 1e6:11.1f} {ct / n * 1e6:11.1f}  {path}:{line}({func[:60]})")
    return lines


def part2(shapes, callers, dev, kern_us: dict) -> None:
    small = min(shapes, key=lambda s: s.tokens * s.HV)
    x_small, x_tiny = make_input_sets(small, 1, dev, SEED)[0], make_input_sets(TINY, 1, dev, SEED)[0]
    table = [f"\n=== part 2: host overhead per call, {HOST_ITERS} back-to-back calls, one synchronize at the "
             "end (kernels: part 1's total, where measured)",
             f"  {'case':26s} {'backend':15s} {'enqueue ms':>10} {'wall ms':>8} {'kernels us':>10}"]
    profiles = []
    for name, call in callers.items():
        for label, shape, x in (("(a) " + small.name, small, x_small), ("(b) " + TINY.name, TINY, x_tiny)):
            if over(2, f"host overhead {label} / {name}"):
                continue
            try:
                enq, wall = host_times(call, x)
                kern = kern_us.get((shape.name, name))
                table.append(f"  {label:26s} {name:15s} {enq:10.3f} {wall:8.3f} "
                             f"{'-' if kern is None else format(kern, '.1f'):>10}")
                say(f"part 2 {label} {name:15s} enqueue {enq:.3f} ms/call, wall {wall:.3f} ms/call")
            except Exception as exc:
                table.append(f"  {label:26s} {name:15s} FAILED: {brief(exc)}")
                say(f"part 2 {label} {name} FAILED: {brief(exc)}")
        if name in OURS and not over(2, f"cProfile of {TINY.name} / {name}"):
            profiles.append(f"\n(c) cProfile of {name} on {TINY.name}, top {TOP} by tottime, per public call:")
            try:
                profiles.extend(cprofile_lines(call, x_tiny))
                say(f"part 2 (c) {name}: cProfile done")
            except Exception as exc:
                profiles.append(f"  FAILED: {brief(exc)}")
                say(f"part 2 (c) {name} FAILED: {brief(exc)}")
    REPORT.extend(table + profiles)


def part3(shape: BenchShape, dev) -> None:
    import gdn_dispatch.backends.triton_generic as tg
    from gdn_dispatch.backends.triton_generic._jit import LOG2E
    from gdn_dispatch.backends.triton_generic.configs import LaunchConfig, device_facts, fuse_solve_into_wu, intra_config
    from gdn_dispatch.contract import make_problem

    x = make_input_sets(shape, 1, dev, SEED)[0]
    p = make_problem(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0, output_final_state=True,
                     cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu, use_qk_l2norm_in_kernel=x.qk_l2norm)
    cap, l2 = device_facts(p.device)[0], p.use_qk_l2norm
    # The call sequence of backends/triton_generic/forward.py, up to and including wu_fwd.
    g_cum = tg.chunk_cumsum_fwd(p.g, p.chunks, scale=LOG2E)
    a_inv = None if fuse_solve_into_wu(cap) else tg.kkt_solve_fwd(p.k, g_cum, p.beta, p.chunks, use_qk_l2norm=l2)
    k_rnorm = torch.empty_like(g_cum) if l2 else None
    base = intra_config(p.K, p.V, p.k.element_size(), cap)
    REPORT.append(f"\n=== part 3: triton_generic wu_fwd alone at {shape.name} ({'fused' if a_inv is None else 'stored'}"
                  f" inverse, capability {cap}), median of {SWEEP_ITERS} CUDA-event-timed launches; "
                  f"* = default {base}")
    done = []
    for warps in (4, 8):
        for stages in (1, 2, 3):
            label = f"BK={base.BK} BV={base.BV} warps={warps} stages={stages}"
            label += " *" if (warps, stages) == (base.num_warps, base.num_stages) else ""
            if over(3, f"wu_fwd {label}"):
                continue
            cfg = LaunchConfig(num_warps=warps, num_stages=stages, BK=base.BK, BV=base.BV)

            def fn(_i, cfg=cfg):
                tg.wu_fwd(p.k, p.v, g_cum, p.beta, p.chunks, A_inv=a_inv, use_qk_l2norm=l2, k_rnorm=k_rnorm,
                          config=cfg)
            try:
                ms = statistics.median(event_times(fn, 1, 2, SWEEP_ITERS))
                done.append((ms, label))
                REPORT.append(f"  {label:40s} {ms:8.4f} ms")
                say(f"part 3 wu_fwd {label:38s} {ms:.4f} ms")
            except Exception as exc:
                REPORT.append(f"  {label:40s} FAILED: {brief(exc)}")
                say(f"part 3 wu_fwd {label} FAILED: {brief(exc)}")
    if done:
        REPORT.append(f"  best: {min(done)[1]} at {min(done)[0]:.4f} ms")


def main(argv=None) -> int:
    global BUDGET_S
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"names or globs (default {DEFAULT_SHAPES})")
    ap.add_argument("--backends", default=DEFAULT_BACKENDS, help=f"comma-separated (default {DEFAULT_BACKENDS})")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds (default 150)")
    ap.add_argument("--parts", default="1,2,3", help="which parts to run (default 1,2,3)")
    ap.add_argument("--sweep-shape", default="H16-HV32-1x32768", help="part 3's shape")
    ap.add_argument("--list-shapes", action="store_true", help="print the selected shapes and exit")
    args = ap.parse_args(argv)
    BUDGET_S = args.budget
    try:
        shapes = select_shapes(default_shapes(), args.shapes)
        sweep_shape = select_shapes(default_shapes(), args.sweep_shape)[0]
        parts = {int(s) for s in args.parts.split(",") if s.strip()}
    except ValueError as exc:
        print(f"h200_profile: {exc}", file=sys.stderr)
        return 2
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    if args.list_shapes:
        for s in shapes + [TINY]:
            print(f"{s.name:22s} {s.describe()}")
        print(f"backends {names}; parts {sorted(parts)}; part 3 at {sweep_shape.name}; budget {BUDGET_S:.0f} s")
        return 0
    if not torch.cuda.is_available():
        print("h200_profile: needs a CUDA device", file=sys.stderr)
        return 2

    import triton
    dev = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev)
    say(f"{props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
        f"triton {triton.__version__}; FLA_FLASH_QLA={os.environ.get('FLA_FLASH_QLA')}; budget {BUDGET_S:.0f} s")
    callers = {}
    for name in names:
        if name != "fla":
            callers[name] = ours_caller(name)
            continue
        fla_fn, version, why = load_fla()
        say(f"fla {version}" if fla_fn is not None else f"fla unavailable: {why}")
        if fla_fn is not None:
            callers[name] = fla_caller(fla_fn)
    kern_us: dict = {}
    with torch.inference_mode():
        for part, run in ((1, lambda: part1(shapes, callers, dev, kern_us)),
                          (2, lambda: part2(shapes, callers, dev, kern_us)),
                          (3, lambda: part3(sweep_shape, dev))):
            if part not in parts or over(part, f"all of part {part}"):
                continue
            try:
                run()
            except Exception as exc:
                say(f"part {part} FAILED: {brief(exc)}\n{traceback.format_exc(limit=6)}")
                REPORT.append(f"\n=== part {part} FAILED: {brief(exc)}")
            torch.cuda.empty_cache()
    print("\n".join(REPORT))
    if SKIPPED:
        print("\nskipped for the time budget: " + "; ".join(SKIPPED))
    print(f"\ntotal {time.time() - T0:.0f} s (budget {BUDGET_S:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
