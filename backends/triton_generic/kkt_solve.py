"""Stage 2: the intra-chunk matrix A = strictly-lower(beta_i k_i.k_j 2^(g_i - g_j)) and its
unit-lower-triangular inverse T = (I + A)^-1, per chunk of 64 tokens and value head.

The inverse is built in registers, block-recursively:

    [[P, 0], [C, Q]]^-1 = [[P^-1, 0], [-Q^-1 C P^-1, Q^-1]]

64 -> two 32s -> four 16s; a 16 x 16 diagonal block the same way from its 4 x 4 blocks
``d``, whose inverse is the finite product (I - d)(I + d^2) (d^4 = 0): six small MMAs
instead of sixteen dependent row updates. Every intermediate is a block of T or of A, so
it stays as small as T. (The shorter (I - a)(I + a^2)(I + a^4)(I + a^8) on the 16 x 16
block builds powers with entries up to C(14, 7) = 3432 for strongly correlated keys, which
tf32 inputs turn into a 3e-2 relative error of T; see ``tests/test_numerics.py``.) All MMAs of the solve accumulate in fp32; their
inputs are fp32 at ``SOLVE_PREC`` ("tf32x3" for float32 calls, "tf32" for 16-bit calls,
whose A^-1 is rounded to 16 bits before use anyway; see :func:`dot_precisions`).

Quadrants are cut from and glued into register tiles with reshape/permute/split/join (the
compiler moves data through shared memory as needed); nothing goes to global memory. The
same tile function serves the standalone :func:`kkt_solve_fwd` (which stores T) and the
fused w/u kernel of stage 3 (which keeps T in registers).
"""

from __future__ import annotations

import torch
import triton.language as tl

from gdn_dispatch.varlen import ChunkTable

from gdn_dispatch.backends.triton_generic._jit import GATE_FLOOR, LOG2E, L2NORM_EPS, _cast, _dot, _slot_rows, interpreting, jit
from gdn_dispatch.backends.triton_generic.strides import token_stride
from gdn_dispatch.backends.triton_generic.configs import device_facts, intra_config, launch


#: log2(e) inside the kernels: the gate's sums are kept in log2 units (see :mod:`.cumsum`).
_LOG2E = tl.constexpr(LOG2E)


@jit
def _quadrants(x, M: tl.constexpr, N: tl.constexpr):
    """The four [M, N] blocks of a [2M, 2N] tile: top-left, top-right, bottom-left, bottom-right."""
    t = tl.permute(tl.reshape(x, [2, M, 2, N]), (1, 3, 0, 2))  # [M, N, row half, col half]
    c0, c1 = tl.split(t)
    x00, x10 = tl.split(c0)
    x01, x11 = tl.split(c1)
    return x00, x01, x10, x11


@jit
def _from_quadrants(x00, x01, x10, x11, M: tl.constexpr, N: tl.constexpr):
    """Inverse of :func:`_quadrants`: glue four [M, N] blocks into a [2M, 2N] tile."""
    t = tl.join(tl.join(x00, x10), tl.join(x01, x11))  # [M, N, row half, col half]
    return tl.reshape(tl.permute(t, (2, 0, 3, 1)), [2 * M, 2 * N])


