"""H200 check of the triton_generic backend: correctness, speed against fla, stage times.

Run from the repository root on the GPU, with fla-core 0.6.0 importable (about 4-6 minutes
with a cold Triton cache; most of it is fla's autotuning and first compiles)::

    PYTHONPATH=. python benchmarks/h200_triton_generic.py            # everything
    PYTHONPATH=. python benchmarks/h200_triton_generic.py --no-sweep # skip the config sweep

Without a CUDA device the same code runs a tiny smoke version on CPU tensors under
TRITON_INTERPRET=1 (no fla, host timers): it only proves the script's paths work.

Sections (each prints as it goes; an exception in one shape or case is printed and the run
goes on):

1. Per benchmark shape (bf16, K = V = 128, H/HV = 16/32 and 16/64; 1x8192, 1x32768, 4x8192,
   8x4096, 16 ragged sequences in [1, 8192]; initial and final state), with q/k l2-normalized
   by the caller ("l2=off") and then normalized in-kernel ("l2=on", as Qwen3.5 calls it):
   * ours against gdn_dispatch.reference on a slice (the first two sequences, each cut to
     2048 tokens, packed as one varlen call: o and final state);
   * ours against fla on the full shape (o and final state, rel. RMS);
   * times: ours through the public op (``backend="triton_generic"``), ours' kernels alone
     (``forward(problem)`` on a prebuilt problem: the op minus validation and chunk tables),
     and fla: median of >= 20 CUDA-event timed calls after warm-up, rotating over >= 3
     input sets (more when a set is small, so that together they exceed L2 2.5x);
   * stage times of ours (cumsum, fused kkt+solve+w/u, state, output), same protocol.
2. Config sweep (two shapes: 1x32768 and 8x4096 at HV=32): the state kernel over BV x
   num_stages, the output kernel over BK x BV x num_warps x num_stages, the w/u kernel over
   num_warps and fused vs. stored inverse. Prints the best of each; the table in
   backends/triton_generic/configs.py is what the library uses.
3. Index safety: 600k tokens (3 sequences: 300000, 290000, 10000), H=16, HV=32, K=V=128:
   T * HV * V = 2.46e9 > 2^31 elements; the last sequence (all past 2^31) and the first
   2048 tokens of the first are checked against the reference. And 4096 sequences of 16
   tokens (N * HV = 131072 programs > 65535): five sequences checked.
4. The compact table (shape, ours ms, fla ms, ratio, errors), printed last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # the smoke run: CPU tensors through triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["FLA_FLASH_QLA"] = "0"  # fla's plain Triton path is the baseline

import gdn_dispatch.backends.triton_generic as tg  # noqa: E402
from gdn_dispatch.backends.triton_generic._jit import LOG2E  # noqa: E402
from gdn_dispatch.backends.triton_generic.configs import LaunchConfig  # noqa: E402
from gdn_dispatch import chunk_gated_delta_rule  # noqa: E402
from gdn_dispatch.bench import (  # noqa: E402
    BenchShape, default_shapes, fla_caller, load_fla, make_input_sets, ours_caller, rotation_count,
)
from gdn_dispatch.contract import StateLayout, make_problem  # noqa: E402
from gdn_dispatch.testing import rel_rms_error  # noqa: E402

T_START = time.time()
BUDGET_S = 330  # skip what is left (and say so) past this point
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
TOL = 5e-3
WARMUP, ITERS = (3, 20) if HAS_CUDA else (1, 2)
MIN_SETS = 3
SLICE_SEQS, SLICE_LEN = 2, 2048


def say(*args):
    print(f"[{time.time() - T_START:6.1f}s]", *args, flush=True)


def over_budget(what: str) -> bool:
    if time.time() - T_START > BUDGET_S:
        say(f"SKIPPED (time budget): {what}")
        return True
    return False


# --------------------------------------------------------------------------- timing


def sync():
    if HAS_CUDA:
        torch.cuda.synchronize()


def median_ms(fn, n_sets: int, warmup: int = WARMUP, iters: int = ITERS) -> float:
    """Median time of ``fn(i)`` in ms over ``iters`` calls after ``warmup``, i rotating over sets."""
    for i in range(warmup):
        fn(i % n_sets)
    sync()
    if not HAS_CUDA:
        times = []
        for i in range(iters):
            t = time.perf_counter()
            fn(i % n_sets)
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for i, (start, end) in enumerate(events):
        start.record()
        fn(i % n_sets)
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


# --------------------------------------------------------------------------- inputs


def smoke_shapes() -> list[BenchShape]:
    return [BenchShape(name="H2-HV4-1x130", H=2, HV=4, B=1, T=130, K=32, V=32),
            BenchShape(name="H1-HV2-ragged3", H=1, HV=2, B=1, T=150, K=32, V=32, seqlens=(1, 0, 149))]


def shapes_for_run() -> list[BenchShape]:
    return default_shapes() if HAS_CUDA else smoke_shapes()


def n_sets_for(shape: BenchShape) -> int:
    set_bytes = shape.tokens * (2 * shape.H * shape.K + shape.HV * shape.V) * 2
    l2 = torch.cuda.get_device_properties(DEVICE).L2_cache_size if HAS_CUDA else 0
    return max(MIN_SETS, rotation_count(set_bytes, l2)) if HAS_CUDA else 1


def call_kwargs(x) -> dict:
    return dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, scale=x.scale, initial_state=x.h0,
                output_final_state=True, cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu,
                use_qk_l2norm_in_kernel=x.qk_l2norm)


def seq_bounds(x, shape: BenchShape) -> list[tuple[int, int]]:
    if x.cu_seqlens_cpu is None:
        return [(b * shape.T, (b + 1) * shape.T) for b in range(shape.B)]
    cu = x.cu_seqlens_cpu.tolist()
    return [(cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def slice_call(kw: dict, bounds: list[tuple[int, int]], seqs: list[int], max_len: int | None) -> dict:
    """The call made of sequences ``seqs`` (each cut to ``max_len`` tokens), packed varlen."""
    def rows(t):
        return t.reshape(-1, *t.shape[2:])

    parts, lengths = [], []
    for n in seqs:
        bos, eos = bounds[n]
        eos = eos if max_len is None else min(eos, bos + max_len)
        parts.append((bos, eos))
        lengths.append(eos - bos)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = dict(kw)
    for name in ("q", "k", "v", "g", "beta"):
        out[name] = torch.cat([rows(kw[name])[a:b] for a, b in parts]).unsqueeze(0).contiguous()
    if kw.get("initial_state") is not None:
        out["initial_state"] = kw["initial_state"][list(seqs)].contiguous()
    out["cu_seqlens"], out["cu_seqlens_cpu"] = cu.to(kw["q"].device), cu
    return out


def check_against_reference(kw: dict, bounds, seqs, max_len) -> tuple[float, float]:
    sub = slice_call(kw, bounds, seqs, max_len)
    o, ht = chunk_gated_delta_rule(**sub, backend="triton_generic")
    ro, rht = chunk_gated_delta_rule(**sub, backend="reference")
    return rel_rms_error(o, ro), rel_rms_error(ht, rht)


# --------------------------------------------------------------------------- stages


def stage_inputs(problem):
    """Inputs of every stage of ``problem`` (one forward pass, kept for stage timing)."""
    ch, l2 = problem.chunks, problem.use_qk_l2norm
    g_cum = tg.chunk_cumsum_fwd(problem.g, ch, scale=LOG2E)
    w, u = tg.wu_fwd(problem.k, problem.v, g_cum, problem.beta, ch, use_qk_l2norm=l2)
    h, v_new, _ = tg.state_fwd(problem.k, w, u, g_cum, ch, initial_state=problem.initial_state,
                               output_final_state=True, use_qk_l2norm=l2,
                               state_vk=problem.state_layout is StateLayout.VK)
    return dict(p=problem, g_cum=g_cum, w=w, u=u, h=h, v_new=v_new)


def stage_calls(cfg_state=None, cfg_out=None, cfg_wu=None, wu_unfused=False):
    def cumsum(s):
        tg.chunk_cumsum_fwd(s["p"].g, s["p"].chunks, scale=LOG2E)

    def wu(s):
        p = s["p"]
        a_inv = None
        if wu_unfused:
            a_inv = tg.kkt_solve_fwd(p.k, s["g_cum"], p.beta, p.chunks, use_qk_l2norm=p.use_qk_l2norm)
        tg.wu_fwd(p.k, p.v, s["g_cum"], p.beta, p.chunks, A_inv=a_inv, use_qk_l2norm=p.use_qk_l2norm,
                  config=cfg_wu)

    def state(s):
        p = s["p"]
        tg.state_fwd(p.k, s["w"], s["u"], s["g_cum"], p.chunks, initial_state=p.initial_state,
                     output_final_state=True, use_qk_l2norm=p.use_qk_l2norm, config=cfg_state)

    def output(s):
        p = s["p"]
        tg.output_fwd(p.q, p.k, s["v_new"], s["h"], s["g_cum"], p.chunks, scale=p.scale,
                      use_qk_l2norm=p.use_qk_l2norm, config=cfg_out)

    return dict(cumsum=cumsum, wu=wu, state=state, output=output)


# --------------------------------------------------------------------------- section 1


def bench_shape(shape: BenchShape, l2: bool, fla_fn, rows: list):
    n_sets = n_sets_for(shape)
    sets = make_input_sets(shape, n_sets, DEVICE, seed=1234, qk_l2norm=l2)
    kws = [call_kwargs(x) for x in sets]
    row = dict(shape=shape.name, l2=l2, ours=None, kern=None, fla=None, ref_o=None, ref_s=None,
               fla_o=None, fla_s=None, stages={}, note="")
    rows.append(row)
    bounds = seq_bounds(sets[0], shape)
    seqs = [n for n in range(len(bounds)) if bounds[n][1] > bounds[n][0]][:SLICE_SEQS]
    row["ref_o"], row["ref_s"] = check_against_reference(kws[0], bounds, seqs, SLICE_LEN)

    ours = ours_caller("triton_generic")
    o, ht = ours(sets[0])
    if fla_fn is not None:
        try:
            fo, fht = fla_caller(fla_fn)(sets[0])
            row["fla_o"], row["fla_s"] = rel_rms_error(o, fo), rel_rms_error(ht, fht)
        except Exception as exc:
            row["note"] += f"fla failed: {type(exc).__name__}: {exc}; "
    del o, ht

    row["ours"] = median_ms(lambda i: ours(sets[i]), n_sets)
    problems = [make_problem(**kw) for kw in kws]
    row["kern"] = median_ms(lambda i: tg.forward(problems[i]), n_sets)
    if fla_fn is not None and row["fla_o"] is not None:
        fla = fla_caller(fla_fn)
        row["fla"] = median_ms(lambda i: fla(sets[i]), n_sets)

    stages = [stage_inputs(p) for p in problems]
    for name, fn in stage_calls().items():
        row["stages"][name] = median_ms(lambda i: fn(stages[i]), n_sets)
    del stages, problems, sets, kws
    say(f"{shape.name:22s} l2={'on ' if l2 else 'off'} ours {row['ours']:.3f} ms (kernels {row['kern']:.3f}) "
        f"fla {fmt(row['fla'])} ms | ref err o {row['ref_o']:.2e} s {row['ref_s']:.2e} | "
        f"vs fla o {fmt(row['fla_o'], '.2e')} s {fmt(row['fla_s'], '.2e')} | stages "
        + " ".join(f"{k} {v:.3f}" for k, v in row["stages"].items()))


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


# --------------------------------------------------------------------------- section 2


def sweep(shape: BenchShape, kinds: set[str]):
    sets = make_input_sets(shape, n_sets_for(shape), DEVICE, seed=99, qk_l2norm=False)
    stages = [stage_inputs(make_problem(**call_kwargs(x))) for x in sets]
    n = len(stages)
    results = []
    for bv in (16, 32, 64):
        for st in (1, 2, 3):
            cfg = LaunchConfig(num_warps=4, num_stages=st, BV=bv)
            results.append(("state", f"BV={bv} stages={st}", stage_calls(cfg_state=cfg)["state"]))
    for bk, bv, w, st in ((64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 8, 2), (128, 128, 8, 2),
                          (128, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2)):
        cfg = LaunchConfig(num_warps=w, num_stages=st, BK=bk, BV=bv)
        results.append(("output", f"BK={bk} BV={bv} warps={w} stages={st}", stage_calls(cfg_out=cfg)["output"]))
    for w in (4, 8):
        for bk in (64, 128):
            cfg = LaunchConfig(num_warps=w, num_stages=2, BK=bk, BV=bk)
            results.append(("wu", f"fused BK=BV={bk} warps={w}", stage_calls(cfg_wu=cfg)["wu"]))
    results.append(("wu", "kkt_solve + wu (stored inverse)", stage_calls(wu_unfused=True)["wu"]))
    best = {}
    results = [r for r in results if r[0] in kinds]
    for kind, label, fn in results:
        try:
            ms = median_ms(lambda i: fn(stages[i]), n)
        except Exception as exc:
            say(f"  sweep {shape.name} {kind} {label}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        say(f"  sweep {shape.name} {kind:6s} {label:34s} {ms:.3f} ms")
        if kind not in best or ms < best[kind][1]:
            best[kind] = (label, ms)
    for kind, (label, ms) in best.items():
        say(f"  BEST  {shape.name} {kind:6s} {label} {ms:.3f} ms")


# --------------------------------------------------------------------------- section 3


def index_safety(fla_fn, rows: list):
    big = HAS_CUDA
    lengths = (300_000, 290_000, 10_000) if big else (100, 40, 70)
    H, HV, K, V = (16, 32, 128, 128) if big else (1, 2, 16, 16)
    shape = BenchShape(name=f"{sum(lengths) // 1000}k-tokens" if big else "idx-smoke", H=H, HV=HV, B=1,
                       T=sum(lengths), K=K, V=V, seqlens=lengths)
    x = make_input_sets(shape, 1, DEVICE, seed=7, qk_l2norm=True)[0]
    kw = call_kwargs(x)
    say(f"index safety: {shape.describe()}; T*HV*V = {shape.tokens * HV * V:.3e} (2^31 = {2**31:.3e})")
    o, ht = chunk_gated_delta_rule(**kw, backend="triton_generic")
    bounds = seq_bounds(x, shape)
    last = slice_call(kw, bounds, [2], None)
    ro, rht = chunk_gated_delta_rule(**last, backend="reference")
    b0, b1 = bounds[2]
    err_o = rel_rms_error(o[0, b0:b1], ro[0])
    err_s = rel_rms_error(ht[2], rht[0])
    first = slice_call(kw, bounds, [0], SLICE_LEN)
    ro0, _ = chunk_gated_delta_rule(**first, backend="reference")
    err_o0 = rel_rms_error(o[0, :ro0.shape[1]], ro0[0])
    nan = not bool(torch.isfinite(o).all())
    ms = median_ms(lambda i: chunk_gated_delta_rule(**kw, backend="triton_generic"), 1, warmup=1,
                   iters=3 if HAS_CUDA else 1)
    say(f"  last seq (tokens {b0}..{b1}): o err {err_o:.2e}, state err {err_s:.2e}; first {SLICE_LEN} tokens "
        f"o err {err_o0:.2e}; any non-finite: {nan}; {ms:.2f} ms")
    rows.append(dict(shape=shape.name, l2=True, ours=ms, kern=None, fla=None, ref_o=max(err_o, err_o0),
                     ref_s=err_s, fla_o=None, fla_s=None, stages={}, note="index>2^31"))
    del o, ht, x, kw
    release()

    n_seq = 4096 if big else 40
    shape = BenchShape(name=f"{n_seq}x16", H=H, HV=HV, B=1, T=16 * n_seq, K=K, V=V, seqlens=(16,) * n_seq)
    x = make_input_sets(shape, 1, DEVICE, seed=8, qk_l2norm=True)[0]
    kw = call_kwargs(x)
    o, ht = chunk_gated_delta_rule(**kw, backend="triton_generic")
    bounds = seq_bounds(x, shape)
    errs_o, errs_s = [], []
    for n in (0, 1, n_seq // 2, n_seq - 2, n_seq - 1):
        sub = slice_call(kw, bounds, [n], None)
        ro, rht = chunk_gated_delta_rule(**sub, backend="reference")
        errs_o.append(rel_rms_error(o[0, bounds[n][0]:bounds[n][1]], ro[0]))
        errs_s.append(rel_rms_error(ht[n], rht[0]))
    ms = median_ms(lambda i: chunk_gated_delta_rule(**kw, backend="triton_generic"), 1)
    fla_ms = None
    if fla_fn is not None:
        try:
            fla_ms = median_ms(lambda i: fla_caller(fla_fn)(x), 1)
        except Exception as exc:
            say(f"  fla failed on {shape.name}: {type(exc).__name__}: {str(exc)[:200]}")
    say(f"  {shape.name} (N*HV = {n_seq * HV}): o err max {max(errs_o):.2e}, state err max {max(errs_s):.2e}; "
        f"ours {ms:.3f} ms, fla {fmt(fla_ms)} ms")
    rows.append(dict(shape=shape.name, l2=True, ours=ms, kern=None, fla=fla_ms, ref_o=max(errs_o),
                     ref_s=max(errs_s), fla_o=None, fla_s=None, stages={}, note="N*HV>65535"))


# --------------------------------------------------------------------------- main


def table(rows: list) -> str:
    head = (f"{'shape':22s} {'l2':3s} {'ours ms':>8s} {'kern ms':>8s} {'fla ms':>8s} {'ours/fla':>8s} {'kern/fla':>8s} "
            f"{'ref o':>8s} {'ref S':>8s} {'fla o':>8s} {'fla S':>8s}  ok  stages ms (cumsum wu state output)")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = None if (r["ours"] is None or r["fla"] is None) else r["ours"] / r["fla"]
        kratio = None if (r["kern"] is None or r["fla"] is None) else r["kern"] / r["fla"]
        errs = [e for e in (r["ref_o"], r["ref_s"]) if e is not None]
        ok = "yes" if errs and max(errs) <= TOL else "NO"
        stages = " ".join(f"{v:.3f}" for v in r["stages"].values())
        lines.append(f"{r['shape']:22s} {'on' if r['l2'] else 'off':3s} {fmt(r['ours']):>8s} {fmt(r['kern']):>8s} "
                     f"{fmt(r['fla']):>8s} {fmt(ratio):>8s} {fmt(kratio):>8s} {fmt(r['ref_o'], '.1e'):>8s} "
                     f"{fmt(r['ref_s'], '.1e'):>8s} {fmt(r['fla_o'], '.1e'):>8s} {fmt(r['fla_s'], '.1e'):>8s}  "
                     f"{ok:3s} {stages} {r['note']}")
    return "\n".join(lines)


def release():
    if HAS_CUDA:
        torch.cuda.empty_cache()


def run_shapes(shapes: list[BenchShape], l2: bool, fla_fn, rows: list):
    for shape in shapes:
        if over_budget(f"{shape.name} l2={l2}"):
            continue
        try:
            bench_shape(shape, l2, fla_fn, rows)
        except Exception:
            say(f"{shape.name} l2={l2} FAILED:\n{traceback.format_exc(limit=6)}")
            rows.append(dict(shape=shape.name, l2=l2, ours=None, kern=None, fla=None, ref_o=None, ref_s=None,
                             fla_o=None, fla_s=None, stages={}, note="FAILED (see log)"))
        release()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sweep", action="store_true", help="skip section 2 (config sweep)")
    parser.add_argument("--no-index", action="store_true", help="skip section 3 (index safety)")
    parser.add_argument("--shapes", default=None, help="comma-separated substrings of shape names to run")
    parser.add_argument("--sweep-shapes", default="H16-HV32-1x32768,H16-HV32-8x4096",
                        help="comma-separated shape names for the config sweep")
    parser.add_argument("--sweep-kinds", default="state,output,wu", help="stages the sweep times")
    parser.add_argument("--no-l2", action="store_true", help="skip the l2=on pass over the shapes")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds after which remaining sections are skipped (default 330)")
    args = parser.parse_args(argv)
    if args.budget is not None:
        global BUDGET_S
        BUDGET_S = args.budget
    if HAS_CUDA:
        props = torch.cuda.get_device_properties(DEVICE)
        say(f"device {props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, "
            f"L2 {props.L2_cache_size / 2**20:.0f} MiB; torch {torch.__version__}")
    else:
        say("no CUDA device: smoke run on CPU tensors under TRITON_INTERPRET=1")
    fla_fn, fla_version, why = load_fla() if HAS_CUDA else (None, None, "no CUDA device")
    say(f"fla: {fla_version if fla_fn else why}")

    rows: list = []
    shapes = shapes_for_run()
    if args.shapes:
        keys = args.shapes.split(",")
        shapes = [s for s in shapes if any(k in s.name for k in keys)]
    # Priority order under the time budget: every shape with l2=off, the index-safety
    # cases, every shape with l2=on, then the config sweep.
    run_shapes(shapes, False, fla_fn, rows)
    if not args.no_index and not over_budget("index safety"):
        try:
            index_safety(fla_fn, rows)
        except Exception:
            say(f"index safety FAILED:\n{traceback.format_exc(limit=6)}")
        release()
    if not args.no_l2:
        run_shapes(shapes, True, fla_fn, rows)
    if not args.no_sweep:
        wanted = args.sweep_shapes.split(",")
        sweep_shapes = ([s for s in default_shapes() if s.name in wanted] if HAS_CUDA else smoke_shapes()[:1])
        for shape in sweep_shapes:
            if over_budget(f"sweep {shape.name}"):
                continue
            try:
                sweep(shape, set(args.sweep_kinds.split(",")))
            except Exception:
                say(f"sweep {shape.name} FAILED:\n{traceback.format_exc(limit=6)}")
            release()
    print()
    print(table(rows))
    print(f"\ntotal {time.time() - T_START:.0f} s; tolerance {TOL} (rel. RMS vs the float32 reference)")
    return 0 if all(r["ref_o"] is not None and max(r["ref_o"], r["ref_s"] or 0) <= TOL for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
