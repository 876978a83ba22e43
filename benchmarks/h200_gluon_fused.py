"""H200 check of the fused Gluon stages against the split ones they replace.

Run from the repository root on an sm_90 GPU (fla importable for part 3)::

    PYTHONPATH=.:/tmp/site FLA_FLASH_QLA=0 python benchmarks/h200_gluon_fused.py [--budget S]

* ``wy``: the gate cumsum, kkt, solve and w/u in one Gluon kernel
  (:mod:`gdn_dispatch.backends.gluon_common.wy`), replacing triton_generic's cumsum and stored-inverse
  ``kkt_solve_fwd`` + the Gluon ``wu_fwd``.
* ``state_output``: the recurrence and the output in one Gluon kernel
  (:mod:`gdn_dispatch.backends.gluon_common.state_output`), replacing ``state_fwd`` + ``output_fwd``.

Part 1, correctness (one line per case; tolerance 5e-3 relative RMS; ``wy_g`` is wy's gate
cumsum against triton_generic's): each fused stage against
a float32 torch computation from the inputs it receives (the same references as
``h200_gluon_sm90.py``), then the fused pipeline (wy, state_output) against
``gdn_dispatch.reference``; outputs NaN-poisoned first. Cases: the pairwise covering set of
``h200_gluon_sm90.py`` on lengths 1/63/64/65/130/0, one tail-free case, one long "vk" case.

Part 2, per-stage times (median CUDA-event ms, host work included) at the bench shapes.
Part 3, whole calls side by side: fla, triton_generic, gluon_sm90 (as registered) and the
fused pipeline, median over rotating input sets (gdn_dispatch.bench's timer).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from h200_gluon_sm90 import pairwise_cases, poison_allocator, ref_output, ref_state, ref_wu  # noqa: E402

LOG2E = math.log2(math.e)
TOL = 5e-3
T0 = time.time()


def say(*args):
    print(*args, flush=True)


def fused_forward(problem, info, block_v=None):
    """wy (with the gate cumsum) -> state_output, for ``problem``; (o, final_state)."""
    from gdn_dispatch.backends.gluon_common.state_output import plan_state_output, state_output_fwd
    from gdn_dispatch.backends.gluon_common.wy import plan_wy, wy_fwd

    chunks = problem.chunks
    w, u, g_cum = wy_fwd(problem.k, problem.v, problem.g, problem.beta, chunks, plan_wy(problem, info))
    return state_output_fwd(problem.q, problem.k, w, u, g_cum, chunks,
                            plan_state_output(problem, info, block_v=block_v), scale=problem.scale,
                            initial_state=problem.initial_state,
                            output_final_state=problem.output_final_state)


def case_call(c, lengths, device, seed):
    from gdn_dispatch.testing import random_call

    K, V = c["KV"]
    H, HV = (4, 4) if c["ratio"] == 1 else (2, 4) if c["ratio"] == 2 else (1, 4)
    call = random_call(lengths=lengths, H=H, HV=HV, K=K, V=V, dtype=c["dtype"], device=device, seed=seed,
                       initial_state=c["h0"], state_layout=c["layout"], normalize_qk=not c["l2"])
    name = (f"K{K}-V{V}-H{H}-HV{HV}-{'bf16' if c['dtype'] == torch.bfloat16 else 'fp16'}-{c['layout']}"
            f"{'-h0' if c['h0'] else ''}{'-l2' if c['l2'] else ''}-L{'/'.join(map(str, lengths))}")
    return call, name


def check_case(c, lengths, device, info, seed):
    """Errors of each fused stage and of the fused pipeline for one case (dict name -> err)."""
    from gdn_dispatch import reference
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.testing import rel_rms_error

    from gdn_dispatch.backends.gluon_common.state_output import plan_state_output, state_output_fwd
    from gdn_dispatch.backends.gluon_common.wy import plan_wy, wy_fwd
    from gdn_dispatch.backends.triton_generic import chunk_cumsum_fwd, kkt_solve_fwd

    call, name = case_call(c, lengths, device, seed)
    say(f"RUN  {name}")
    p = make_problem(**call, output_final_state=True, use_qk_l2norm_in_kernel=c["l2"])
    chunks, dt, errs = p.chunks, p.dtype, {}
    g_cum = chunk_cumsum_fwd(p.g, chunks, scale=LOG2E)
    A32 = kkt_solve_fwd(p.k, g_cum, p.beta, chunks, use_qk_l2norm=c["l2"], out_dtype=torch.float32)
    w_ref, u_ref = ref_wu(p, A32, g_cum)
    poison_allocator(device)
    w, u, g_cum_wy = wy_fwd(p.k, p.v, p.g, p.beta, chunks, plan_wy(p, info))
    torch.cuda.synchronize()
    errs["wy_g"] = rel_rms_error(g_cum_wy, g_cum)
    errs["wy_w"] = rel_rms_error(w.reshape(w_ref.shape), w_ref)
    errs["wy_u"] = rel_rms_error(u.reshape(u_ref.shape), u_ref)

    # state_output from the reference w/u rounded as the pipeline stores them.
    w_in, u_in = w_ref.to(dt).reshape(w.shape), u_ref.to(dt).reshape(u.shape)
    h_ref, vn_ref, ht_ref = ref_state(p, w_in, u_in, g_cum)
    o_ref = ref_output(p, vn_ref.to(dt).float(), h_ref.to(dt).float(), g_cum)
    for bv in (32, 64):
        if bv > p.V:
            continue
        poison_allocator(device)
        o, ht = state_output_fwd(p.q, p.k, w_in, u_in, g_cum, chunks, plan_state_output(p, info, block_v=bv),
                                 scale=p.scale, initial_state=p.initial_state, output_final_state=True)
        torch.cuda.synchronize()
        errs[f"so{bv}_o"] = rel_rms_error(o.reshape(o_ref.shape), o_ref)
        errs[f"so{bv}_ht"] = rel_rms_error(ht, ht_ref)

    poison_allocator(device)
    o, ht = fused_forward(p, info)
    torch.cuda.synchronize()
    o_ref, ht_ref = reference.forward(p)
    errs["fwd_o"], errs["fwd_ht"] = rel_rms_error(o, o_ref), rel_rms_error(ht, ht_ref)
    ok = all(e <= TOL for e in errs.values())
    say(f"{'PASS' if ok else 'FAIL'} {name}  " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()))
    return ok


def correctness(device, info, budget_s):
    say("== part 1: correctness (5e-3 rel. RMS)")
    base = {"KV": (128, 128), "ratio": 2, "dtype": torch.bfloat16, "layout": "kv", "h0": True, "l2": True}
    lengths = [1, 63, 64, 65, 130, 0]
    cases = [(base, [64, 128])] + [(c, lengths) for c in pairwise_cases()]
    cases.append(({**base, "layout": "vk"}, [1000, 37, 0, 513]))
    passed = failed = 0
    for i, (c, lens) in enumerate(cases):
        if time.time() - T0 > budget_s:
            say(f"SKIP the remaining {len(cases) - i} cases (time budget)")
            break
        try:
            ok = check_case(c, lens, device, info, seed=i)
        except Exception as exc:
            traceback.print_exc()
            say(f"FAIL case {i}: {type(exc).__name__}: {exc}")
            ok = False
            if "illegal" in str(exc).lower() or "device-side" in str(exc).lower():
                say("device fault: the CUDA context is lost, stopping")
                return passed, failed + 1, True
        passed, failed = passed + ok, failed + (not ok)
    say(f"correctness: {passed} passed, {failed} failed")
    return passed, failed, False


def median_ms(fn):
    from gdn_dispatch.bench import median_event_ms

    return median_event_ms(fn, iters=20, warmup=3)


def stage_times(shape, device, info, l2):
    """Per-stage medians (ms) of the split and fused stages for one bench shape."""
    from gdn_dispatch.bench import make_input_sets
    from gdn_dispatch.contract import make_problem

    from gdn_dispatch.backends.gluon_common.output import output_fwd, plan_output
    from gdn_dispatch.backends.gluon_common.plan import plan_state
    from gdn_dispatch.backends.gluon_common.state import state_fwd
    from gdn_dispatch.backends.gluon_common.state_output import plan_state_output, state_output_fwd
    from gdn_dispatch.backends.gluon_common.wu import plan_wu, wu_fwd
    from gdn_dispatch.backends.gluon_common.wy import plan_wy, wy_fwd
    from gdn_dispatch.backends.triton_generic import chunk_cumsum_fwd, kkt_solve_fwd
    from gdn_dispatch.backends.triton_generic.wu import wu_fwd as tg_wu_fwd

    x = make_input_sets(shape, 1, device, seed=7, qk_l2norm=l2)[0]
    p = make_problem(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0, output_final_state=True,
                     cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu, use_qk_l2norm_in_kernel=l2)
    ch = p.chunks
    g_cum = chunk_cumsum_fwd(p.g, ch, scale=LOG2E)
    A = kkt_solve_fwd(p.k, g_cum, p.beta, ch, use_qk_l2norm=l2)
    w, u, _ = wy_fwd(p.k, p.v, p.g, p.beta, ch, plan_wy(p, info))
    ps = plan_state(p, info)
    h, v_new, _ = state_fwd(p.k, w, u, g_cum, ch, ps, initial_state=p.initial_state, output_final_state=True)
    t = {}
    t["cumsum"] = median_ms(lambda: chunk_cumsum_fwd(p.g, ch, scale=LOG2E))
    t["tg_wu"] = median_ms(lambda: tg_wu_fwd(p.k, p.v, g_cum, p.beta, ch, use_qk_l2norm=l2))
    t["kkt+wu"] = median_ms(lambda: wu_fwd(p.k, p.v, g_cum, p.beta, kkt_solve_fwd(p.k, g_cum, p.beta, ch, use_qk_l2norm=l2),
                                           ch, plan_wu(p, info)))
    t["wy"] = median_ms(lambda: wy_fwd(p.k, p.v, p.g, p.beta, ch, plan_wy(p, info)))
    t[f"state(BV{ps.blocks['BV']})"] = median_ms(
        lambda: state_fwd(p.k, w, u, g_cum, ch, ps, initial_state=p.initial_state, output_final_state=True))
    t["output"] = median_ms(lambda: output_fwd(p.q, p.k, v_new, h, g_cum, ch, plan_output(p, info), scale=p.scale))
    for bv in (32, 64):
        plan = plan_state_output(p, info, block_v=bv)
        t[f"so(BV{bv})"] = median_ms(lambda: state_output_fwd(p.q, p.k, w, u, g_cum, ch, plan, scale=p.scale,
                                                              initial_state=p.initial_state, output_final_state=True))
    return t


def whole_calls(shape, device, info, l2, fla_fn):
    """Median ms of whole calls: fla, triton_generic, gluon_sm90 and the fused pipeline."""
    from gdn_dispatch.bench import cuda_event_timer, fla_caller, make_input_sets, ours_caller
    from gdn_dispatch.contract import make_problem

    sets = make_input_sets(shape, 2, device, seed=11, qk_l2norm=l2)

    def fused(x):
        p = make_problem(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0, output_final_state=True,
                         cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu, use_qk_l2norm_in_kernel=l2)
        return fused_forward(p, info)

    callers = {"triton_generic": ours_caller("triton_generic"), "gluon_sm90": ours_caller("gluon_sm90"),
               "fused": fused}
    if fla_fn is not None:
        callers["fla"] = fla_caller(fla_fn)
    out = {}
    for name, call in callers.items():
        try:
            out[name] = statistics.median(cuda_event_timer(call, sets, 3, 20))
        except Exception as exc:
            say(f"  {name} failed: {type(exc).__name__}: {exc}")
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", type=float, default=330.0)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--shapes", default="", help="substrings of bench shape names to keep")
    args = parser.parse_args()
    from gdn_dispatch.bench import default_shapes, load_fla
    from gdn_dispatch.device import default_probe

    device = torch.device("cuda")
    info = default_probe().for_torch_device(device)
    say(torch.cuda.get_device_name(), torch.__version__)
    if not args.skip_check:
        _, _, fault = correctness(device, info, 0.45 * args.budget)
        if fault:
            return
    fla_fn, _, why = load_fla()
    if why:
        say("fla:", why)
    shapes = [s for s in default_shapes() if not args.shapes or any(x in s.name for x in args.shapes.split(","))]
    say("== part 2/3: stage and whole-call times (ms), l2 norm off")
    rows = []
    for shape in shapes:
        if time.time() - T0 > args.budget:
            say(f"SKIP {shape.name} and later (time budget)")
            break
        try:
            t = stage_times(shape, device, info, False)
            t.update(whole_calls(shape, device, info, False, fla_fn))
            rows.append((shape.name, t))
            say(shape.name, " ".join(f"{k}={v:.3f}" for k, v in t.items()))
        except Exception as exc:
            traceback.print_exc()
            say(f"{shape.name} failed: {type(exc).__name__}: {exc}")
    if rows:
        keys = list(rows[0][1])
        say("\nshape | " + " | ".join(keys) + " | fused/fla")
        for name, t in rows:
            ratio = t["fused"] / t["fla"] if "fused" in t and "fla" in t else float("nan")
            say(f"{name} | " + " | ".join(f"{t.get(k, float('nan')):.3f}" for k in keys) + f" | {ratio:.3f}")


if __name__ == "__main__":
    main()
