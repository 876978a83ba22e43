"""Stage 5: the output of every chunk from its start state and its own tokens::

    o = scale * (2^g (q h) + causal(q k^T 2^(g_i - g_j)) v_new)

One program owns one (chunk, v-head, BV slice of V); with BV = V (up to 128) the [64, 64]
score tile q k^T is formed once per chunk and head. The K loop streams q, k and h tiles
and feeds both MMAs. With the fused l2-norm the raw q, k enter the MMAs and their row
norms scale the results in fp32: q's on the rows of o, k's on the columns of the scores.
"""

from __future__ import annotations

import torch
import triton.language as tl

from gdn_dispatch.varlen import ChunkTable

from gdn_dispatch.backends.triton_generic._jit import _cast, _dot, _slot_rows, jit
from gdn_dispatch.backends.triton_generic.strides import token_stride
from gdn_dispatch.backends.triton_generic.configs import LaunchConfig, device_facts, launch, output_config
from gdn_dispatch.backends.triton_generic.kkt_solve import dot_precisions, interp_bf16_dots
from gdn_dispatch.backends.triton_generic.wu import _row_rnorm


@jit(do_not_specialize=("N",))
def _output_fwd_kernel(
    q,
    k,
    v_new,
    h,
    g_cum,
    k_rnorm,
    o,
    cu_seqlens,
    N,
    scale,
    s_q: tl.constexpr,
    s_k: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    LOAD_RNORM: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    # Axis 0: (chunk slot, v-head) flattened, v-head fastest (it may pass 65535); axis 1:
    # V slice. h is indexed by slot.
    pid = tl.program_id(0).to(tl.int64)
    i_c, i_h = pid // HV, pid % HV
    i_v = tl.program_id(1)
    t0, n_t = _slot_rows(cu_seqlens, i_c, N, BT)
    # An idle slot (n_t <= 0) masks every row, and h by k_h = 0 (its h rows were never
    # written): it loads and stores nothing. (No early return: that cost 39 registers per
    # thread at K = V = 128 on sm_90.)
    k_h = tl.where(n_t > 0, K, 0)
    o_i = tl.arange(0, BT)
    m_t = o_i < n_t
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    o_hk = (i_h // (HV // H)) * K
    p_q = q + t0 * s_q + o_hk + o_i[:, None] * s_q
    p_k = k + t0 * s_k + o_hk + o_i[None, :] * s_k
    p_h = h + (i_c * HV + i_h) * (K * V) + o_v[None, :]
    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_s = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_q = tl.load(p_q + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_kt = tl.load(p_k + o_k[:, None], mask=m_k[:, None] & m_t[None, :], other=0.0)
        b_h = tl.load(p_h + o_k[:, None] * V, mask=(o_k < k_h)[:, None] & m_v[None, :], other=0.0)
        b_o = _dot(b_q, b_h, b_o, DOT_PREC, INTERP_BF16)
        b_s = _dot(b_q, b_kt, b_s, DOT_PREC, INTERP_BF16)

    # Row norms in a pass of their own, after the MMA loop (nothing of theirs stays live in
    # it): summing them inside the pipelined loop gave wrong sums on sm_90 at K = 128 (two K
    # tiles), though right in the interpreter.
    b_rq = _row_rnorm(p_q, m_t, K, BT, BK, USE_L2NORM)
    if LOAD_RNORM:
        b_rk = tl.load(k_rnorm + t0 * HV + i_h + o_i * HV, mask=m_t, other=0.0)
    else:
        b_rk = _row_rnorm(k + t0 * s_k + o_hk + o_i[:, None] * s_k, m_t, K, BT, BK, USE_L2NORM)
    b_g = tl.load(g_cum + t0 * HV + i_h + o_i * HV, mask=m_t, other=0.0)
    m_s = (o_i[:, None] >= o_i[None, :]) & m_t[:, None]
    # o's row scale (scale / ||q_i||) and k's column norms go into the scores before they are
    # rounded to v_new's dtype: the raw q k^T of a call with the norm on can leave fp16's range.
    b_scale = b_rq * scale
    b_s = tl.where(m_s, b_s * tl.exp2(b_g[:, None] - b_g[None, :]) * b_scale[:, None], 0.0)
    b_o = b_o * (tl.exp2(b_g) * b_scale)[:, None]
    if USE_L2NORM:
        b_s = b_s * b_rk[None, :]

    o_vo = (t0 * HV + i_h) * V
    p_vo = o_i[:, None] * (HV * V) + o_v[None, :]
    m_vo = m_t[:, None] & m_v[None, :]
    b_v = tl.load(v_new + o_vo + p_vo, mask=m_vo, other=0.0)
    b_o = _dot(_cast(b_s, v_new.dtype.element_ty, INTERP_BF16), b_v, b_o, DOT_PREC, INTERP_BF16)
    tl.store(o + o_vo + p_vo, _cast(b_o, o.dtype.element_ty, INTERP_BF16), mask=m_vo)


def output_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    g_cum: torch.Tensor,
    chunks: ChunkTable,
    *,
    scale: float,
    use_qk_l2norm: bool = False,
    k_rnorm: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The output of every token (into ``out``, contiguous ``[B, T, HV, V]`` in q's dtype,
    where the caller allocated it).

    Parameters
    ----------
    q, k : Tensor ``[B, T, H, K]``, bf16/fp16/fp32, in token rows (any token stride).
    v_new : Tensor ``[B, T, HV, V]``, q's dtype (from :func:`state_fwd`).
    h : Tensor ``[NS, HV, K, V]``, q's dtype: the state at each chunk's start, by chunk slot.
    g_cum : float32 Tensor ``[B, T, HV]``, chunk-local gate cumsum in log2 units.
    chunks : ChunkTable of the call.
    scale : float, the output scale.
    use_qk_l2norm : q and k rows are l2-normalized (eps 1e-6) before use.
    k_rnorm : float32 Tensor ``[B, T, HV]`` from :func:`wu_fwd`, or None to reduce k's rows here.
    config : LaunchConfig override (BK, BV, num_warps, num_stages); default from the table.

    Returns
    -------
    o : Tensor ``[B, T, HV, V]`` in q's dtype.
    """
    H, K = q.shape[-2], q.shape[-1]
    HV, V, BT = v_new.shape[-2], v_new.shape[-1], chunks.chunk_size
    o = torch.empty(v_new.shape, dtype=q.dtype, device=q.device) if out is None else out
    if q.shape[0] * q.shape[1] == 0 or HV == 0:
        return o
    capability, _ = device_facts(q.device)
    cfg = config or output_config(K, V, q.element_size(), capability)
    grid = (chunks.num_slots * HV, -(-V // cfg.BV))
    launch(_output_fwd_kernel, grid, cfg, **output_launch_args(
        cfg, q.dtype, q, k, v_new, h, g_cum, k_rnorm if k_rnorm is not None else g_cum, o, chunks.cu_seqlens,
        chunks.num_seqs, float(scale), token_stride("q", q), token_stride("k", k), H, HV, K, V, BT,
        use_qk_l2norm=use_qk_l2norm, load_rnorm=use_qk_l2norm and k_rnorm is not None))
    return o


def output_launch_args(cfg, dtype, q, k, v_new, h, g_cum, k_rnorm, o, cu_seqlens, num_seqs, scale, s_q, s_k,
                       H, HV, K, V, BT, *, use_qk_l2norm, load_rnorm) -> dict:
    """Every argument of one ``_output_fwd_kernel`` launch by name, ``k_rnorm`` already
    replaced by a stand-in where unused (what :func:`output_fwd` launches with;
    :mod:`.call_program` binds the same list)."""
    dot_prec, _ = dot_precisions(dtype)
    return dict(
        q=q, k=k, v_new=v_new, h=h, g_cum=g_cum, k_rnorm=k_rnorm, o=o, cu_seqlens=cu_seqlens, N=num_seqs,
        scale=scale, s_q=s_q, s_k=s_k, H=H, HV=HV, K=K, V=V, BT=BT, BK=cfg.BK, BV=cfg.BV,
        USE_L2NORM=use_qk_l2norm, LOAD_RNORM=load_rnorm, DOT_PREC=dot_prec, INTERP_BF16=interp_bf16_dots(dtype))
