"""H200 check of the Gluon w/u and output kernels IN ISOLATION (sm_90a: wgmma engine).

Run from the repository root on an sm_90 GPU (well under 2 minutes, cold Triton cache)::

    PYTHONPATH=. python benchmarks/h200_gluon_stages.py

Each kernel gets exactly the inputs it gets in the pipeline and is compared with a float32
torch computation from those same inputs, so a failure names the kernel:

* ``wu``: k, v, beta from a random call, g_cum and T = A_inv from triton_generic's stages
  1-2 (``chunk_cumsum_fwd``, ``kkt_solve_fwd``) -> w = T (beta 2^g k), u = T (beta v).
* ``output``: q, k, g_cum as above, random h ``[NT, HV, K, V]`` and v_new -> o.

Cases: K, V in {64, 128}; H/HV = 4/4, 2/4, 1/4; bf16 and fp16; qk l2 norm on and off; a
packed varlen batch with lengths 1, 63, 64, 65, 130, 0 (partial chunks: sm_90a stores their
rows with masked register stores); the output's V-block BV = 64 and 128; plus uniform
batches with T % 64 == 0 (no partial chunk: the kernels' dense path) and T = 100. Outputs
are NaN-poisoned (the caching allocator's free blocks are filled with NaN first), so an
unwritten row reads as an infinite error. Tolerance: relative RMS error <= 5e-3.
Prints one line per case and a PASS/FAIL summary; exit status 1 on any failure.
"""

from __future__ import annotations

import math
import sys
import time
import traceback

import torch

T0 = time.time()
BUDGET_S = 110  # remaining cases are skipped (and said so) past this
TOL = 5e-3
LOG2E = math.log2(math.e)
VARLEN = [1, 63, 64, 65, 130, 0]


def say(*args):
    print(*args, flush=True)


def poison_allocator(device):
    """Fill the caching allocator's free blocks with NaN, so that the next torch.empty
    (the kernels' outputs) starts as NaN and an unwritten element shows up."""
    small = [torch.full((1 << 17,), float("nan"), device=device) for _ in range(32)]  # 512 KB blocks
    large = torch.full((1 << 26,), float("nan"), device=device)  # 256 MB
    del small, large


# ------------------------------------------------------------------------------ references


def chunk_index(chunks, n_rows):
    """[NT, 64] packed row of every chunk position (clamped into the tensor) and whether it
    belongs to the chunk's sequence."""
    cu = chunks.cu_seqlens.long()
    seq = chunks.chunk_seq.long()
    row0 = cu[seq] + 64 * chunks.chunk_local.long()
    rows = row0[:, None] + torch.arange(64, device=cu.device)
    valid = rows < cu[seq + 1][:, None]
    return rows.clamp(max=n_rows - 1), valid


def per_chunk(x, rows, valid):
    """x [B*T, HV, D] -> [NT, HV, 64, D] (or [B*T, HV] -> [NT, HV, 64]), rows past the end 0."""
    y = x[rows]
    mask = valid.view(*valid.shape, *([1] * (y.dim() - 2)))
    y = torch.where(mask, y, torch.zeros((), dtype=y.dtype, device=y.device))
    return y.transpose(1, 2)


def unchunk(y, rows, valid, shape):
    """[NT, HV, 64, D] -> [B*T, HV, D] (each row from its own chunk)."""
    out = torch.full(shape, float("nan"), device=y.device)
    out[rows[valid]] = y.transpose(1, 2)[valid]
    return out


