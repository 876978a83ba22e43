"""H200 check of the gluon_sm90 backend: correctness first, stage by stage, then timing.

Run from the repository root on an sm_90 GPU (about 3-4 minutes, cold Triton cache)::

    PYTHONPATH=.:/tmp/site python benchmarks/h200_gluon_sm90.py

Part 1, correctness (every case prints one line; a failing case never hides the others):

* the WHOLE backend (``backend="gluon_sm90"`` through the public op) against
  ``gdn_dispatch.reference`` (float32 torch) on one varlen batch with lengths
  1, 63, 64, 65, 130 and a zero-length sequence, over HV/H in {1, 2, 4}, both state layouts,
  with/without initial state, l2 norm on/off, bf16/fp16, K, V in {64, 128} (a pairwise
  covering set of cases), plus one case with long sequences (many chunks: ring slots and
  barrier phases wrap many times). Outputs are NaN-poisoned (the caching allocator is
  filled with NaN first), so an unwritten element reads as an infinite error.
* each Gluon stage IN ISOLATION against a float32 torch computation from the same inputs
  that stage received: ``wu`` (w, u from triton_generic's A_inv), ``state`` (h, v_new and
  the final state from w, u, k, g_cum: the torch walk rounds h and the scaled v_new to the
  input dtype where the kernel does), ``output`` (o from q, k, v_new, h, g_cum). So a failure
  names its stage.

Part 2, timing (bf16, K = V = 128, H/HV = 16/32 and 16/64; 1x8192, 1x32768, 4x8192, 8x4096
and 16 ragged sequences in [1, 8192]): gluon_sm90 vs triton_generic vs fla (when importable),
median CUDA-event times over rotating input sets, gluon_sm90's error against triton_generic
on each shape, and a per-stage breakdown of both backends. The compact table prints last.
"""

from __future__ import annotations

import faulthandler
import math
import os
import statistics
import sys
import time
import traceback

import torch

T_START = time.time()
#: Seconds after which remaining work is skipped (and said so), to stay under 5 minutes.
TOTAL_BUDGET_S = float(os.environ.get("GDN_H200_BUDGET_S", 270))
CORRECTNESS_BUDGET_S = 0.55 * TOTAL_BUDGET_S
WATCHDOG_S = TOTAL_BUDGET_S + 20
TOL = {torch.bfloat16: 5e-3, torch.float16: 5e-3}
LOG2E = math.log2(math.e)


def elapsed() -> float:
    return time.time() - T_START


def say(*args):
    print(*args, flush=True)


# ----------------------------------------------------------------------------- helpers