@jit
def _inv_unit_lower16(a, PREC: tl.constexpr):
    """(I + a)^-1 for a strictly lower [16, 16] fp32 tile, from its 4 x 4 diagonal blocks
    ``d`` ((I + d)^-1 = (I - d)(I + d^2), as d^4 = 0) merged at 4 -> 8 -> 16 rows."""
    o_i = tl.arange(0, 16)
    i, j = o_i[:, None], o_i[None, :]
    eye = (i == j).to(tl.float32)
    # n4 / n8: a's blocks just below x's 4 x 4 / 8 x 8 diagonal blocks inside each pair,
    # cut before the products so that a itself is not kept live through them.
    n4 = tl.where((i // 4 == j // 4 + 1) & (i // 8 == j // 8), a, 0.0)
    n8 = tl.where(i // 8 == j // 8 + 1, a, 0.0)
    d = tl.where(i // 4 == j // 4, a, 0.0)
    b_x = tl.dot(eye - d, eye + tl.dot(d, d, input_precision=PREC), input_precision=PREC)
    # x <- x - (x n) x at 4 -> 8 and 8 -> 16 rows.
    b_x = b_x - tl.dot(tl.dot(b_x, n4, input_precision=PREC), b_x, input_precision=PREC)
    b_x = b_x - tl.dot(tl.dot(b_x, n8, input_precision=PREC), b_x, input_precision=PREC)
    return b_x


@jit
def _inv_unit_lower32(a, PREC: tl.constexpr):
    """(I + a)^-1 for a strictly lower [32, 32] fp32 tile, from its 16 x 16 quadrants."""
    a00, a01, a10, a11 = _quadrants(a, 16, 16)
    x00 = _inv_unit_lower16(a00, PREC)
    x11 = _inv_unit_lower16(a11, PREC)
    x10 = -tl.dot(x11, tl.dot(a10, x00, input_precision=PREC), input_precision=PREC)
    return _from_quadrants(x00, tl.zeros_like(a01), x10, x11, 16, 16)


@jit
def _inv_unit_lower64(a, PREC: tl.constexpr):
    """(I + a)^-1 for a strictly lower [64, 64] fp32 tile, from its 32 x 32 quadrants."""
    a00, a01, a10, a11 = _quadrants(a, 32, 32)
    x00 = _inv_unit_lower32(a00, PREC)
    x11 = _inv_unit_lower32(a11, PREC)
    x10 = -tl.dot(x11, tl.dot(a10, x00, input_precision=PREC), input_precision=PREC)
    return _from_quadrants(x00, tl.zeros_like(a01), x10, x11, 32, 32)


@jit
def _kkt_solve_tile(k, g, g_cum, beta, s_k: tl.constexpr, s_g: tl.constexpr, s_b: tl.constexpr, t0, n_t, i_h,
                    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                    FORM_G_CUM: tl.constexpr, USE_L2NORM: tl.constexpr, DOT_PREC: tl.constexpr,
                    SOLVE_PREC: tl.constexpr, INTERP_BF16: tl.constexpr):
    """T = (I + A)^-1 of the chunk starting at token ``t0`` (``n_t`` valid rows) for v-head
    ``i_h``, as a [BT, BT] fp32 register tile.

    With FORM_G_CUM the chunk's gate cumsum (log2 units, as :func:`.cumsum.chunk_cumsum_fwd`
    forms it) is formed here from ``g`` (token stride ``s_g``) and stored into ``g_cum``
    for the later stages: one program per (chunk, v-head) covers every row once, and the
    call saves the cumsum's own launch. Without it the rows are read from ``g_cum``.

    Also returns what the w/u stage reuses: ``b_g`` (g_cum rows, 0 past ``n_t``), ``b_b``
    (beta rows, fp32) and ``b_r`` (k's l2-norm reciprocals, ones without USE_L2NORM); [BT]
    each.
    """
    o_i = tl.arange(0, BT)
    m_t = o_i < n_t
    if FORM_G_CUM:
        # Before the [BT, BT] product is live: the scan's temporaries would spill beside it.
        b_g = tl.load(g + t0 * s_g + i_h + o_i * s_g, mask=m_t, other=0.0).to(tl.float32)
        b_g = tl.where(m_t, tl.cumsum(tl.maximum(b_g, GATE_FLOOR), axis=0) * _LOG2E, 0.0)
        tl.store(g_cum + t0 * HV + i_h + o_i * HV, b_g, mask=m_t)
    else:
        b_g = tl.load(g_cum + t0 * HV + i_h + o_i * HV, mask=m_t, other=0.0)
    p_k = k + t0 * s_k + (i_h // (HV // H)) * K + o_i[:, None] * s_k
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    b_ss = tl.zeros([BT], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_k = tl.load(p_k + o_k[None, :], mask=m_t[:, None] & (o_k < K)[None, :], other=0.0)
        b_kk = _dot(b_k, tl.trans(b_k), b_kk, DOT_PREC, INTERP_BF16)
        if USE_L2NORM:
            b_kf = b_k.to(tl.float32)
            b_ss += tl.sum(b_kf * b_kf, axis=1)
    if USE_L2NORM:
        b_r = tl.rsqrt(b_ss + L2NORM_EPS)
    else:
        b_r = tl.full([BT], 1.0, dtype=tl.float32)
    b_b = tl.load(beta + t0 * s_b + i_h + o_i * s_b, mask=m_t, other=0.0).to(tl.float32)
    # where(), not a multiply by the mask: 2^(g_i - g_j) overflows above the diagonal.
    m_a = (o_i[:, None] > o_i[None, :]) & m_t[:, None]
    b_a = tl.where(m_a, b_kk * tl.exp2(b_g[:, None] - b_g[None, :]), 0.0)
    b_a = b_a * (b_b * b_r)[:, None] * b_r[None, :]
    return _inv_unit_lower64(b_a, SOLVE_PREC), b_g, b_b, b_r


@jit(do_not_specialize=("N",))
def _kkt_solve_fwd_kernel(
    k,
    g,
    g_cum,
    beta,
    A_inv,
    cu_seqlens,
    N,
    s_k: tl.constexpr,
    s_g: tl.constexpr,
    s_b: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    FORM_G_CUM: tl.constexpr,
    USE_L2NORM: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SOLVE_PREC: tl.constexpr,
    INTERP_BF16: tl.constexpr,
):
    # Grid axis 0 is (chunk slot, v-head) flattened, v-head fastest: v-heads sharing a k
    # head run side by side and read the same k rows.
    pid = tl.program_id(0).to(tl.int64)
    i_c, i_h = pid // HV, pid % HV
    t0, n_t = _slot_rows(cu_seqlens, i_c, N, BT)
    if n_t <= 0:  # an idle slot
        return
    b_x, b_g, b_b, b_r = _kkt_solve_tile(k, g, g_cum, beta, s_k, s_g, s_b, t0, n_t, i_h, H, HV, K, BT, BK,
                                         FORM_G_CUM, USE_L2NORM, DOT_PREC, SOLVE_PREC, INTERP_BF16)
    o_i = tl.arange(0, BT)
    p_a = A_inv + (t0 * HV + i_h) * BT + o_i[:, None] * (HV * BT) + o_i[None, :]
    tl.store(p_a, _cast(b_x, A_inv.dtype.element_ty, INTERP_BF16), mask=(o_i < n_t)[:, None])


def dot_precisions(dtype: torch.dtype) -> tuple[str, str]:
    """(DOT_PREC, SOLVE_PREC) for ``tl.dot`` on fp32 operands.

    float32 calls: "tf32x3" (three TF32 MMAs per product, about fp32 accuracy; plain tf32
    would miss the 1e-5 bound, and "ieee" lowers to FMA loops that spill). 16-bit calls:
    DOT_PREC does not apply (16-bit operands) and the solve runs at "tf32", below the
    16-bit rounding T gets before it is used. The interpreter computes every dot in fp32.
    """
    return ("tf32x3", "tf32x3") if dtype == torch.float32 else ("tf32", "tf32")


def interp_bf16_dots(dtype: torch.dtype) -> bool:
    """True under the interpreter with bfloat16 operands (see ``_jit._dot``)."""
    return dtype == torch.bfloat16 and interpreting()


def kkt_solve_fwd(
    k: torch.Tensor,
    g_cum: torch.Tensor,
    beta: torch.Tensor,
    chunks: ChunkTable,
    *,
    g: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Per chunk and value head, T = (I + A)^-1 with A = strictly-lower(beta_i k_i.k_j 2^(g_i - g_j)).

    Parameters
    ----------
    k : Tensor ``[B, T, H, K]``, bf16/fp16/fp32, in token rows. Value head ``j`` reads k head
        ``j // (HV // H)``.
    g_cum : float32 Tensor ``[B, T, HV]``, the chunk-local gate cumsum in log2 units
        (:func:`chunk_cumsum_fwd` with ``scale=log2(e)``); written here instead when ``g``
        is given.
    beta : Tensor ``[B, T, HV]``, any float dtype.
    chunks : ChunkTable of the call.
    g : Tensor ``[B, T, HV]`` (any float dtype, in token rows) or None: the per-token
        log-decay; given, the kernel forms the cumsum from it and stores it into ``g_cum``
        (what the forward does: no cumsum launch of its own).
    use_qk_l2norm : l2-normalize k rows (eps 1e-6, fp32) before forming A.
    out_dtype : dtype of the result, k's dtype (the default) or torch.float32.

    Returns
    -------
    A_inv : Tensor ``[B, T, HV, 64]``: row ``t`` holds row ``t - c0`` of its chunk's T, where
        ``c0`` is the chunk's first token (column ``j`` multiplies the chunk's token
        ``c0 + j``). Unit lower triangular per chunk; columns past a short last chunk's end
        are 0. Rows of no chunk do not exist (chunks tile every sequence).
    """
    if out_dtype is not None and out_dtype not in (k.dtype, torch.float32):
        raise ValueError(f"out_dtype: expected k's dtype {k.dtype} or torch.float32, got {out_dtype}")
    H, K = k.shape[-2], k.shape[-1]
    HV, BT = beta.shape[-1], chunks.chunk_size
    A_inv = torch.empty(*beta.shape, BT, dtype=out_dtype or k.dtype, device=k.device)
    if beta.shape[0] * beta.shape[1] == 0 or HV == 0:
        return A_inv
    capability, _ = device_facts(k.device)
    cfg = intra_config(K, K, k.element_size(), capability)
    launch(_kkt_solve_fwd_kernel, (chunks.num_slots * HV,), cfg, **kkt_solve_launch_args(
        cfg, k.dtype, k, g, g_cum, beta, A_inv, chunks.cu_seqlens, chunks.num_seqs, token_stride("k", k),
        None if g is None else token_stride("g", g), token_stride("beta", beta), H, HV, K, BT,
        use_qk_l2norm=use_qk_l2norm))
    return A_inv


def kkt_solve_launch_args(cfg, dtype, k, g, g_cum, beta, A_inv, cu_seqlens, num_seqs, s_k, s_g, s_b, H, HV, K, BT, *,
                          use_qk_l2norm) -> dict:
    """Every argument of one ``_kkt_solve_fwd_kernel`` launch by name (what
    :func:`kkt_solve_fwd` launches with; :mod:`.call_program` binds the same list). ``g``
    (token stride ``s_g``) given: the kernel forms the gate cumsum into ``g_cum``
    (:func:`_g_operands`)."""
    dot_prec, solve_prec = dot_precisions(dtype)
    g, s_g, form = _g_operands(g, g_cum, s_g, s_b)
    return dict(k=k, g=g, g_cum=g_cum, beta=beta, A_inv=A_inv, cu_seqlens=cu_seqlens, N=num_seqs, s_k=s_k, s_g=s_g,
                s_b=s_b, H=H, HV=HV, K=K, BT=BT, BK=cfg.BK, FORM_G_CUM=form, USE_L2NORM=use_qk_l2norm,
                DOT_PREC=dot_prec, SOLVE_PREC=solve_prec, INTERP_BF16=interp_bf16_dots(dtype))


def _g_operands(g, g_cum, s_g, s_b) -> tuple:
    """``(g, s_g, FORM_G_CUM)`` of a launch of a kernel on :func:`_kkt_solve_tile`: the gate
    and its token stride where the kernel forms the cumsum (``g`` given), else ``g_cum``
    and ``s_b`` as stand-ins it never reads (one specialization for every call without)."""
    return (g_cum, s_b, False) if g is None else (g, s_g, True)