def qk_heads(p, x, l2):
    x = x.reshape(p.B * p.T, p.H, p.K).float()
    if l2:
        x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    return x.repeat_interleave(p.HV // p.H, dim=1)  # [B*T, HV, K]


def ref_wu(p, A_inv, g_cum, l2):
    rows, valid = chunk_index(p.chunks, p.B * p.T)
    n = p.B * p.T
    beta = p.beta.reshape(n, p.HV).float()
    g = g_cum.reshape(n, p.HV)
    ks = qk_heads(p, p.k, l2) * (beta * torch.exp2(g))[..., None]
    vs = p.v.reshape(n, p.HV, p.V).float() * beta[..., None]
    a = per_chunk(A_inv.reshape(n, p.HV, 64).float(), rows, valid)
    w = a @ per_chunk(ks, rows, valid)
    u = a @ per_chunk(vs, rows, valid)
    return unchunk(w, rows, valid, (n, p.HV, p.K)), unchunk(u, rows, valid, (n, p.HV, p.V))


def ref_output(p, v_new, h, g_cum, l2):
    rows, valid = chunk_index(p.chunks, p.B * p.T)
    n = p.B * p.T
    q = per_chunk(qk_heads(p, p.q, l2), rows, valid)
    k = per_chunk(qk_heads(p, p.k, l2), rows, valid)
    v = per_chunk(v_new.reshape(n, p.HV, p.V).float(), rows, valid)
    g = per_chunk(g_cum.reshape(n, p.HV), rows, valid)  # [NT, HV, 64]
    causal = torch.ones(64, 64, dtype=torch.bool, device=q.device).tril()
    m = causal & valid[:, None, :, None] & valid[:, None, None, :]
    zero = torch.zeros((), device=q.device)
    decay = torch.exp2(torch.where(m, g[..., :, None] - g[..., None, :], zero))  # where first: no overflow
    att = torch.where(m, (q @ k.transpose(-1, -2)) * decay, zero)
    o = p.scale * ((q @ h.float()) * torch.exp2(g)[..., None] + att @ v)
    return unchunk(o, rows, valid, (n, p.HV, p.V))


# ------------------------------------------------------------------------------ cases


def cases():
    """Every (K, V) x H/HV ratio; dtype and l2 alternate so that every (K, V) meets both of
    each; BV alternates for V = 128. Then the uniform-batch cases."""
    out = []
    for i, (K, V) in enumerate([(64, 64), (64, 128), (128, 64), (128, 128)]):
        for j, H in enumerate((4, 2, 1)):
            dtype = (torch.bfloat16, torch.float16)[(i + j) % 2]
            out.append(dict(K=K, V=V, H=H, dtype=dtype, l2=(i + j // 2) % 2 == 1,
                            BV=(128 if (i + j) % 2 else 64) if V == 128 else 64, lengths=VARLEN))
    out.append(dict(K=128, V=128, H=2, dtype=torch.bfloat16, l2=True, BV=128, batch=(2, 128)))
    out.append(dict(K=64, V=128, H=1, dtype=torch.float16, l2=False, BV=64, batch=(2, 192)))
    out.append(dict(K=128, V=64, H=4, dtype=torch.bfloat16, l2=False, BV=64, batch=(3, 100)))
    return out


def case_id(c):
    dt = "bf16" if c["dtype"] == torch.bfloat16 else "fp16"
    shape = "L" + "/".join(map(str, c["lengths"])) if "lengths" in c else f"B{c['batch'][0]}xT{c['batch'][1]}"
    return f"K{c['K']}-V{c['V']}-BV{c['BV']}-H{c['H']}-HV4-{dt}{'-l2' if c['l2'] else ''}-{shape}"


def run_case(c, seed, device, info):
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.testing import random_call, rel_rms_error

    from gdn_dispatch.backends.gluon_common.output import output_fwd
    from gdn_dispatch.backends.gluon_common.wu import wu_fwd
    from gdn_dispatch.backends.triton_generic import chunk_cumsum_fwd, kkt_solve_fwd

    HV = 4
    call = random_call(lengths=c.get("lengths"), batch=c.get("batch"), H=c["H"], HV=HV, K=c["K"], V=c["V"],
                       dtype=c["dtype"], device=device, seed=seed, initial_state=False,
                       normalize_qk=not c["l2"])
    call.pop("initial_state")
    p = make_problem(**call, use_qk_l2norm_in_kernel=c["l2"])
    n = p.B * p.T
    row = {}
    try:
        g_cum = chunk_cumsum_fwd(p.g, p.chunks, scale=LOG2E)
        A_inv = kkt_solve_fwd(p.k, g_cum, p.beta, p.chunks, use_qk_l2norm=c["l2"])
        poison_allocator(device)
        w, u = wu_fwd(p.k, p.v, g_cum, p.beta, A_inv, p.chunks, use_qk_l2norm=c["l2"], device_info=info)
        torch.cuda.synchronize()
        w_ref, u_ref = ref_wu(p, A_inv, g_cum, c["l2"])
        row["w"] = rel_rms_error(w.reshape(n, HV, p.K), w_ref)
        row["u"] = rel_rms_error(u.reshape(n, HV, p.V), u_ref)
    except Exception as exc:  # one failing stage must not hide the other
        row["wu_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        traceback.print_exc()
    try:
        gen = torch.Generator(device=device).manual_seed(7)
        g_cum = chunk_cumsum_fwd(p.g, p.chunks, scale=LOG2E)
        h = torch.randn(p.chunks.num_chunks, HV, p.K, p.V, generator=gen, device=device).to(p.dtype)
        v_new = torch.randn(n, HV, p.V, generator=gen, device=device).to(p.dtype).reshape(p.v.shape)
        poison_allocator(device)
        o = output_fwd(p.q, p.k, v_new, h, g_cum, p.chunks, scale=p.scale, use_qk_l2norm=c["l2"],
                       device_info=info, block_v=c["BV"])
        torch.cuda.synchronize()
        row["o"] = rel_rms_error(o.reshape(n, HV, p.V), ref_output(p, v_new, h, g_cum, c["l2"]))
    except Exception as exc:
        row["output_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        traceback.print_exc()
    return row


def main() -> int:
    if not torch.cuda.is_available():
        say("no CUDA device: this script checks the Gluon kernels on an sm_90 GPU")
        return 2
    from gdn_dispatch.device import default_probe

    device = torch.device("cuda", torch.cuda.current_device())
    info = default_probe().for_torch_device(device)
    import triton

    say(f"device {info.name} sm_{info.capability[0]}{info.capability[1]}, {info.sm_count} SMs; "
        f"torch {torch.__version__}, triton {triton.__version__}")
    if info.capability[0] not in (9, 10):
        say("the Gluon kernels need sm_90 (wgmma) or sm_100/sm_103 (tcgen05)")
        return 2
    poison_allocator(device)
    probe = torch.empty(1 << 16, device=device)
    say(f"NaN poisoning active: {bool(torch.isnan(probe).all())}")
    del probe

    say(f"{'case':58s} {'w':>8s} {'u':>8s} {'o':>8s}  result (rel. RMS vs torch fp32, tol {TOL:g})")
    failures, ran = 0, 0
    for seed, c in enumerate(cases()):
        cid = case_id(c)
        if time.time() - T0 > BUDGET_S:
            say(f"{cid:58s} SKIP (time budget)")
            continue
        row = run_case(c, seed, device, info)
        ran += 1
        errs = {k: v for k, v in row.items() if isinstance(v, float)}
        ok = len(errs) == 3 and all(e <= TOL for e in errs.values())
        failures += not ok
        cells = " ".join(f"{row[k]:8.1e}" if k in row else f"{'ERR':>8s}" for k in ("w", "u", "o"))
        notes = "".join(f"  {k}: {row[k]}" for k in ("wu_error", "output_error") if k in row)
        say(f"{cid:58s} {cells}  {'PASS' if ok else 'FAIL'}{notes}")
    say(f"{ran - failures}/{ran} cases pass ({len(cases()) - ran} skipped) in {time.time() - T0:.0f} s")
    return 1 if failures or ran < len(cases()) else 0


if __name__ == "__main__":
    sys.exit(main())
