"""The per-chunk pieces of the state recurrence that do not depend on the matrix engine:
which (sequence, v-head, V-block) a program walks, one chunk's gate rows and decays, and
the scaled ``v_new`` rows that update the state.

The warp-specialized kernels walk the sequences longest first (:func:`longest_first`, the
rule of :func:`gdn_dispatch.varlen.walk_order`).

With g the chunk-local gate cumsum in log2 units and S the fp32 ``[K, BV]`` state at a
chunk's start, a chunk of 64 rows updates ``S = 2^g_last S + k^T (2^(g_last - g) v_new)``.
Rows past a sequence's end (its last chunk only) hold the next sequence's tokens: their
decay is *selected* to 0, so they contribute exactly nothing to S.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from gdn_dispatch import varlen

from gdn_dispatch.backends.gluon_common.masks import row_rnorm, tile_layout


LONGEST_FIRST_SEQS = gl.constexpr(varlen.LONGEST_FIRST_SEQS)


@gluon.jit
def _add_i32(a, b):
    return a + b


@gluon.jit
def longest_first(cu_seqlens, N, p, BT: gl.constexpr):
    """The sequence at position ``p`` of the batch walked longest first
    (:func:`gdn_dispatch.varlen.walk_order`): by chunk count, most first, ties in batch
    order (``p`` itself when ``N`` is 1 or above ``LONGEST_FIRST_SEQS``).

    Every program finds its own entry: a bisection for the chunk count ``c`` at position
    ``p`` (the largest ``c`` that more than ``p`` sequences reach), then the rank of ``p``
    among the sequences of exactly ``c`` chunks, by a prefix count. About log2(longest
    chunk count) CTA-wide sums; no launch, no host copy of the lengths.
    """
    i_n = p
    if (N > 1) & (N <= LONGEST_FIRST_SEQS):
        flat: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        r = gl.arange(0, LONGEST_FIRST_SEQS, layout=flat)
        live = r < N
        bos = gl.load(cu_seqlens + r, mask=live, other=0).to(gl.int32)
        eos = gl.load(cu_seqlens + r + 1, mask=live, other=0).to(gl.int32)
        nt = gl.where(live, (eos - bos + BT - 1) // BT, -1)
        # Invariant: more than p sequences reach lo chunks, at most p reach hi.
        lo = 0
        hi = gl.max(nt, 0) + 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            reach = gl.sum(gl.where(nt >= mid, 1, 0), 0)
            lo = gl.where(reach > p, mid, lo)
            hi = gl.where(reach > p, hi, mid)
        tied = gl.where(nt == lo, 1, 0)
        q = p - gl.sum(gl.where(nt > lo, 1, 0), 0)
        rank = gl.associative_scan(tied, 0, _add_i32) - 1
        i_n = gl.sum(gl.where((tied == 1) & (rank == q), r, 0), 0)
    return i_n


@gluon.jit
def walk_program(cu_seqlens, HV, GROUP, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, BT: gl.constexpr,
                 LONGEST_FIRST: gl.constexpr):
    """This program's walk: (sequence ``i_n``, ``i_nh`` = i_n * HV + v-head, v-head ``i_h``,
    V-block ``i_v``), its sequence's rows ``bos .. eos`` and chunk count, and the tile
    columns of its w, k (q/k head ``i_h // GROUP``) and u / v blocks.

    Axis 0 is (sequence position, v-head, V-block) with the V-block fastest: the V-blocks of
    one head stream the same w and k tiles at the same time, so L2 serves all but the
    first. With ``LONGEST_FIRST`` sequence positions are the batch longest first
    (:func:`longest_first`; the warp-specialized kernels, one program per SM for a whole
    sequence), else batch order (the pipeline's state kernel, at the register limit, where
    the search made triton 3.9's ptxas spill); the grid is exactly N x HV x V-blocks.
    """
    pid = gl.program_id(0)
    i_v = pid % (V // BV)
    i_nh = pid // (V // BV)
    i_n = i_nh // HV
    i_h = i_nh % HV
    if LONGEST_FIRST:
        i_n = longest_first(cu_seqlens, gl.num_programs(0) // (HV * (V // BV)), i_n, BT)
        i_nh = i_n * HV + i_h
    # int32 or int64 offsets; rows are TMA coordinates, int32 (B * T < 2^31, host-checked).
    bos = gl.load(cu_seqlens + i_n).to(gl.int32)
    eos = gl.load(cu_seqlens + i_n + 1).to(gl.int32)
    NT = gl.cdiv(eos - bos, BT)
    return i_n, i_nh, i_h, i_v, bos, eos, NT, i_h * K, (i_h // GROUP) * K, i_h * V + i_v * BV


@gluon.jit
def slot_sequence(cu_seqlens, N, L, slot):
    """``(n, bos, eos)`` (int32): the sequence that owns segment slot ``slot`` and its token
    bounds, found by bisection over ``[0, N)`` (the rule of
    :func:`gdn_dispatch.backends.triton_generic.segment_map._slot_sequence`)."""
    lo = slot * 0
    hi = lo + N
    span = lo + 1
    while span < N:
        mid = (lo + hi) // 2
        below = gl.load(cu_seqlens + mid).to(gl.int32) // L + mid <= slot
        lo = gl.where(below, mid, lo)
        hi = gl.where(below, hi, mid)
        span *= 2
    seq_bos = gl.load(cu_seqlens + lo).to(gl.int32)
    seq_eos = gl.load(cu_seqlens + lo + 1).to(gl.int32)
    return lo, seq_bos, seq_eos


@gluon.jit
def gate_rows(g_cum, row, eos, i_h, HV, BT: gl.constexpr, row_layout: gl.constexpr):
    """One chunk's gate cumsum rows ``b_g`` (0 past the sequence's end; rows in
    ``row_layout``) and its last valid row's ``g_last``, as loaded from ``g_cum``. Both
    loads are plain global loads, so a caller may issue them a chunk early."""
    rows = row + gl.arange(0, BT, layout=row_layout)
    b_g = gl.load(g_cum + rows.to(gl.int64) * HV + i_h, mask=rows < eos, other=0.0)
    # Clamped at row 0: an empty first sequence (eos = 0) would read before g_cum.
    g_last = gl.load(g_cum + gl.maximum(gl.minimum(row + BT, eos) - 1, 0).to(gl.int64) * HV + i_h)
    return b_g, g_last


@gluon.jit
def gate_rows_of_cumsum(c, n_valid, c_smem=None):
    """:func:`gate_rows` of a chunk whose gate cumsum ``c`` (fp32 [BT], any 1-D layout; rows
    past the end repeat the last sum, as :func:`.wy.gate_cumsum` leaves them) a kernel
    formed itself: ``b_g`` (0 past the end, as loaded) and ``g_last``, the last valid row's.
    ``c_smem``: the same cumsum in shared memory (``[BT]``, stored past a barrier), whose
    last element is ``g_last`` (rows past the end repeat it): read there, not reduced
    across the warps."""
    BT: gl.constexpr = c.shape[0]
    layout: gl.constexpr = c.type.layout
    r = gl.arange(0, BT, layout=layout)
    if c_smem is not None:
        g_last = gl.max(c_smem.slice(BT - 1, 1).load(layout), axis=0)
    else:
        g_last = gl.sum(gl.where(r == gl.minimum(n_valid, BT) - 1, c, 0.0), 0)
    return gl.where(r < n_valid, c, 0.0), g_last


@gluon.jit
def store_gate_vectors(gate_ring, s, g_row, g_end, n_valid, rk=None, rq=None):
    """A warp-specialized kernel's three gate vectors of one chunk into gate-ring slot
    ``s`` (rows ``3 s .. 3 s + 2`` of the fp32 ``[6, BT]`` ring), from the chunk's
    :func:`gate_rows` (``g_row`` in any 1-D layout, ``g_end`` its ``g_last``): the state
    update's ``2^(g_last - g)`` (0 past the sequence's end, row ``n_valid`` on), the row
    decay ``2^g`` of the output, and the chunk decay ``2^g_last`` in every element.

    With the rows' reciprocal l2 norms of k and q (``rk``, ``rq``: the qk l2 norm folded
    into the kernel), four vectors into rows ``4 s .. 4 s + 3``: the update's and the row
    decay times ``rk``, the chunk decay, and the output's row decay ``2^g rq``."""
    BT: gl.constexpr = g_row.shape[0]
    layout: gl.constexpr = g_row.type.layout
    r = gl.arange(0, BT, layout=layout)
    update = gl.where(r < n_valid, gl.exp2(g_end - g_row), 0.0)
    decay = gl.exp2(g_row)
    chunk = gl.full([BT], 0.0, gl.float32, layout) + gl.exp2(g_end)
    if rk is None:
        gate_ring.index(3 * s).store(update)
        gate_ring.index(3 * s + 1).store(decay)
        gate_ring.index(3 * s + 2).store(chunk)
    else:
        rk = gl.convert_layout(rk, layout)
        gate_ring.index(4 * s).store(update * rk)
        gate_ring.index(4 * s + 1).store(decay * rk)
        gate_ring.index(4 * s + 2).store(chunk)
        gate_ring.index(4 * s + 3).store(decay * gl.convert_layout(rq, layout))


