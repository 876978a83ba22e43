"""The per-chunk steps of the state-output kernels (:mod:`.state_output`'s one-warpgroup walk
and :mod:`.state_output_ws`'s warp-specialized one): the chunk's loads, its gate and norm
rows, the state update from ``P = w h``, the causal scores and ``A v_new``, and the
store of o. Each is one step of the walk the module docstring of :mod:`.state_output`
describes; the callers decide the order and the waits between them.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from gdn_dispatch.backends.gluon_common.compat import tma_load
from gdn_dispatch.backends.gluon_common.masks import _causal_gate_scalar, store_chunk_tile
from gdn_dispatch.backends.gluon_common.recurrence import state_vs


@gluon.jit
def state_output_load(w_desc, k_desc, q_desc, u_desc, ring, u_smem, wkq_ready, u_ready,
                      buf, row, col_w, col_k, col_v, pred):
    """Issue the TMA loads of one chunk into slot ``buf``: w, k, q [BT, K] into
    ``ring[3 buf ...]`` on ``wkq_ready[buf]`` (needed together), u [BT, BV] into
    ``u_smem[buf]`` on ``u_ready[buf]`` (needed later); nothing when not ``pred``."""
    mbarrier.expect(wkq_ready.index(buf), 3 * w_desc.block_type.nbytes, pred=pred)
    tma_load(w_desc, [row, col_w], wkq_ready.index(buf), ring.index(3 * buf), pred=pred)
    tma_load(k_desc, [row, col_k], wkq_ready.index(buf), ring.index(3 * buf + 1), pred=pred)
    tma_load(q_desc, [row, col_k], wkq_ready.index(buf), ring.index(3 * buf + 2), pred=pred)
    mbarrier.expect(u_ready.index(buf), u_desc.block_type.nbytes, pred=pred)
    tma_load(u_desc, [row, col_v], u_ready.index(buf), u_smem.index(buf), pred=pred)



@gluon.jit
def norm_rows(rnorm, row, eos, i_hk, H, BT: gl.constexpr, row_layout: gl.constexpr):
    """One chunk's reciprocal row norms of q and of k (:mod:`.qk_norm`'s ``[B * T, H, 2]``
    pairs of q/k head ``i_hk``; 0 past the sequence's end, where no row is stored or enters
    the state), in ``row_layout``. Plain global loads: a caller may issue them a chunk early."""
    rows = row + gl.arange(0, BT, layout=row_layout)
    offs = (rows.to(gl.int64) * H + i_hk) * 2
    b_rq = gl.load(rnorm + offs, mask=rows < eos, other=0.0)
    b_rk = gl.load(rnorm + offs + 1, mask=rows < eos, other=0.0)
    return b_rq, b_rk


@gluon.jit
def overwrite_acc(acc, ENGINE: gl.constexpr):
    """The accumulator to hand an MMA with ``use_acc=False``: the same TMEM (sm_100a); fresh
    zeros on sm_90a, materialised at the MMA instead of kept live around the chunk loop."""
    if ENGINE.IS_SM100:
        out = acc
    else:
        out = ENGINE.acc_alloc(acc.shape[0], acc.shape[1])
    return out


@gluon.jit
def state_output_scores(qk, g_row, rk, n_valid, p_smem, USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr):
    """``A = causal(QK (* rk per column) 2^(g_i - g_j))`` -> ``p_smem`` (not fenced).

    The chunk's gates ``g_row`` and k's row norms ``rk`` come in (each is loaded or
    computed once per chunk and also used elsewhere); the mask is masks.causal_gate's
    bitmask test with the allowed count ``i + 1`` clamped to the
    chunk's valid rows (no change for any row that is stored): a mask built from aranges
    alone is loop-invariant, and the compiler hoists it out of the chunk loop and keeps
    its words live across it (about 36 registers per thread on sm_90a). Columns come from
    a layout conversion of the row values, not from 32 more global loads per thread.
    """
    s = ENGINE.acc_read(qk)
    BT: gl.constexpr = s.shape[0]
    layout: gl.constexpr = s.type.layout
    rows = gl.arange(0, BT, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BT, layout=gl.SliceLayout(0, layout))
    if USE_L2NORM:
        s = s * gl.expand_dims(gl.convert_layout(rk, gl.SliceLayout(0, layout)), 0)
    p = gl.map_elementwise(_causal_gate_scalar, s,
                           gl.expand_dims(gl.convert_layout(g_row, gl.SliceLayout(1, layout)), 1),
                           gl.expand_dims(gl.convert_layout(g_row, gl.SliceLayout(0, layout)), 0),
                           gl.expand_dims(gl.minimum(rows + 1, n_valid), 1),
                           gl.expand_dims(cols & ~15, 0), gl.expand_dims(cols & 15, 0))
    p_smem.store(p.to(p_smem.dtype))


@gluon.jit
def state_output_update(S, p, u_tile, u_bar, ready_phase, k_tile, b_d, m_t, vn_smem, vs_smem, s_bar,
                        ENGINE: gl.constexpr):
    """``v_new = u - P`` -> ``vn_smem``; its rows scaled by ``b_d`` (0 where not ``m_t``) ->
    ``vs_smem``; issue ``S += k^T vs``. Returns ``S`` (the MMA in flight)."""
    mbarrier.wait(u_bar, ready_phase)
    b_v = u_tile.load(ENGINE.acc_layout(u_tile.shape[0], u_tile.shape[1], gl.num_warps())).to(gl.float32)
    b_v = b_v - ENGINE.acc_read(p)
    vn_smem.store(b_v.to(vn_smem.dtype))
    vs_smem.store(state_vs(b_v, b_d, m_t, k_tile, False).to(vs_smem.dtype))
    # Orders vn/vs writes before the MMAs reading them, and the register reads of u and k
    # before the TMA refill of this slot at the top of the next chunk.
    fence_async_shared()
    return ENGINE.mma(k_tile.permute((1, 0)), vs_smem, S, True, s_bar)


@gluon.jit
def state_output_pv(o, qk, g_row, rk, n_valid, p_smem, vn_smem, pv_bar,
                    USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr):
    """``A`` -> ``p_smem`` (:func:`state_output_scores`); ``O = 2^g O``; issue
    ``O += A v_new``. Returns ``O`` (the MMA in flight)."""
    state_output_scores(qk, g_row, rk, n_valid, p_smem, USE_L2NORM, ENGINE)
    o = ENGINE.acc_write(o, ENGINE.acc_read(o) * gl.expand_dims(gl.exp2(g_row), 1))
    fence_async_shared()  # p_smem writes (and this slot's register reads) -> async proxy
    return ENGINE.mma(p_smem, vn_smem, o, True, pv_bar)


@gluon.jit
def state_output_epilogue(o, r_scale, o_smem, o_desc, o_rows_desc, o_ptr, row_stride,
                          row, col_v, n_valid, HAS_TAILS: gl.constexpr, ENGINE: gl.constexpr):
    """``o * r_scale`` per row -> ``o_smem`` -> the chunk's own rows of o."""
    # The previous chunk's store (or masked store) must have read o_smem.
    tma.store_wait(0)
    rows: gl.constexpr = gl.SliceLayout(1, o.type.layout)
    o_smem.store((o * gl.expand_dims(gl.convert_layout(r_scale, rows), 1)).to(o_smem.dtype))
    # The TMA store / scatter reads o_smem through the async proxy.
    fence_async_shared()
    store_chunk_tile(o_desc, o_rows_desc, o_ptr, row_stride, o_smem, row, col_v, n_valid, HAS_TAILS, ENGINE)