def poison_allocator(device, big_bytes: int = 1 << 28):
    """Fill the caching allocator's free blocks with NaN (small and large pools), so tensors
    that torch.empty hands out next start as NaN: unwritten outputs then show up."""
    small = [torch.full((1 << 17,), float("nan"), device=device) for _ in range(64)]  # 512 KB each
    big = torch.full((big_bytes // 4,), float("nan"), device=device)
    del small, big


def chunk_rows(problem):
    """[NT, 64] int64 packed row of each chunk position (clamped) and its validity mask."""
    cu = problem.chunks.cu_seqlens_host.tolist()
    rows, valid = [], []
    for n in range(len(cu) - 1):
        bos, eos = int(cu[n]), int(cu[n + 1])
        for c0 in range(bos, eos, 64):
            r = torch.arange(c0, c0 + 64)
            rows.append(r.clamp(max=max(eos - 1, 0)))
            valid.append(r < eos)
    if not rows:
        return None, None
    dev = problem.device
    return torch.stack(rows).to(dev), torch.stack(valid).to(dev)


def gather(x, rows, valid):
    """x [B*T, ...] -> [NT, 64, ...] with rows past a sequence's end zeroed."""
    y = x[rows]
    return torch.where(valid.view(*valid.shape, *([1] * (y.dim() - 2))), y, torch.zeros((), dtype=y.dtype, device=y.device))


def scatter_back(full_shape, xc, rows, valid, device):
    out = torch.zeros(full_shape, dtype=torch.float32, device=device)
    out[rows[valid]] = xc[valid]
    return out


def l2n(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def heads_expand(x, group):
    return x.repeat_interleave(group, dim=-2)


# ----------------------------------------------------------------------------- stage references


def ref_wu(problem, A_inv, g_cum):
    """w = A (beta 2^g k_n), u = A (beta v) per chunk, float32; [B*T, HV, K] / [B*T, HV, V]."""
    rows, valid = chunk_rows(problem)
    BT, HV, K, V = problem.B * problem.T, problem.HV, problem.K, problem.V
    k = problem.k.reshape(BT, problem.H, K).float()
    if problem.use_qk_l2norm:
        k = l2n(k)
    k = heads_expand(k, HV // problem.H)
    beta = problem.beta.reshape(BT, HV).float()
    g = g_cum.reshape(BT, HV)
    a = gather(A_inv.reshape(BT, HV, 64).float(), rows, valid).permute(0, 2, 1, 3)      # [NT, HV, 64, 64]
    kb = gather(k * (beta * torch.exp2(g))[..., None], rows, valid).permute(0, 2, 1, 3)  # [NT, HV, 64, K]
    vb = gather(problem.v.reshape(BT, HV, V).float() * beta[..., None], rows, valid).permute(0, 2, 1, 3)
    w = (a @ kb).permute(0, 2, 1, 3)
    u = (a @ vb).permute(0, 2, 1, 3)
    dev = problem.device
    return scatter_back((BT, HV, K), w, rows, valid, dev), scatter_back((BT, HV, V), u, rows, valid, dev)


def ref_state(problem, w, u, g_cum):
    """The recurrence in float32 from the kernel's own inputs, rounding h and the scaled
    v_new to the input dtype where the kernel does. Returns h [NT, HV, K, V], v_new
    [B*T, HV, V], final state in the problem's layout."""
    BT, H, HV, K, V = problem.B * problem.T, problem.H, problem.HV, problem.K, problem.V
    dt, vk = problem.dtype, problem.state_layout.value == "vk"
    k = heads_expand(problem.k.reshape(BT, H, K).float(), HV // H)
    w, u, g = w.reshape(BT, HV, K).float(), u.reshape(BT, HV, V).float(), g_cum.reshape(BT, HV)
    cu = problem.chunks.cu_seqlens_host.tolist()
    h = torch.zeros(problem.chunks.num_chunks, HV, K, V, device=problem.device)
    v_new = torch.zeros(BT, HV, V, device=problem.device)
    finals, c_id = [], 0
    for n in range(len(cu) - 1):
        if problem.initial_state is None:
            S = torch.zeros(HV, K, V, device=problem.device)
        else:
            S = problem.initial_state[n].float()
            S = S.transpose(-1, -2).clone() if vk else S.clone()
        bos, eos = int(cu[n]), int(cu[n + 1])
        for c0 in range(bos, eos, 64):
            r = slice(c0, min(c0 + 64, eos))
            h[c_id] = S
            c_id += 1
            hb = S.to(dt).float()
            wc, uc, kc = w[r].transpose(0, 1), u[r].transpose(0, 1), k[r].transpose(0, 1)  # [HV, L, *]
            vn = uc - wc @ hb
            v_new[r] = vn.transpose(0, 1)
            gc = g[r].transpose(0, 1)  # [HV, L]
            g_last = gc[:, -1:]
            d = torch.exp2(g_last - gc)
            if problem.use_qk_l2norm:
                d = d * torch.rsqrt((kc * kc).sum(-1) + 1e-6)
            vs = (vn * d[..., None]).to(dt).float()
            S = S * torch.exp2(g_last)[..., None] + kc.transpose(-1, -2) @ vs
        finals.append(S.transpose(-1, -2) if vk else S)
    final = torch.stack(finals) if finals else None
    return h, v_new, final


def ref_output(problem, v_new, h, g_cum):
    """o = scale (2^g (q h) + causal(q k^T 2^(g_i - g_j)) v_new) per chunk, float32 [B*T, HV, V]."""
    rows, valid = chunk_rows(problem)
    BT, H, HV, K, V = problem.B * problem.T, problem.H, problem.HV, problem.K, problem.V
    q = problem.q.reshape(BT, H, K).float()
    k = problem.k.reshape(BT, H, K).float()
    if problem.use_qk_l2norm:
        q, k = l2n(q), l2n(k)
    q, k = heads_expand(q, HV // H), heads_expand(k, HV // H)
    qc = gather(q, rows, valid).permute(0, 2, 1, 3)                       # [NT, HV, 64, K]
    kc = gather(k, rows, valid).permute(0, 2, 1, 3)
    vc = gather(v_new.reshape(BT, HV, V).float(), rows, valid).permute(0, 2, 1, 3)
    gc = gather(g_cum.reshape(BT, HV), rows, valid).permute(0, 2, 1)      # [NT, HV, 64]
    hc = h.float()                                                        # [NT, HV, K, V]
    causal = torch.ones(64, 64, dtype=torch.bool, device=problem.device).tril()
    m = causal & valid[:, None, :, None] & valid[:, None, None, :]
    zero = torch.zeros((), device=problem.device)
    # where() before exp2: above the diagonal g_i - g_j may be large and positive.
    decay = torch.exp2(torch.where(m, gc[..., :, None] - gc[..., None, :], zero))
    att = torch.where(m, (qc @ kc.transpose(-1, -2)) * decay, zero)
    o = problem.scale * ((qc @ hc) * torch.exp2(gc)[..., None] + att @ vc)
    return scatter_back((BT, HV, V), o.permute(0, 2, 1, 3), rows, valid, problem.device)


# ----------------------------------------------------------------------------- part 1


def pairwise_cases():
    """A small set of cases covering every pair of values of any two factors."""
    import itertools

    factors = {
        "KV": [(128, 128), (64, 64), (64, 128), (128, 64)],
        "ratio": [1, 2, 4],
        "dtype": [torch.bfloat16, torch.float16],
        "layout": ["kv", "vk"],
        "h0": [True, False],
        "l2": [True, False],
    }
    names = list(factors)
    uncovered = {(a, i, b, j) for a, b in itertools.combinations(range(len(names)), 2)
                 for i in range(len(factors[names[a]])) for j in range(len(factors[names[b]]))}
    cases = []
    all_rows = list(itertools.product(*[range(len(factors[n])) for n in names]))
    while uncovered:
        best = max(all_rows, key=lambda row: sum((a, row[a], b, row[b]) in uncovered
                                                 for a, b in itertools.combinations(range(len(names)), 2)))
        for a, b in itertools.combinations(range(len(names)), 2):
            uncovered.discard((a, best[a], b, best[b]))
        cases.append({n: factors[n][i] for n, i in zip(names, best)})
    return cases


def case_id(c, lengths):
    K, V = c["KV"]
    H, HV = (4, 4) if c["ratio"] == 1 else (2, 4) if c["ratio"] == 2 else (1, 4)
    dt = "bf16" if c["dtype"] == torch.bfloat16 else "fp16"
    return (f"K{K}-V{V}-H{H}-HV{HV}-{dt}-{c['layout']}{'-h0' if c['h0'] else ''}{'-l2' if c['l2'] else ''}"
            f"-L{'/'.join(map(str, lengths))}")


def run_case(c, lengths, device, info, results):
    from gdn_dispatch import reference
    from gdn_dispatch.api import chunk_gated_delta_rule
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.testing import random_call, rel_rms_error

    from gdn_dispatch.backends.gluon_common.output import output_fwd, plan_output
    from gdn_dispatch.backends.gluon_common.plan import plan_state
    from gdn_dispatch.backends.gluon_common.state import state_fwd
    from gdn_dispatch.backends.gluon_common.wu import plan_wu, wu_fwd
    from gdn_dispatch.backends.triton_generic import chunk_cumsum_fwd, kkt_solve_fwd

    K, V = c["KV"]
    H, HV = (4, 4) if c["ratio"] == 1 else (2, 4) if c["ratio"] == 2 else (1, 4)
    cid = case_id(c, lengths)
    call = random_call(lengths=lengths, H=H, HV=HV, K=K, V=V, dtype=c["dtype"], device=device, seed=len(results),
                       initial_state=c["h0"], state_layout=c["layout"], normalize_qk=not c["l2"])
    tol = TOL[c["dtype"]]
    row = {"case": cid}
    say(f"RUN  {cid}")  # a hang (the watchdog exits) or a device fault is then attributable
    # Each stage alone, from the inputs it receives in the pipeline. Stages run first (a
    # device fault poisons the context for everything after it, so it must name its stage)
    # and each in its own try: a stage that raises hands the next one the torch result.
    p = make_problem(**call, output_final_state=True, use_qk_l2norm_in_kernel=c["l2"])
    chunks, dt = p.chunks, p.dtype
    g_cum = chunk_cumsum_fwd(p.g, chunks, scale=LOG2E)
    A_inv = kkt_solve_fwd(p.k, g_cum, p.beta, chunks, use_qk_l2norm=c["l2"])
    w_ref, u_ref = ref_wu(p, A_inv, g_cum)
    w, u = w_ref.to(dt).reshape(p.B, p.T, HV, K), u_ref.to(dt).reshape(p.B, p.T, HV, V)
    try:
        poison_allocator(device)
        w, u = wu_fwd(p.k, p.v, g_cum, p.beta, A_inv, chunks, plan_wu(p, info))
        torch.cuda.synchronize()
        row["wu_w"], row["wu_u"] = rel_rms_error(w.reshape(w_ref.shape), w_ref), rel_rms_error(u.reshape(u_ref.shape), u_ref)
    except Exception as exc:
        row["stage_error"] = f"wu: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    h_ref, vn_ref, ht_ref = ref_state(p, w, u, g_cum)
    h, v_new = h_ref.to(dt), vn_ref.to(dt).reshape(u.shape)
    try:
        poison_allocator(device)
        h, v_new, ht = state_fwd(p.k, w, u, g_cum, chunks, plan_state(p, info),
                                 initial_state=p.initial_state, output_final_state=True)
        torch.cuda.synchronize()
        row["state_h"] = rel_rms_error(h, h_ref)
        row["state_vnew"] = rel_rms_error(v_new.reshape(vn_ref.shape), vn_ref)
        row["state_final"] = rel_rms_error(ht, ht_ref) if ht_ref is not None else 0.0
    except Exception as exc:
        row["stage_error"] = row.get("stage_error", "") + f" state: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    try:
        o_ref = ref_output(p, v_new, h, g_cum)
        poison_allocator(device)
        o = output_fwd(p.q, p.k, v_new, h, g_cum, chunks, plan_output(p, info), scale=p.scale)
        torch.cuda.synchronize()
        row["out_o"] = rel_rms_error(o.reshape(o_ref.shape), o_ref)
    except Exception as exc:
        row["stage_error"] = row.get("stage_error", "") + f" output: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    # Whole backend vs the float32 reference.
    try:
        poison_allocator(device)
        o, ht = chunk_gated_delta_rule(**call, output_final_state=True, use_qk_l2norm_in_kernel=c["l2"],
                                       backend="gluon_sm90")
        torch.cuda.synchronize()
        p = make_problem(**call, output_final_state=True, use_qk_l2norm_in_kernel=c["l2"])
        o_ref, ht_ref = reference.forward(p)
        row["fwd_o"], row["fwd_state"] = rel_rms_error(o, o_ref), rel_rms_error(ht, ht_ref)
    except Exception as exc:
        row["fwd_error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    errs = {k: v for k, v in row.items() if isinstance(v, float)}
    row["ok"] = "fwd_error" not in row and "stage_error" not in row and all(e <= tol for e in errs.values())
    results.append(row)
    worst = max(errs, key=errs.get) if errs else "-"
    say(f"{'PASS' if row['ok'] else 'FAIL'} {cid}  " + " ".join(f"{k}={v:.1e}" for k, v in errs.items())
        + (f"  worst={worst}" if not row["ok"] and errs else "")
        + "".join(f"  {k}: {row[k]}" for k in ("fwd_error", "stage_error") if k in row))


def correctness(device, info):
    say("== part 1: correctness (tolerance 5e-3 rel. RMS; fwd_* vs reference, wu_*/state_*/out_* "
        "= one stage vs torch fp32 on the same inputs)")
    results = []
    lengths = [1, 63, 64, 65, 130, 0]
    base = {"KV": (128, 128), "ratio": 2, "dtype": torch.bfloat16, "layout": "kv", "h0": True, "l2": True}
    cases = [(base, [64, 128])]  # no sequence ends inside a chunk: the path without tails, alone
    cases += [(c, lengths) for c in pairwise_cases()]
    cases.append(({**base, "layout": "vk"}, [1000, 37, 0, 513]))  # many chunks: slots and phases wrap
    for c, lens in cases:
        if elapsed() > CORRECTNESS_BUDGET_S:
            say(f"SKIP {case_id(c, lens)} (time budget)")
            continue
        try:
            run_case(c, lens, device, info, results)
        except Exception as exc:  # inputs or references failed: report, go on
            traceback.print_exc()
            results.append({"case": case_id(c, lens), "ok": False, "stage_error": f"{type(exc).__name__}: {exc}"})
            say(f"FAIL {case_id(c, lens)}  {type(exc).__name__}: {exc}")
    return results


# ----------------------------------------------------------------------------- part 2


def median_ms(fn):
    from gdn_dispatch.bench import median_event_ms

    return median_event_ms(fn, iters=10, warmup=2)


def stage_times(x, info):
    """Per-stage median ms of gluon_sm90 and triton_generic on one input set."""
    from gdn_dispatch.contract import make_problem

    import gdn_dispatch.backends.triton_generic as tg
    from gdn_dispatch.backends.gluon_common.output import output_fwd, plan_output
    from gdn_dispatch.backends.gluon_common.plan import plan_state
    from gdn_dispatch.backends.gluon_common.state import state_fwd
    from gdn_dispatch.backends.gluon_common.wu import plan_wu, wu_fwd

    p = make_problem(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0, output_final_state=True,
                     cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu, use_qk_l2norm_in_kernel=x.qk_l2norm)
    ch, l2 = p.chunks, p.use_qk_l2norm
    out = {}
    g_cum = tg.chunk_cumsum_fwd(p.g, ch, scale=LOG2E)
    out["cumsum"] = median_ms(lambda: tg.chunk_cumsum_fwd(p.g, ch, scale=LOG2E))
    A = tg.kkt_solve_fwd(p.k, g_cum, p.beta, ch, use_qk_l2norm=l2)
    launch, wu_launch, out_launch = plan_state(p, info), plan_wu(p, info), plan_output(p, info)
    gl_stages = {
        "kkt": lambda: tg.kkt_solve_fwd(p.k, g_cum, p.beta, ch, use_qk_l2norm=l2),
        "wu": lambda: wu_fwd(p.k, p.v, g_cum, p.beta, A, ch, wu_launch),
    }
    gl = {"cumsum": out["cumsum"]}
    for name, fn in gl_stages.items():
        gl[name] = median_ms(fn)
    w, u = gl_stages["wu"]()
    gl["state"] = median_ms(lambda: state_fwd(p.k, w, u, g_cum, ch, launch, initial_state=p.initial_state,
                                              output_final_state=True))
    h, vn, _ = state_fwd(p.k, w, u, g_cum, ch, launch, initial_state=p.initial_state, output_final_state=True)
    gl["output"] = median_ms(lambda: output_fwd(p.q, p.k, vn, h, g_cum, ch, out_launch, scale=p.scale))
    gl["BV"] = launch.blocks["BV"]
    tgs = {"cumsum": out["cumsum"]}
    tgs["wu(+kkt)"] = median_ms(lambda: tg.wu_fwd(p.k, p.v, g_cum, p.beta, ch, use_qk_l2norm=l2))
    tw, tu = tg.wu_fwd(p.k, p.v, g_cum, p.beta, ch, use_qk_l2norm=l2)
    tgs["state"] = median_ms(lambda: tg.state_fwd(p.k, tw, tu, g_cum, ch, initial_state=p.initial_state,
                                                  output_final_state=True, use_qk_l2norm=l2))
    th, tvn, _ = tg.state_fwd(p.k, tw, tu, g_cum, ch, initial_state=p.initial_state, output_final_state=True,
                              use_qk_l2norm=l2)
    tgs["output"] = median_ms(lambda: tg.output_fwd(p.q, p.k, tvn, th, g_cum, ch, scale=p.scale, use_qk_l2norm=l2))
    return gl, tgs


def timing(device, info):
    from gdn_dispatch import bench
    from gdn_dispatch.testing import rel_rms_error

    say("== part 2: timing (bf16, K = V = 128, q/k l2 norm in kernel, initial + final state; "
        "median CUDA-event ms over rotating input sets)")
    fla_fn, fla_version, fla_reason = bench.load_fla()
    say(f"fla: {fla_version if fla_fn else fla_reason}")
    callers = {"gluon_sm90": bench.ours_caller("gluon_sm90"), "triton_generic": bench.ours_caller("triton_generic")}
    rows = []
    pending_fla = []
    for shape in bench.default_shapes():
        if elapsed() > TOTAL_BUDGET_S - 40:
            say(f"SKIP {shape.name} (time budget)")
            continue
        row = {"shape": shape.name}
        try:
            one = bench.make_input_sets(shape, 1, device, 0, qk_l2norm=True)
            set_bytes = sum(t.numel() * t.element_size() for t in (one[0].q, one[0].k, one[0].v, one[0].g, one[0].beta, one[0].h0))
            count = min(3, bench.rotation_count(set_bytes))
            sets = one + bench.make_input_sets(shape, count - 1, device, 1, qk_l2norm=True)
        except Exception as exc:
            say(f"FAIL {shape.name}: inputs: {type(exc).__name__}: {exc}")
            continue
        for name, call in callers.items():
            try:
                row[name] = statistics.median(bench.cuda_event_timer(call, sets, 2, 10))
            except Exception as exc:
                row[name] = None
                row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
                say(f"FAIL {shape.name} {name}: {row[f'{name}_error']}")
        try:
            o, s = callers["gluon_sm90"](sets[0])
            o_t, s_t = callers["triton_generic"](sets[0])
            row["err_o"], row["err_state"] = rel_rms_error(o, o_t), rel_rms_error(s, s_t)
            del o, s, o_t, s_t
        except Exception as exc:
            row["err_o"] = row["err_state"] = None
            say(f"FAIL {shape.name} check: {type(exc).__name__}: {exc}")
        try:
            row["gl_stages"], row["tg_stages"] = stage_times(sets[0], info)
        except Exception as exc:
            say(f"FAIL {shape.name} stages: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        say(f"{shape.name}: gluon_sm90 {fmt(row.get('gluon_sm90'))} ms, triton_generic {fmt(row.get('triton_generic'))} ms, "
            f"err o {fmt(row.get('err_o'), '.1e')} state {fmt(row.get('err_state'), '.1e')}; "
            f"gluon stages {stages_str(row.get('gl_stages'))}; triton_generic stages {stages_str(row.get('tg_stages'))}")
        rows.append(row)
        pending_fla.append((row, shape))
        del sets, one
        torch.cuda.empty_cache()
    # fla last: its first calls autotune, which must not starve our own measurements.
    for row, shape in pending_fla:
        if fla_fn is None:
            break
        if elapsed() > TOTAL_BUDGET_S:
            row["fla"] = None
            row["fla_error"] = "skipped (time budget)"
            continue
        try:
            sets = bench.make_input_sets(shape, 2, device, 0, qk_l2norm=True)
            row["fla"] = statistics.median(bench.cuda_event_timer(bench.fla_caller(fla_fn), sets, 2, 10))
            del sets
        except Exception as exc:
            row["fla"] = None
            row["fla_error"] = f"{type(exc).__name__}: {exc}"
            say(f"FAIL {shape.name} fla: {row['fla_error']}")
        torch.cuda.empty_cache()
    return rows


def fmt(x, spec=".3f"):
    return "-" if x is None else format(x, spec)


def stages_str(st):
    if not st:
        return "-"
    return " ".join(f"{k}={v if isinstance(v, int) else format(v, '.3f')}" for k, v in st.items())


# ----------------------------------------------------------------------------- main


def main() -> int:
    # A device-side hang (an mbarrier never completing) would block forever inside a CUDA
    # call; dump every thread's stack and exit before the 5-minute slot ends instead.
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    if not torch.cuda.is_available():
        say("no CUDA device")
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    cap = torch.cuda.get_device_capability(device)
    import triton

    from gdn_dispatch.device import default_probe

    say(f"device {torch.cuda.get_device_name(device)} sm_{cap[0]}{cap[1]}, torch {torch.__version__}, "
        f"triton {triton.__version__}")
    if tuple(cap) != (9, 0):
        say("gluon_sm90 needs an sm_90 device")
        return 2
    try:
        info = default_probe().for_torch_device(device)
    except Exception as exc:  # the op itself needs the probe; say so, but still try
        from gdn_dispatch.device import DeviceInfo

        props = torch.cuda.get_device_properties(device)
        info = DeviceInfo(kind="cuda", index=device.index, name=props.name, capability=tuple(cap),
                          sm_count=props.multi_processor_count, smem_optin=232448)
        say(f"WARNING: device probe failed ({type(exc).__name__}: {exc}); using torch's properties")
    say(f"DeviceInfo: {info}")
    correct = []
    try:
        correct = correctness(device, info)
    except Exception:
        traceback.print_exc()
    rows = []
    try:
        rows = timing(device, info)
    except Exception:
        traceback.print_exc()

    say("")
    say("== summary")
    n_ok = sum(r["ok"] for r in correct)
    say(f"correctness: {n_ok}/{len(correct)} cases pass" + ("" if n_ok == len(correct) else
        "; failing: " + ", ".join(r["case"] for r in correct if not r["ok"])))
    header = f"{'shape':22s} {'gluon_sm90':>10s} {'triton_gen':>10s} {'fla':>8s} {'gl/tg':>6s} {'err_o':>8s} {'err_S':>8s}  gluon stages (ms)"
    say(header)
    for r in rows:
        g, t, f = r.get("gluon_sm90"), r.get("triton_generic"), r.get("fla")
        ratio = None if g is None or t is None else g / t
        st = r.get("gl_stages") or {}
        st_s = " ".join(f"{k}={v if isinstance(v, int) else format(v, '.2f')}" for k, v in st.items())
        say(f"{r['shape']:22s} {fmt(g):>10s} {fmt(t):>10s} {fmt(f):>8s} {fmt(ratio, '.2f'):>6s} "
            f"{fmt(r.get('err_o'), '.1e'):>8s} {fmt(r.get('err_state'), '.1e'):>8s}  {st_s}")
    say(f"total {elapsed():.0f} s")
    return 0 if correct and n_ok == len(correct) else 1


if __name__ == "__main__":
    sys.exit(main())