@gluon.jit
def gate_decays(b_g, g_last, row, eos, BT: gl.constexpr):
    """Row mask, per-row decay ``2^(g_last - g)`` (0 past the sequence's end) and the
    chunk decay ``2^g_last`` of one chunk from its :func:`gate_rows`."""
    rows = row + gl.arange(0, BT, layout=b_g.type.layout)
    m_t = rows < eos
    # where(), not a multiply by the mask: past the end b_g is 0 and 2^g_last may be tiny
    # or the row may hold anything; the row must contribute exactly nothing.
    b_d = gl.where(m_t, gl.exp2(g_last - b_g), 0.0)
    return m_t, b_d, gl.exp2(g_last)


@gluon.jit
def state_vs(v, b_d, m_t, k_tile, USE_L2NORM: gl.constexpr):
    """The B operand of the state update: ``r * 2^(g_last - g) * v_new`` per row, rows past
    the sequence's end selected to 0 (``r``: k's row-norm reciprocals with the l2 norm)."""
    if USE_L2NORM:
        BT: gl.constexpr = k_tile.shape[0]
        K: gl.constexpr = k_tile.shape[1]
        r = row_rnorm(k_tile, tile_layout(BT, K, gl.num_warps()))
        b_d = b_d * gl.convert_layout(r, b_d.type.layout)
    return gl.where(gl.expand_dims(m_t, 1), v * gl.expand_dims(b_d, 1), 0.0)
