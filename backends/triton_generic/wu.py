"""Stage 3: the WY representation of each chunk, w = T (beta 2^g k) and u = T (beta v).

One program owns one (chunk, v-head). With ``FUSED_SOLVE`` (what the orchestrator runs) the
program first forms T = (I + A)^-1 in registers with stage 2's tile function, so T never
travels through global memory and k is read by a single kernel; without it T is loaded from
:func:`kkt_solve_fwd`'s output. T multiplies at the input dtype (fp32 for float32 calls,
the 16-bit type otherwise: the same rounding w and u get when stored). Whichever kernel
forms T also forms stage 1's gate cumsum in the forward (``FORM_G_CUM``), so a call
launches no cumsum kernel.
"""

from __future__ import annotations

import torch
import triton.language as tl

from gdn_dispatch.varlen import ChunkTable

from gdn_dispatch.backends.triton_generic._jit import L2NORM_EPS, _cast, _dot, _slot_rows, jit
from gdn_dispatch.backends.triton_generic.strides import token_stride
from gdn_dispatch.backends.triton_generic.configs import LaunchConfig, device_facts, intra_config, launch
from gdn_dispatch.backends.triton_generic.kkt_solve import (
    _g_operands, _kkt_solve_tile, dot_precisions, interp_bf16_dots)


