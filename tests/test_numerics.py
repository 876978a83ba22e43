"""Numerics of the intra-chunk inverse T = (I + A)^-1 with strongly correlated keys.

Neighbouring tokens of a real layer often have keys at cosine 0.9 and more, with beta near
1 and gates near 1. Then A's entries approach 1, and a product formula for T over a 16 x 16
block, (I - a)(I + a^2)(I + a^4)(I + a^8), builds powers with entries up to C(14, 7) =
3432 that cancel back to O(1): with tf32 MMA inputs (the tensor-core precision of the
16-bit paths) that cost 3e-2 relative error in T. The kernels build T by merging 4 x 4
blocks upwards instead, where every intermediate is a block of T or of A.

Each stage is checked against float64 from its own inputs: end to end, a bf16 pipeline in
this regime is 1e-2 off the float32 reference whatever the inverse (rounding T, w, u, h and
v_new to 16 bits, as fla does), which would hide part of the difference. The interpreter computes dots in fp32,
so only a GPU shows the tf32 failure (``-m gpu``); on the CPU the same calls check that
the merge order is an exact inverse.
"""

from __future__ import annotations

import math

import pytest
import torch

from gdn_dispatch.contract import make_problem
from gdn_dispatch.testing import random_call, rel_rms_error

HAS_GPU = torch.cuda.is_available()
LOG2E = math.log2(math.e)


def _device_params(gluon: bool = False):
    params = [] if gluon else [pytest.param("cpu", id="cpu")]
    runnable = HAS_GPU and (not gluon or torch.cuda.get_device_capability() in ((9, 0), (10, 0), (10, 3)))
    params.append(pytest.param("cuda", id="cuda", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not runnable, reason="needs a GPU that runs these kernels")]))
    return params


def _problem(device, cosine, K, monkeypatch):
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    call = random_call(lengths=[130, 64, 1], H=1, HV=2, K=K, V=K, dtype=torch.bfloat16, device=device,
                       seed=3, key_cosine=cosine)
    return make_problem(**call)