@jit
def _row_rnorm(p_k, m_t, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
             USE_L2NORM: tl.constexpr):
    """1 / ||x_t|| (eps 1e-6) of a chunk's q or k rows (``p_k``: [BT, 1] row pointers),
    [BT] fp32; ones without USE_L2NORM."""
    b_ss = tl.zeros([BT], dtype=tl.float32)
    if USE_L2NORM:
        for i_k in range(tl.cdiv(K, BK)):
            o_k = i_k * BK + tl.arange(0, BK)
            b_k = tl.load(p_k + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
            b_k = b_k.to(tl.float32)
            b_ss += tl.sum(b_k * b_k, axis=1)
        b_r = tl.rsqrt(b_ss + L2NORM_EPS)
    else:
        b_r = b_ss + 1.0
    return b_r


@jit(do_not_specialize=("N",))
def _wu_fwd_kernel(
    k,
    v,
    g,
    g_cum,
    beta,
    A_inv,
    w,
    u,
    k_rnorm,
    cu_seqlens,
    N,
    s_k: tl.constexpr,
    s_v: tl.constexpr,
    s_g: tl.constexpr,
    s_b: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    FUSED_SOLVE: tl.constexpr,
    FORM_G_CUM: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    STORE_RNORM: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SOLVE_PREC: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    tl.static_assert(FUSED_SOLVE or not FORM_G_CUM, "the gate cumsum is formed by the solve")
    pid = tl.program_id(0).to(tl.int64)
    i_c, i_h = pid // HV, pid % HV
    t0, n_t = _slot_rows(cu_seqlens, i_c, N, BT)
    if n_t <= 0:  # an idle slot
        return
    o_i = tl.arange(0, BT)
    m_t = o_i < n_t
    p_k = k + t0 * s_k + (i_h // (HV // H)) * K + o_i[:, None] * s_k
    if FUSED_SOLVE:
        b_x, b_g, b_b, b_r = _kkt_solve_tile(k, g, g_cum, beta, s_k, s_g, s_b, t0, n_t, i_h, H, HV, K, BT, BK,
                                             FORM_G_CUM, USE_L2NORM, DOT_PREC, SOLVE_PREC, INTERP_BF16)
    else:
        p_a = A_inv + (t0 * HV + i_h) * BT + o_i[:, None] * (HV * BT) + o_i[None, :]
        b_x = tl.load(p_a, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_g = tl.load(g_cum + t0 * HV + i_h + o_i * HV, mask=m_t, other=0.0)
        b_b = tl.load(beta + t0 * s_b + i_h + o_i * s_b, mask=m_t, other=0.0).to(tl.float32)
        b_r = _row_rnorm(p_k, m_t, K, BT, BK, USE_L2NORM)

    # The per-token scales go on T's columns, in fp32, so that k and v enter the MMAs
    # exactly as stored: w = (T diag(beta 2^g r)) k and u = (T diag(beta)) v, with r = 1/||k||
    # under the fused l2-norm. One rounding (of the scaled T) per product instead of two.
    if STORE_RNORM:
        # The later stages scale by the same 1/||k|| instead of reducing k's rows again
        # (the state kernel would do it inside its serial chunk loop).
        tl.store(k_rnorm + t0 * HV + i_h + o_i * HV, b_r, mask=m_t)
    b_xk = _cast(b_x * (b_b * tl.exp2(b_g) * b_r)[None, :], w.dtype.element_ty, INTERP_BF16)
    b_xv = _cast(b_x * b_b[None, :], u.dtype.element_ty, INTERP_BF16)
    p_w = w + (t0 * HV + i_h) * K + o_i[:, None] * (HV * K)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = m_t[:, None] & (o_k < K)[None, :]
        b_k = tl.load(p_k + o_k[None, :], mask=m_k, other=0.0)
        b_w = _dot(b_xk, b_k, tl.zeros([BT, BK], dtype=tl.float32), DOT_PREC, INTERP_BF16)
        tl.store(p_w + o_k[None, :], _cast(b_w, w.dtype.element_ty, INTERP_BF16), mask=m_k)

    p_v = v + t0 * s_v + i_h * V + o_i[:, None] * s_v
    p_u = u + (t0 * HV + i_h) * V + o_i[:, None] * (HV * V)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = m_t[:, None] & (o_v < V)[None, :]
        b_v = tl.load(p_v + o_v[None, :], mask=m_v, other=0.0)
        b_u = _dot(b_xv, b_v, tl.zeros([BT, BV], dtype=tl.float32), DOT_PREC, INTERP_BF16)
        tl.store(p_u + o_v[None, :], _cast(b_u, u.dtype.element_ty, INTERP_BF16), mask=m_v)


def wu_fwd(
    k: torch.Tensor,
    v: torch.Tensor,
    g_cum: torch.Tensor,
    beta: torch.Tensor,
    chunks: ChunkTable,
    *,
    A_inv: torch.Tensor | None = None,
    g: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    k_rnorm: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The WY vectors of each chunk: ``w = T (beta 2^g_cum k)``, ``u = T (beta v)``.

    Parameters
    ----------
    k : Tensor ``[B, T, H, K]``, bf16/fp16/fp32, in token rows (any token stride).
    v : Tensor ``[B, T, HV, V]``, k's dtype, in token rows.
    g_cum : float32 Tensor ``[B, T, HV]``, chunk-local gate cumsum in log2 units; written
        here instead when ``g`` is given.
    beta : Tensor ``[B, T, HV]``, any float dtype.
    chunks : ChunkTable of the call.
    A_inv : Tensor ``[B, T, HV, 64]`` from :func:`kkt_solve_fwd`, or None (default) to
        form T inside this kernel (fused: the fast path).
    g : Tensor ``[B, T, HV]`` (any float dtype, in token rows) or None; only with
        ``A_inv`` None: the kernel forms the gate cumsum from it and stores it into
        ``g_cum`` (what the forward does: no cumsum launch of its own).
    use_qk_l2norm : k rows are l2-normalized (eps 1e-6) before use.
    k_rnorm : float32 Tensor ``[B, T, HV]`` or None; with ``use_qk_l2norm``, receives
        ``1 / ||k||`` of every token (per v-head) for :func:`state_fwd` / :func:`output_fwd`.
    config : LaunchConfig override (BK, BV, num_warps, num_stages); default from the table.
    out : (w, u) allocated by the caller (contiguous, as returned below), or None.

    Returns
    -------
    w : Tensor ``[B, T, HV, K]``, k's dtype.
    u : Tensor ``[B, T, HV, V]``, k's dtype.
    """
    H, K = k.shape[-2], k.shape[-1]
    HV, V, BT = v.shape[-2], v.shape[-1], chunks.chunk_size
    if g is not None and A_inv is not None:
        raise ValueError("g: the gate cumsum is formed only with the solve fused (A_inv None); "
                         "kkt_solve_fwd(g=...) forms it on the split path")
    if out is None:
        w = torch.empty(*v.shape[:-1], K, dtype=k.dtype, device=k.device)
        u = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    else:
        w, u = out
    if v.shape[0] * v.shape[1] == 0 or HV == 0:
        return w, u
    capability, _ = device_facts(k.device)
    cfg = config or intra_config(K, V, k.element_size(), capability)
    launch(_wu_fwd_kernel, (chunks.num_slots * HV,), cfg, **wu_launch_args(
        cfg, k.dtype, k, v, g, g_cum, beta, A_inv if A_inv is not None else g_cum, w, u,
        k_rnorm if k_rnorm is not None else g_cum, chunks.cu_seqlens, chunks.num_seqs, token_stride("k", k),
        token_stride("v", v), None if g is None else token_stride("g", g), token_stride("beta", beta), H, HV, K, V,
        BT, fused_solve=A_inv is None, use_qk_l2norm=use_qk_l2norm, store_rnorm=use_qk_l2norm and k_rnorm is not None))
    return w, u


def wu_launch_args(cfg, dtype, k, v, g, g_cum, beta, A_inv, w, u, k_rnorm, cu_seqlens, num_seqs, s_k, s_v, s_g, s_b,
                   H, HV, K, V, BT, *, fused_solve, use_qk_l2norm, store_rnorm) -> dict:
    """Every argument of one ``_wu_fwd_kernel`` launch by name, the unused pointers
    (``A_inv``, ``k_rnorm``) already replaced by a stand-in (what :func:`wu_fwd` launches
    with; :mod:`.call_program` binds the same list). ``g`` (token stride ``s_g``) given:
    the kernel forms the gate cumsum into ``g_cum`` (``kkt_solve._g_operands``)."""
    dot_prec, solve_prec = dot_precisions(dtype)
    g, s_g, form_g_cum = _g_operands(g, g_cum, s_g, s_b)
    return dict(
        k=k, v=v, g=g, g_cum=g_cum, beta=beta, A_inv=A_inv, w=w, u=u, k_rnorm=k_rnorm, cu_seqlens=cu_seqlens,
        N=num_seqs, s_k=s_k, s_v=s_v, s_g=s_g, s_b=s_b, H=H, HV=HV, K=K, V=V, BT=BT, BK=cfg.BK, BV=cfg.BV,
        FUSED_SOLVE=fused_solve, FORM_G_CUM=form_g_cum, USE_L2NORM=use_qk_l2norm, STORE_RNORM=store_rnorm,
        DOT_PREC=dot_prec, SOLVE_PREC=solve_prec, INTERP_BF16=interp_bf16_dots(dtype))