def _exact_inverse(problem, g_cum):
    """float64 T of every chunk and v-head, laid out as kkt_solve_fwd's ``[B*T, HV, 64]``,
    and the float64 A rows it came from."""
    k = problem.k.reshape(-1, problem.H, problem.K).double().repeat_interleave(problem.HV // problem.H, dim=1)
    beta = problem.beta.reshape(-1, problem.HV).double()
    g = g_cum.reshape(-1, problem.HV).double()
    out = torch.zeros(k.shape[0], problem.HV, 64, dtype=torch.float64, device=k.device)
    cu = problem.chunks.cu_seqlens_host.tolist()
    for bos, eos in zip(cu[:-1], cu[1:]):
        for c0 in range(bos, eos, 64):
            n = min(64, eos - c0)
            kc, bc, gc = k[c0:c0 + n].transpose(0, 1), beta[c0:c0 + n].T, g[c0:c0 + n].T  # [HV, n, *]
            a = (kc @ kc.transpose(1, 2)) * torch.exp2(gc[:, :, None] - gc[:, None, :]) * bc[:, :, None]
            a = torch.tril(a, diagonal=-1)
            eye = torch.eye(n, dtype=torch.float64, device=k.device)
            out[c0:c0 + n, :, :n] = torch.linalg.inv(eye + a).transpose(0, 1)
    return out


@pytest.mark.parametrize("device", _device_params())
@pytest.mark.parametrize("cosine", [0.9, 0.99])
def test_triton_generic_inverse_with_correlated_keys(device, cosine, monkeypatch):
    from gdn_dispatch.backends.triton_generic import chunk_cumsum_fwd, kkt_solve_fwd

    p = _problem(device, cosine, 128 if device == "cuda" else 32, monkeypatch)
    g_cum = chunk_cumsum_fwd(p.g, p.chunks, scale=LOG2E)
    T = kkt_solve_fwd(p.k, g_cum, p.beta, p.chunks, out_dtype=torch.float32)
    # tf32 inputs, fp32 accumulation: about 1e-3 with the block merge, 3e-2 with the product
    # formula (emulated in float32 with tf32 rounding); the bound sits between the two.
    assert rel_rms_error(T.reshape(-1, p.HV, 64), _exact_inverse(p, g_cum)) < 5e-3


@pytest.mark.parametrize("device", _device_params(gluon=True))
@pytest.mark.parametrize("cosine", [0.9, 0.99])
def test_gluon_wy_with_correlated_keys(device, cosine, monkeypatch):
    from gdn_dispatch.backends.gluon_common.plan import plan
    from gdn_dispatch.backends.gluon_common.wy import wy_fwd
    from gdn_dispatch.backends.triton_generic import chunk_cumsum_fwd

    p = _problem(device, cosine, 128, monkeypatch)
    g_cum = chunk_cumsum_fwd(p.g, p.chunks, scale=LOG2E)
    w, u, g_cum_wy = wy_fwd(p.k, p.v, p.g, p.beta, p.chunks, plan(p).stage("wy_fwd"))
    # The kernel's own gate cumsum (a tree scan) against triton_generic's.
    torch.testing.assert_close(g_cum_wy, g_cum, rtol=1e-5, atol=1e-5)
    T = _exact_inverse(p, g_cum)  # [B*T, HV, 64]: row t of its chunk
    k = p.k.reshape(-1, p.H, p.K).double().repeat_interleave(p.HV // p.H, dim=1)
    v = p.v.reshape(-1, p.HV, p.V).double()
    scale_w = p.beta.reshape(-1, p.HV).double() * torch.exp2(g_cum.reshape(-1, p.HV).double())
    scale_u = p.beta.reshape(-1, p.HV).double()
    w_ref, u_ref = torch.zeros_like(k[..., :1].expand(-1, -1, p.K)), torch.zeros_like(v)
    cu = p.chunks.cu_seqlens_host.tolist()
    for bos, eos in zip(cu[:-1], cu[1:]):
        for c0 in range(bos, eos, 64):
            r = slice(c0, min(c0 + 64, eos))
            n = r.stop - r.start
            Tc = T[r, :, :n].transpose(0, 1)  # [HV, n, n]
            w_ref[r] = (Tc @ (k[r] * scale_w[r, :, None]).transpose(0, 1)).transpose(0, 1)
            u_ref[r] = (Tc @ (v[r] * scale_u[r, :, None]).transpose(0, 1)).transpose(0, 1)
    # The kernel rounds the scaled T to bf16 before the w/u products (as fla does), and
    # with nearly parallel keys w = T (beta 2^g k) cancels heavily, so that rounding alone
    # costs 9e-3 (cosine 0.9) and 1.6e-2 (0.99) against float64, by emulation on the CPU
    # and measured on the H200 (9.3e-3, 1.2e-2). The product-formula inverse gave 0.5-0.7.
    assert rel_rms_error(w.reshape(w_ref.shape), w_ref) < 3e-2
    assert rel_rms_error(u.reshape(u_ref.shape), u_ref) < 3e-2


def test_correlated_keys_are_correlated():
    """The generator really produces the hard regime the tests above rely on."""
    call = random_call(batch=(1, 64), H=1, HV=1, K=128, V=16, dtype=torch.float32, key_cosine=0.9)
    k = call["k"][0, :, 0]
    cos = (k @ k.T).fill_diagonal_(0)
    assert cos.sum() / (64 * 63) > 0.9
    assert float(call["beta"].min()) >= 0.5 and float(call["g"].min()) >= -0.01


def _nan_empty(empty):
    """``torch.empty`` that fills floating tensors with NaN (poisoned outputs)."""
    def poisoned(*args, **kwargs):
        out = empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out
    return poisoned


def _t_tiles_reference(p, g_cum, tiles=2):
    """float64 T_u = T diag(beta) of every chunk and v-head, gathered as wy_t_fwd lays its
    tiles out (with tails, sequence n's chunks start at slot cu[n] // 64 + n; ``tiles`` per
    slot and v-head, T_u the last), and the kernel rows that hold them: (rows of t_tiles,
    [rows, 64] reference)."""
    from gdn_dispatch.backends.gluon_common.launch_plan import has_tails

    T = _exact_inverse(p, g_cum)  # [B*T, HV, 64]: row t of its chunk
    beta = p.beta.reshape(-1, p.HV).double()
    tails = has_tails(p)
    rows, ref = [], []
    cu = p.chunks.cu_seqlens_host.tolist()
    for n, (bos, eos) in enumerate(zip(cu[:-1], cu[1:])):
        for c0 in range(bos, eos, 64):
            r = min(64, eos - c0)
            slot = c0 // 64 + n if tails else c0 // 64
            for h in range(p.HV):
                base = ((slot * p.HV + h) * tiles + tiles - 1) * 64
                tile = torch.zeros(64, 64, dtype=torch.float64, device=T.device)
                tile[:r, :r] = T[c0:c0 + r, h, :r] * beta[c0:c0 + r, h][None, :]
                rows.append(torch.arange(base, base + 64, device=T.device))
                ref.append(tile)
    return torch.cat(rows), torch.cat(ref)


#: How the T kernel stores T: (WY_T_SINGLE_TILE, WY_T_BLOCK_TMA).
T_STORES = {"pair": (False, False), "t-u-direct": (True, False), "t-u-block-tma": (True, True)}


@pytest.mark.parametrize("device", _device_params(gluon=True))
@pytest.mark.parametrize("store", list(T_STORES))
@pytest.mark.parametrize("case", ["cosine-0.9", "cosine-0.99", "beyond-fp16-range"])
def test_gluon_t_tiles_against_float64(device, case, store, monkeypatch):
    """The T kernel of the warp-specialized path: T_u against float64, with correlated keys,
    and with keys so long that A's entries (about 1e5) and T's leave fp16's range (where an
    fp16 inverse must be redone in tf32: an fp16 result would hold inf / NaN there); T_w and
    T_u as a pair, T_u alone from the inverse's registers, and T_u alone in 16 x 16 TMA
    boxes. The tiles start as NaN: every element of T_u, zeros included, must be written."""
    from gdn_dispatch.backends.gluon_common import wy_t
    from gdn_dispatch.backends.gluon_common.wy_t import plan_wy_t, wy_t_fwd

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(wy_t, "WY_T_SINGLE_TILE", T_STORES[store][0])
    monkeypatch.setattr(wy_t, "WY_T_BLOCK_TMA", T_STORES[store][1])
    if case == "beyond-fp16-range":
        call = random_call(lengths=[3, 2, 130, 3], H=1, HV=2, K=128, V=128, dtype=torch.bfloat16, device=device,
                           seed=5, key_cosine=0.9)
        k = call["k"]
        k[0, :5] *= 300.0  # the first two sequences
        k[0, -3:] *= 300.0  # and the last
    else:
        call = random_call(lengths=[130, 64, 1], H=1, HV=2, K=128, V=128, dtype=torch.bfloat16, device=device,
                           seed=3, key_cosine=float(case.split("-")[1]))
    p = make_problem(**call)
    with monkeypatch.context() as poison:
        poison.setattr(torch, "empty", _nan_empty(torch.empty))
        t_tiles, g_cum = wy_t_fwd(p.k, p.g, p.beta, p.chunks, plan_wy_t(p, torch.cuda.get_device_capability()))
    rows, ref = _t_tiles_reference(p, g_cum, 1 if T_STORES[store][0] else 2)
    got = t_tiles[rows].double()
    assert torch.isfinite(got).all()
    # T_u is rounded to bf16 (2^-9 relative); the inverse's own error is about 1e-3.
    assert rel_rms_error(got, ref) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_GPU or torch.cuda.get_device_capability() != (9, 0), reason="needs an sm_90 GPU")
@pytest.mark.parametrize("route", ["pipeline", "path"])
def test_keys_beyond_fp16_range_through_the_public_call(route):
    """A call whose A and T leave fp16's range in a few chunks (keys 300 times unit length
    in the first two sequences and the last): the inverse on fp16 operands
    (:data:`.blocked_inverse.F16_OPERANDS`) must redo those chunks in tf32 in every kernel
    that forms T, the pipeline's w/u kernel (H 1, HV 2: too few programs for the path) and
    the warp-specialized path's fused kernel (H 16, HV 32). Outputs start as NaN."""
    from gdn_dispatch import chunk_gated_delta_rule
    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.backends.gluon_common.forward import plan_call
    from gdn_dispatch.device import default_probe
    from gdn_dispatch.testing import poison_cuda_allocator

    H, HV = (1, 2) if route == "pipeline" else (16, 32)
    lengths = [3, 2, 130, 700, 64, 3] if route == "pipeline" else [3, 2, 130, 700, 64, 3] * 8
    call = random_call(lengths=lengths, H=H, HV=HV, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=5,
                       key_cosine=0.9)
    call["output_final_state"] = True
    k = call["k"]
    k[0, :5] *= 300.0
    k[0, -3:] *= 300.0
    p = make_problem(**call)
    device = default_probe().for_torch_device(p.device)
    assert bool(plan_call(p, device, engine=gluon_sm90.ENGINE).launches.fused) == (route == "path")
    expected = chunk_gated_delta_rule(**{n: v.cpu() if torch.is_tensor(v) else v for n, v in call.items()},
                                      backend="reference")
    poison_cuda_allocator()
    o, ht = chunk_gated_delta_rule(**call, backend="gluon_sm90")
    assert rel_rms_error(o.float().cpu(), expected[0].float()) < 5e-3
    assert rel_rms_error(ht.float().cpu(), expected[1].float()) < 5e-3
