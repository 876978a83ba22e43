"""Context parallelism, pass 1 on the matrix engine: the affine map of every segment on the
state, its loads on a TMA ring several chunks deep.

The same maps as :mod:`gdn_dispatch.backends.triton_generic.segment_map` (which documents
them, the segment slots and the split of M): per segment and value head, the chunk
recurrence takes a start state ``S`` ``[K, V]`` to ``M S + N``, where ``N`` is the walk from
zeros and each column of ``M`` ``[K, K]`` a walk from a column of the identity with ``u =
0``. One program owns one (segment slot, v-head, BC-wide block of the ``V + K`` columns)
and walks its segment's chunks::

    h     = S                                  (the data type, shared memory only)
    P     = w h
    v_new = u - P                               (u = 0 in M's columns)
    S     = 2^g_last S + k^T (2^(g_last - g) v_new)

Why a kernel of its own next to the plain-Triton one: that one's chain waits on each
chunk's loads, issued one chunk ahead by the software pipeliner (benchmarks/RESULTS.md,
"Pass 1's chunk step"). Here w and k arrive by TMA on a ring of ``NUM_BUF`` slots (chunk
t + NUM_BUF - 1 is issued at the top of chunk t) and u on a ring of its own; the gate rows
(and k's reciprocal row norms with the qk l2 norm, from :mod:`.qk_norm`) of chunk t + 1
are loaded during chunk t. On the H200 that took pass 1 from 62 to 54 µs at 2/4 and from
119 to 105 at 4/8; what is left of a step is the chain of two MMAs and their waits.
(``block_c=128`` on two warpgroups shares every tile between them; it ran slower.)

What a segment provably forgets is not walked. Every program first finds the segment's
shortest suffix of chunks whose map on the state is provably below
2^:data:`MAP_NEGLIGIBLE_LOG2` in norm, from the gates, beta and k's row norms
(:func:`_forgetting_start`). Where there is one, the state at the suffix's start reaches
the segment's end scaled by less than 2^-40, so it is dropped: M's programs store zeros,
and N's walk the suffix alone, from zeros. The maps then differ from the exact ones by
less than 2^-40 of that state's norm, far under the float32 rounding of the walks; under
the bench's gates (about -75 bits a chunk) the suffix is the last chunk. What the dropped
stretch holds does not reach the segment's end, non-finite values included (a NaN beta or
key inside the suffix fails the check, so the segment is walked whole).

N's programs come first in the launch order. On one H200, before N's walks were cut to
the suffix (``python benchmarks/segment_map_sweep.py --quick``,
benchmarks/logs/h200_pass1_launch_order.log), µs at 2/4, 4/8, 2/8 and 8/16:

* the bench's gates (every M zeros): N first 52.5 / 79.2 / 77.9 / 156.4; each head's
  blocks together (the order before) 54.8 / 105.2 / 104.6 / 207.0; M first 51.1 / 82.6 /
  82.1 / 156.6;
* the same with the qk l2 norm: 53.7 / 65.8 / 64.5 / 128.5; 54.2 / 96.3 / 95.2 / 191.5;
  53.3 / 70.0 / 69.0 / 134.4;
* every M walked: 61.3 / 111.5 / 111.9 / 221.3; 63.9 / 122.6 / 121.4 / 241.3; 61.7 /
  112.0 / 111.7 / 219.7.

Rows past a segment's end (a sequence's last chunk) hold the next sequence's tokens: their
decay is selected to 0 (:func:`.recurrence.state_vs`), so they contribute nothing.

Why each ring slot is free when it is refilled (no "empty" barriers): chunk t - 1's slot
is refilled at the top of chunk t; its readers, the two MMAs of chunk t - 1 (both waited
in chunk t - 1) and the register read of u (before the fence in front of chunk t - 1's
state update), all precede the TMA writes.

Phases: chunk t uses slot ``t % NUM_BUF``, whose ready barriers complete once per use
(chunk t waits ``(t // NUM_BUF) & 1``); each MMA barrier completes once per chunk (``t & 1``).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from gdn_dispatch.aot import AotKernel
from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem
from gdn_dispatch.device import SMEM_OPTIN, SMEM_RESERVED_PER_BLOCK, assumed_device, shared_memory_per_block

from gdn_dispatch.backends.gluon_common import engine as E
from gdn_dispatch.backends.gluon_common.compat import arg_names, thread_barrier, tma_load
from gdn_dispatch.backends.gluon_common.launch import launch_planned
from gdn_dispatch.backends.gluon_common.launch_plan import (
    MAX_STATE_TILE, NUM_WARPS, BoundLaunch, GridRule, LaunchPlan, as_device, pointer_attrs, resolve_engine, sig_dtype,
    tile_desc, token_stride)
from gdn_dispatch.backends.gluon_common.masks import add, tile_layout
from gdn_dispatch.backends.gluon_common.qk_norm import l2_flags
from gdn_dispatch.backends.gluon_common.recurrence import gate_decays, gate_rows, slot_sequence, state_vs
from gdn_dispatch.backends.gluon_common.state_output import (
    _aot_problem, state_output_warps, state_tile_per_warpgroup)
from gdn_dispatch.backends.gluon_common.state_output_steps import overwrite_acc
from gdn_dispatch.backends.triton_generic.segment_map import (
    MAP_NEGLIGIBLE_LOG2, checked_buffer, maps_buffers, maps_dtype)

#: Most slots of the w/k and u rings: a plan takes the most that fit one SM's shared
#: memory at the programs per SM of two slots (:func:`segment_map_ring_slots`).
RING_SLOTS_MAX = 4
#: Tokens the bound's check reads per step of its loop (beta).
BOUND_BLOCK = gl.constexpr(512)
#: Shared memory the compiler adds to a program's own tiles (layout-conversion scratch), bytes.
SMEM_SCRATCH = 1024


@gluon.jit
def _segment_bounds(cu_seqlens, N, L, slot):
    """``(bos, eos)`` of segment slot ``slot`` (int32): the rule of
    :func:`gdn_dispatch.backends.triton_generic.segment_map._segment_bounds`."""
    n, seq_bos, seq_eos = slot_sequence(cu_seqlens, N, L, slot)
    start = seq_bos + (slot - (seq_bos // L + n)) * L
    return gl.minimum(start, seq_eos), gl.minimum(start + L, seq_eos)


@gluon.jit
def _tf32_round(x):
    """fp32 ``x`` rounded to its 10 leading mantissa bits, as triton_generic's pass 1 rounds M_hi."""
    bits = x.to(gl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(gl.float32, bitcast=True)


@gluon.jit
def _bf16_round(x):
    """fp32 ``x`` rounded to nearest even at bf16's 7 mantissa bits, as an fp32 value."""
    bits = x.to(gl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(gl.float32, bitcast=True)


@gluon.jit
def _segment_map_load(w_desc, k_desc, u_desc, ring, u_smem, wk_ready, u_ready, buf, row, col_w, col_k, col_u,
                      pred, pred_u):
    """Issue one chunk's TMA loads into slot ``buf``: w and k [BT, K] into ``ring[2 buf ...]``
    on ``wk_ready[buf]``; u [BT, BC] into ``u_smem[buf]`` on ``u_ready[buf]`` where
    ``pred_u`` (a block of N's columns); nothing when not ``pred``."""
    mbarrier.expect(wk_ready.index(buf), 2 * w_desc.block_type.nbytes, pred=pred)
    tma_load(w_desc, [row, col_w], wk_ready.index(buf), ring.index(2 * buf), pred=pred)
    tma_load(k_desc, [row, col_k], wk_ready.index(buf), ring.index(2 * buf + 1), pred=pred)
    mbarrier.expect(u_ready.index(buf), u_desc.block_type.nbytes, pred=pred & pred_u)
    tma_load(u_desc, [row, col_u], u_ready.index(buf), u_smem.index(buf), pred=pred & pred_u)


@gluon.jit
def _k_rnorm_rows(rnorm, row, eos, i_hk, H, BT: gl.constexpr, row_layout: gl.constexpr):
    """One chunk's reciprocal row norms of k (:mod:`.qk_norm`'s ``[B * T, H, 2]`` pairs,
    k second), 0 past the segment's end."""
    rows = row + gl.arange(0, BT, layout=row_layout)
    return gl.load(rnorm + (rows.to(gl.int64) * H + i_hk) * 2 + 1, mask=rows < eos, other=0.0)


@gluon.jit
def _k_norms_max(k_desc, ring, pre_bars, row0, eos, NT, col_k, SLOTS: gl.constexpr):
    """The largest squared row norm of k over the rows ``row0 .. eos`` (``NT`` chunks; a NaN
    norm counts as infinite), the chunks streamed by TMA through the first ``SLOTS`` tiles of
    the idle ring (each refilled once every warp has read it)."""
    BT: gl.constexpr = k_desc.block_type.shape[0]
    K: gl.constexpr = k_desc.block_type.shape[1]
    layout: gl.constexpr = tile_layout(BT, K, gl.num_warps())
    for i in gl.static_range(SLOTS):
        mbarrier.expect(pre_bars.index(i), k_desc.block_type.nbytes, pred=i < NT)
        tma_load(k_desc, [row0 + i * BT, col_k], pre_bars.index(i), ring.index(i), pred=i < NT)
    # Each row position keeps its own maximum over the chunks; one reduction at the end.
    x_rows = gl.zeros([BT], gl.float32, gl.SliceLayout(1, layout))
    for t in range(NT):
        slot = t % SLOTS
        mbarrier.wait(pre_bars.index(slot), (t // SLOTS) & 1)
        kt = ring.index(slot).load(layout).to(gl.float32)
        rows = row0 + t * BT + gl.arange(0, BT, layout=gl.SliceLayout(1, layout))
        x = gl.sum(kt * kt, 1)
        # max drops a NaN operand: a NaN norm counts as infinite.
        x_rows = gl.maximum(x_rows, gl.where(rows < eos, gl.where(x == x, x, float("inf")), 0.0))
        # Every warp's reads of the slot precede its refill (async proxy).
        fence_async_shared()
        thread_barrier()
        more = t + SLOTS < NT
        mbarrier.expect(pre_bars.index(slot), k_desc.block_type.nbytes, pred=more)
        tma_load(k_desc, [row0 + (t + SLOTS) * BT, col_k], pre_bars.index(slot), ring.index(slot), pred=more)
    return gl.max(x_rows, 0)


@gluon.jit
def _gate_suffix(g_cum, bos, eos, NT, i_h, HV, BT: gl.constexpr, NEGLIGIBLE_LOG2: gl.constexpr):
    """The largest chunk ``c`` of the segment ``bos .. eos`` (``NT`` chunks) whose suffix of
    chunks ``c .. NT - 1`` sums its gates (log2 units) below ``NEGLIGIBLE_LOG2``, or -1. A
    chunk's sum is its last row of the chunk-local cumsum; the chunks are read in blocks of
    one per thread, the last block first, the later blocks' sum carried."""
    SUFFIX_BLOCK: gl.constexpr = 32 * gl.num_warps()
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    carry = gl.sum(gl.zeros([SUFFIX_BLOCK], gl.float32, layout), 0)
    c0 = (NT * 0 - 1).to(gl.int32)
    blocks = gl.cdiv(NT, SUFFIX_BLOCK)
    for i in range(blocks):
        c = (blocks - 1 - i) * SUFFIX_BLOCK + gl.arange(0, SUFFIX_BLOCK, layout=layout)
        live = c < NT
        last = bos + gl.minimum((c + 1) * BT, eos - bos) - 1
        g_c = gl.load(g_cum + last.to(gl.int64) * HV + i_h, mask=live, other=0.0)
        suffix = gl.associative_scan(g_c, 0, add, reverse=True) + carry
        c0 = gl.maximum(c0, gl.max(gl.where(live & (suffix < NEGLIGIBLE_LOG2), c, -1), 0))
        carry += gl.sum(g_c, 0)
    return c0


@gluon.jit
def _forgetting_start(g_cum, beta, s_beta, k_desc, ring, pre_bars, bos, eos, NT, i_h, col_k, HV,
                      USE_L2NORM: gl.constexpr, SLOTS: gl.constexpr, NEGLIGIBLE_LOG2: gl.constexpr):
    """The first chunk ``c0`` of the shortest suffix of the segment's chunks whose map on
    the state is provably below ``2^NEGLIGIBLE_LOG2`` in norm, or -1 where none is.

    A suffix's map is the product over its tokens of ``2^g_t (I - beta_t k_t k_t^T)`` (g in
    log2 units; k normalized with the qk l2 norm), and ``||I - b k k^T||_2 = max(1, |1 - b
    ||k||^2|)``: at most 1 when ``0 <= beta_t ||k_t||^2 <= 2``, and then the suffix's map
    is at most 2^(its gates' sum). The suffix is found from the gates alone
    (:func:`_gate_suffix`), then the condition checked over its tokens as ``min beta >= 0``
    and ``max beta * max ||k||^2 <= 2`` (``||k||^2 <= 1`` after the l2 norm; else k's rows
    of the suffix streamed through the idle ring). A NaN beta or key in the suffix fails
    the check.
    """
    BT: gl.constexpr = k_desc.block_type.shape[0]
    c0 = _gate_suffix(g_cum, bos, eos, NT, i_h, HV, BT, NEGLIGIBLE_LOG2)
    start = c0
    if c0 >= 0:
        row0 = bos + c0 * BT
        flat: gl.constexpr = gl.BlockedLayout([BOUND_BLOCK // (32 * gl.num_warps())], [32], [gl.num_warps()], [0])
        b_min = gl.sum(gl.zeros([BOUND_BLOCK], gl.float32, flat), 0)
        b_max = b_min
        for r in range(row0, eos, BOUND_BLOCK):
            rows = r + gl.arange(0, BOUND_BLOCK, layout=flat)
            b = gl.load(beta + rows.to(gl.int64) * s_beta + i_h, mask=rows < eos, other=0.0).to(gl.float32)
            # min and max drop a NaN operand: a NaN beta counts as negative.
            b = gl.where(b == b, b, -1.0)
            b_min = gl.minimum(b_min, gl.min(b, 0))
            b_max = gl.maximum(b_max, gl.max(b, 0))
        if USE_L2NORM:
            x_max = b_min * 0.0 + 1.0
        else:
            x_max = _k_norms_max(k_desc, ring, pre_bars, row0, eos, NT - c0, col_k, SLOTS)
        start = gl.where((b_min >= 0.0) & (b_max * x_max <= 2.0), c0, -1)
    return start


@gluon.jit
def _store_map(s, k_idx, c_idx, is_m, i_sh, m_hi, m_lo, n_out, K: gl.constexpr, V: gl.constexpr):
    """The walked block ``s`` (entry at state row ``k_idx``, column ``c_idx``, both
    broadcast to its shape) into M (split) or N of slot-head ``i_sh``."""
    if is_m:
        at = i_sh.to(gl.int64) * (K * K) + k_idx * K + c_idx
        if m_hi.dtype.element_ty == gl.bfloat16:
            s_hi = _bf16_round(s)
        else:
            s_hi = _tf32_round(s)
        gl.store(m_hi + at, s_hi.to(m_hi.dtype.element_ty))
        gl.store(m_lo + at, (s - s_hi).to(gl.bfloat16))
    else:
        gl.store(n_out + i_sh.to(gl.int64) * (K * V) + k_idx * V + c_idx, s)


@gluon.jit
def _segment_map_walk(S, P, w_desc, k_desc, u_desc, ring, u_smem, h_smem, vs_smem, wk_ready, u_ready, p_bar, s_bar,
                      g_cum, rnorm, b_g, g_last, b_rk, row0, eos, NT, i_h, i_hk, HV, GROUP, col_w, col_k, col_u,
                      is_n, is_m, USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr, NUM_BUF: gl.constexpr):
    """The program's walk over its NT chunks from row ``row0`` (chunks 0 .. NUM_BUF - 2
    already loading, ``b_g`` / ``g_last`` / ``b_rk`` chunk 0's rows): per chunk ``P = w S``,
    ``v = u - P`` (``-P`` for M's columns), ``S = 2^g_last S + k^T vs``; returns S."""
    BT: gl.constexpr = w_desc.block_type.shape[0]
    BC: gl.constexpr = u_desc.block_type.shape[1]
    dtype: gl.constexpr = w_desc.dtype
    p_layout: gl.constexpr = ENGINE.acc_layout(BT, BC, gl.num_warps())
    tok_layout: gl.constexpr = gl.SliceLayout(1, p_layout)
    for t in range(NT):
        buf = t % NUM_BUF
        ready_phase = (t // NUM_BUF) & 1
        mma_phase = t & 1
        row = row0 + t * BT
        _segment_map_load(w_desc, k_desc, u_desc, ring, u_smem, wk_ready, u_ready, (t + NUM_BUF - 1) % NUM_BUF,
                          row + (NUM_BUF - 1) * BT, col_w, col_k, col_u, t + NUM_BUF - 1 < NT, is_n)
        w_tile = ring.index(2 * buf)
        k_tile = ring.index(2 * buf + 1)
        m_t, b_d, decay = gate_decays(b_g, g_last, row, eos, BT)
        if USE_L2NORM:
            b_d = b_d * b_rk
        # Chunk t + 1's gate rows (and k's norms): their global-load latency would otherwise
        # sit on the chain (past the last chunk they read row eos - 1).
        b_g, g_last = gate_rows(g_cum, row + BT, eos, i_h, HV, BT, tok_layout)
        if USE_L2NORM:
            b_rk = _k_rnorm_rows(rnorm, row + BT, eos, i_hk, HV // GROUP, BT, tok_layout)

        s_reg = ENGINE.acc_read(S)
        h_smem.store(s_reg.to(dtype))
        fence_async_shared()  # generic writes -> MMA reads (async proxy)
        mbarrier.wait(wk_ready.index(buf), ready_phase)
        p = ENGINE.mma(w_tile, h_smem, overwrite_acc(P, ENGINE), False, p_bar)
        # The decayed state becomes the accumulator of k^T vs (overlaps the MMA).
        S = ENGINE.acc_write(S, s_reg * decay)
        mbarrier.wait(u_ready.index(buf), ready_phase, pred=is_n)
        b_u = u_smem.index(buf).load(p_layout).to(gl.float32)
        p = ENGINE.mma_wait(p, p_bar, mma_phase)
        # M's blocks load no u: their slot holds whatever was there, selected away.
        b_v = gl.where(is_m, 0.0, b_u) - ENGINE.acc_read(p)
        vs_smem.store(state_vs(b_v, b_d, m_t, k_tile, False).to(dtype))
        # Orders the vs writes before the MMA reading them, and the register reads of u
        # before the TMA refill of this slot at the top of the next chunk.
        fence_async_shared()
        S = ENGINE.mma(k_tile.permute((1, 0)), vs_smem, S, True, s_bar)
        S = ENGINE.mma_wait(S, s_bar, mma_phase)
    return S


@gluon.jit(do_not_specialize=["N", "NSEG", "L", "HV", "GROUP", "s_beta"])
def _segment_map_fwd_kernel(
    k_desc, w_desc, u_desc, g_cum, rnorm, beta, cu_seqlens, seg_cu, m_hi, m_lo, n_out, f_start, chain_flags, N, NSEG,
    L, HV, GROUP, s_beta,
    V: gl.constexpr, USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr, NUM_BUF: gl.constexpr,
    NEGLIGIBLE_LOG2: gl.constexpr, CHAIN: gl.constexpr,
):
    BT: gl.constexpr = w_desc.block_type.shape[0]
    K: gl.constexpr = w_desc.block_type.shape[1]
    BC: gl.constexpr = u_desc.block_type.shape[1]
    dtype: gl.constexpr = w_desc.dtype
    NVB: gl.constexpr = V // BC
    NCB: gl.constexpr = NVB + K // BC
    s_layout: gl.constexpr = ENGINE.acc_layout(K, BC, gl.num_warps())
    p_layout: gl.constexpr = ENGINE.acc_layout(BT, BC, gl.num_warps())
    tok_layout: gl.constexpr = gl.SliceLayout(1, p_layout)

    # Axis 0: N's programs (segment slot, v-head, V block), then M's (segment slot, v-head, K
    # block), the column block fastest: the blocks of one head stream the same w and k rows
    # at the same time. N's walks come first in the launch order: they always walk, while an
    # M found negligible costs only its bound, so M's programs fill the SMs the walks leave.
    pid = gl.program_id(0)
    n_programs = NSEG * HV * NVB
    is_m = pid >= n_programs
    i_cb = gl.where(is_m, NVB + (pid - n_programs) % (NCB - NVB), pid % NVB)
    i_sh = gl.where(is_m, (pid - n_programs) // (NCB - NVB), pid // NVB)
    i_h = i_sh % HV
    slot = i_sh // HV
    bos, eos = _segment_bounds(cu_seqlens, N, L, slot)
    # The segment table for the launches after this one (the last slot's end is the token axis's).
    if (i_cb == 0) & (i_h == 0):
        gl.store(seg_cu + slot, bos.to(seg_cu.dtype.element_ty))
        if slot == NSEG - 1:
            gl.store(seg_cu + NSEG, eos.to(seg_cu.dtype.element_ty))
    is_n = i_cb < NVB
    c0 = gl.where(is_m, i_cb - NVB, i_cb) * BC
    i_hk = i_h // GROUP
    col_w = i_h * K
    col_k = i_hk * K
    col_u = i_h * V + c0

    ring = gl.allocate_shared_memory(dtype, [2 * NUM_BUF, BT, K], w_desc.layout)
    u_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BT, BC], u_desc.layout)
    h_smem = gl.allocate_shared_memory(dtype, [K, BC], E.smem_layout([K, BC], dtype))
    vs_smem = gl.allocate_shared_memory(dtype, [BT, BC], u_desc.layout)
    wk_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    u_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    mma_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_bar = mma_bars.index(0)
    s_bar = mma_bars.index(1)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(wk_ready.index(i), count=1)
        mbarrier.init(u_ready.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(mma_bars.index(i), count=1)
    pre_bars = gl.allocate_shared_memory(gl.int64, [2 * NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2 * NUM_BUF):
        mbarrier.init(pre_bars.index(i), count=1)

    # Both kinds of program first look for the segment's shortest suffix whose map on the
    # state is provably negligible (-1: none). Where there is one, what comes before it is
    # forgotten: M is stored as zeros without a walk, and N walked from zeros over the suffix
    # alone (an empty segment has none: its identity is walked, in no step).
    chunks = gl.cdiv(eos - bos, BT)
    f0 = _forgetting_start(g_cum, beta, s_beta, k_desc, ring, pre_bars, bos, eos, chunks, i_h, col_k, HV,
                           USE_L2NORM, 2 * NUM_BUF, NEGLIGIBLE_LOG2)
    forgets = f0 >= 0
    first = gl.where(is_n & forgets, f0, 0)
    if CHAIN:
        # N's programs only (the grid has no M); a segment that does not forget is not
        # walked: pass 2 hands its end state on. Block 0 of each (slot, v-head) publishes
        # the forgetting start and zeroes the hand-over count, program 0 the ticket.
        NT = gl.where(forgets, chunks - first, 0)
        if i_cb == 0:
            gl.store(f_start + i_sh, f0)
            gl.store(chain_flags + i_sh, 0)
            if pid == 0:
                gl.store(chain_flags + NSEG * HV, 0)
    else:
        NT = gl.where(is_m & forgets, 0, chunks - first)
    row0 = bos + first * BT

    # The start: M's columns of the identity, zeros for N's.
    k_idx = gl.expand_dims(gl.arange(0, K, layout=gl.SliceLayout(1, s_layout)), 1)
    c_idx = gl.expand_dims(c0 + gl.arange(0, BC, layout=gl.SliceLayout(0, s_layout)), 0)
    S = ENGINE.acc_write(ENGINE.acc_alloc(K, BC), gl.where((k_idx == c_idx) & is_m & (f0 < 0), 1.0, 0.0))
    P = ENGINE.acc_alloc(BT, BC)
    for i in gl.static_range(NUM_BUF - 1):
        _segment_map_load(w_desc, k_desc, u_desc, ring, u_smem, wk_ready, u_ready, i, row0 + i * BT, col_w, col_k,
                          col_u, i < NT, is_n)
    b_g, g_last = gate_rows(g_cum, row0, eos, i_h, HV, BT, tok_layout)
    if USE_L2NORM:
        b_rk = _k_rnorm_rows(rnorm, row0, eos, i_hk, HV // GROUP, BT, tok_layout)
    else:
        b_rk = b_g  # unused

    S = _segment_map_walk(S, P, w_desc, k_desc, u_desc, ring, u_smem, h_smem, vs_smem, wk_ready, u_ready, p_bar, s_bar,
                          g_cum, rnorm, b_g, g_last, b_rk, row0, eos, NT, i_h, i_hk, HV, GROUP, col_w, col_k, col_u,
                          is_n, is_m, USE_L2NORM, ENGINE, NUM_BUF)

    _store_map(gl.convert_layout(ENGINE.acc_read(S), s_layout), k_idx, c_idx, is_m, i_sh, m_hi, m_lo, n_out, K, V)
    for i in gl.static_range(NUM_BUF):
        mbarrier.invalidate(wk_ready.index(i))
        mbarrier.invalidate(u_ready.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(mma_bars.index(i))
    for i in gl.static_range(2 * NUM_BUF):
        mbarrier.invalidate(pre_bars.index(i))


# ----------------------------------------------------------------------------------------
# Host side: plan (dry run), launch, AOT list


def segment_map_smem_bytes(K: int, BC: int, elem: int, slots: int, BT: int = CHUNK_SIZE) -> int:
    """Shared memory of a program with ``slots`` ring slots: the w/k ring, the u ring, the h
    and vs tiles and the barriers (the compiler's scratch comes on top)."""
    return slots * (2 * BT * K + BT * BC) * elem + (K * BC + BT * BC) * elem + (4 * slots + 2) * 8


def _programs_by_smem(K: int, BC: int, elem: int, slots: int, smem_per_block: int) -> int:
    """Programs with ``slots`` ring slots whose shared memory one SM holds (0: not one)."""
    need = segment_map_smem_bytes(K, BC, elem, slots) + SMEM_SCRATCH + SMEM_RESERVED_PER_BLOCK
    return (smem_per_block + SMEM_RESERVED_PER_BLOCK) // need


def segment_map_ring_slots(K: int, BC: int, elem: int = 2, warps: int = NUM_WARPS, *,
                           smem_per_block: int = SMEM_OPTIN[(9, 0)]) -> int:
    """Ring slots of a program: the most, up to :data:`RING_SLOTS_MAX`, that fit
    ``smem_per_block`` with as many programs per SM as two slots allow (at most two
    one-warpgroup programs or one of two warpgroups, by registers)."""
    programs = max(1, min(_programs_by_smem(K, BC, elem, 2, smem_per_block), 2 * NUM_WARPS // warps))
    return next((slots for slots in range(RING_SLOTS_MAX, 2, -1)
                 if _programs_by_smem(K, BC, elem, slots, smem_per_block) >= programs), 2)


def segment_map_block(K: int, V: int) -> int:
    """BC: 64 columns (one warpgroup holds the state tile; two programs per SM at K = 128).
    On the H200 (``python benchmarks/segment_map_sweep.py``) that ran faster than 128
    columns on two warpgroups sharing every tile (one program per SM) at every
    tensor-parallel shard: 54.4 against 57.8 µs at 2/4, 105.3 against 112.5 at 4/8, 201.0
    against 213.6 at 8/16."""
    return 64


def segment_map_supported(K: int, V: int) -> bool:
    """Whether the kernel is built for head dims K and V (multiples of its 64-wide column
    block, the Gluon backends' 64 and 128)."""
    return K % 64 == 0 and V % 64 == 0


def plan_segment_map(problem: GDNProblem, device, *, block_c: int | None = None, num_warps: int | None = None,
                     slots: int | None = None, engine=None, chain: bool = False) -> LaunchPlan:
    """Launch plan of :func:`segment_map_fwd` for ``problem`` (a dry run: no GPU, no tensor
    read; the grid follows from the segment slot count at each launch).

    Parameters
    ----------
    problem : a validated call; K and V in {64, 128}, bf16/fp16.
    device : DeviceInfo, or a bare capability tuple (its representative part).
    block_c : BC override, 64 or 128 dividing K and V; default :func:`segment_map_block`.
    num_warps : 4 or 8 holding the [K, BC] state tile; default the least that hold it
        (:func:`.state_output.state_output_warps`).
    slots : ring slots override (2 or more); default :func:`segment_map_ring_slots`.
    engine : the launching backend's matrix engine; None: the one registry.toml admits.
    chain : pass 1 of chained segments (``CHAIN``): N's programs alone, which write the
        forgetting starts and zero the hand-over counts (:mod:`.segment_chain`).
    """
    info = as_device(device)
    engine = resolve_engine(info, engine)
    H, K, HV, V = problem.H, problem.K, problem.HV, problem.V
    elem = torch.finfo(problem.dtype).bits // 8
    BT = CHUNK_SIZE
    BC = block_c or segment_map_block(K, V)
    if BC not in (64, 128) or K % BC or V % BC:
        raise ValueError(f"block_c: expected 64 or 128 dividing K = {K} and V = {V}, got {BC}")
    warps = num_warps or state_output_warps(K, BC)
    if warps not in (NUM_WARPS, 2 * NUM_WARPS) or state_tile_per_warpgroup(K, BC, warps) > MAX_STATE_TILE:
        raise ValueError(f"num_warps: expected 4 or 8 holding the [{K}, {BC}] state tile, got {warps}")
    smem = shared_memory_per_block(info)
    slots = slots or segment_map_ring_slots(K, BC, elem, warps, smem_per_block=smem)
    if slots < 2 or _programs_by_smem(K, BC, elem, slots, smem) < 1:
        raise ValueError(f"slots: expected 2 or more that fit {smem} bytes of shared memory, got {slots}")
    NCB = V // BC if chain else (V + K) // BC
    return LaunchPlan(
        kernel="segment_map_fwd",
        # (segment slot, v-head, column block) programs: the slot count is the launch's num_seqs.
        grid_rule=GridRule(per_seq=1, times=HV * NCB),
        num_warps=warps,
        blocks={"BT": BT, "K": K, "BC": BC, "NCB": NCB, "smem_bytes": segment_map_smem_bytes(K, BC, elem, slots),
                "tmem_columns": K + BC if engine.is_sm100 else 0},
        constexprs={"V": V, "USE_L2NORM": problem.use_qk_l2norm, "ENGINE": engine, "NUM_BUF": slots,
                    "NEGLIGIBLE_LOG2": MAP_NEGLIGIBLE_LOG2, "CHAIN": chain},
        descriptors=(
            tile_desc("k_desc", "k", problem.dtype, H * K, (BT, K), token_rows=True),
            tile_desc("w_desc", "w", problem.dtype, HV * K, (BT, K)),
            tile_desc("u_desc", "u", problem.dtype, HV * V, (BT, BC)),
        ),
        scalars={"HV": HV, "GROUP": HV // H},
        notes=f"BC={BC}, {warps} warps, {slots} ring slots: NSEG x {HV} v-heads x {NCB} column blocks",
        maxnreg=255 if engine.is_sm100 else None,
    )


def segment_map_launch_args(launch: LaunchPlan | BoundLaunch, k, w, u, g_cum, rnorm, beta, cu_seqlens, seg_cu,
                            num_seqs, num_segments, seg_len, m_hi, m_lo, n_out, s_beta, f_start=None,
                            chain_flags=None) -> tuple[dict, dict]:
    """The descriptor tensors and runtime arguments of one ``_segment_map_fwd_kernel``
    launch (``rnorm``: a stand-in without the qk l2 norm; ``beta`` the call's, of token
    stride ``s_beta``; ``f_start`` and ``chain_flags`` for a ``CHAIN`` plan, else the
    segment table stands in)."""
    launch = launch.shared
    return {"k": k, "w": w, "u": u}, dict(
        g_cum=g_cum, rnorm=rnorm, beta=beta, cu_seqlens=cu_seqlens, seg_cu=seg_cu, m_hi=m_hi, m_lo=m_lo,
        n_out=n_out, f_start=seg_cu if f_start is None else f_start,
        chain_flags=seg_cu if chain_flags is None else chain_flags, N=num_seqs, NSEG=num_segments, L=seg_len,
        HV=launch.scalars["HV"], GROUP=launch.scalars["GROUP"], s_beta=s_beta)


def segment_map_fwd(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g_cum: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seg_len: int,
    launch: LaunchPlan | BoundLaunch,
    *,
    rnorm: torch.Tensor | None = None,
    chain: tuple[torch.Tensor, torch.Tensor] | None = None,
    out: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """The segment offsets, and the affine map ``S -> M S + N`` of every segment and value
    head, M split in two: what :func:`gdn_dispatch.backends.triton_generic.segment_map.segment_map_fwd`
    returns, from the same inputs, but for what a segment provably forgets (module
    docstring): where a suffix of its chunks maps the state below
    2^:data:`MAP_NEGLIGIBLE_LOG2` in norm, M is zeros and N the suffix's walk from zeros.

    Parameters
    ----------
    k : Tensor ``[B, T, H, K]``, bf16/fp16, in token rows the TMA unit reads in place.
    w, u : Tensors ``[B, T, HV, K]``, ``[B, T, HV, V]``, k's dtype, contiguous (from ``wy_fwd``).
    g_cum : float32 Tensor ``[B, T, HV]``, contiguous: chunk-local gate cumsum in log2 units.
    beta : Tensor ``[B, T, HV]``, the call's (any float dtype, token rows): read with the
        gates and k's row norms to bound the suffixes' maps.
    cu_seqlens : int32/int64 Tensor ``[N + 1]``, the call's sequence offsets (device).
    seg_len : int, ``L``, a multiple of the 64-token chunk.
    launch : the plan (:func:`plan_segment_map`).
    rnorm : with the plan's ``USE_L2NORM``, float32 ``[B * T, H, 2]`` from
        :func:`.qk_norm.qk_rnorm_fwd` (k's reciprocal row norms second); ignored without.
    chain : with a ``CHAIN`` plan, ``(f_start, chain_flags)``: int32, contiguous, at least
        ``NSEG * HV`` and ``NSEG * HV + 1`` entries: the forgetting starts and the zeroed
        hand-over counts and ticket of chained segments; no M is formed (M_hi and M_lo
        come back None) and only the segments that forget are walked.
    out : (seg_cu, M_hi, M_lo, N) allocated by the caller (M_hi and M_lo None with
        ``chain``), or None to allocate them here.

    Returns
    -------
    seg_cu : Tensor ``[NSEG + 1]`` of cu_seqlens's dtype, ``NSEG = B * T // L + N``.
    M_hi : Tensor ``[NSEG, HV, K, K]`` of :func:`maps_dtype`, M rounded to TF32 (or bf16);
        zeros where the segment forgets its start.
    M_lo : bfloat16 Tensor ``[NSEG, HV, K, K]``, ``M - M_hi``.
    N : float32 Tensor ``[NSEG, HV, K, V]``; where the segment forgets its start, the walk
        of the forgetting suffix alone.
    """
    B, T, H, K = k.shape
    num_seqs = cu_seqlens.shape[0] - 1
    launch = launch.shared
    if launch.constexprs["CHAIN"] != (chain is not None):
        raise ValueError("chain: a CHAIN plan needs (f_start, chain_flags), another plan none")
    NSEG, (seg_cu, m_hi, m_lo, n_out) = maps_buffers(k, u, cu_seqlens, seg_len, out, chain=chain is not None)
    if NSEG == 0:
        return seg_cu.zero_(), m_hi, m_lo, n_out
    f_start, flags = chain if chain is not None else (None, None)
    if chain is not None:
        HV = u.shape[2]
        checked_buffer("f_start", f_start, (torch.int32,), NSEG * HV, "NSEG x HV", k.device)
        checked_buffer("chain_flags", flags, (torch.int32,), NSEG * HV + 1, "NSEG x HV + 1", k.device)
    if launch.constexprs["USE_L2NORM"] and (rnorm is None or rnorm.shape != (B * T, H, 2)):
        raise ValueError(f"rnorm: a USE_L2NORM plan needs float32 [{B * T}, {H}, 2] (qk_rnorm_fwd), got "
                         f"{None if rnorm is None else tuple(rnorm.shape)}")
    tensors, args = segment_map_launch_args(launch, k, w, u, g_cum, rnorm if rnorm is not None else g_cum, beta,
                                            cu_seqlens, seg_cu, num_seqs, NSEG, seg_len,
                                            n_out if m_hi is None else m_hi, n_out if m_lo is None else m_lo, n_out,
                                            token_stride(beta), f_start, flags)
    launch_planned(_segment_map_fwd_kernel, launch, tensors, args, rows=B * T, num_seqs=NSEG)
    return seg_cu, m_hi, m_lo, n_out


_POINTERS = ("g_cum", "rnorm", "beta", "cu_seqlens", "seg_cu", "m_hi", "m_lo", "n_out", "f_start", "chain_flags")


def segment_map_aot_kernel(backend: str, launch: LaunchPlan | BoundLaunch, dtype: torch.dtype, tag: str,
                           cu_dtype: torch.dtype = torch.int32, beta_dtype: torch.dtype | None = None) -> AotKernel:
    """The AotKernel that compiles exactly what :func:`segment_map_fwd` launches for
    ``launch`` (cu_seqlens and the segment offsets of ``cu_dtype``; beta of ``beta_dtype``,
    default the data's)."""
    constexprs = dict(launch.constexprs)
    sig = {d.arg: d.signature for d in launch.descriptors}
    cu = "*" + sig_dtype(cu_dtype)
    chain = launch.constexprs["CHAIN"]
    sig.update(g_cum="*fp32", rnorm="*fp32", beta="*" + sig_dtype(beta_dtype or dtype), cu_seqlens=cu, seg_cu=cu,
               m_hi="*fp32" if chain else "*" + sig_dtype(maps_dtype(dtype)), m_lo="*fp32" if chain else "*bf16",
               n_out="*fp32", f_start="*i32" if chain else cu, chain_flags="*i32" if chain else cu, N="i32",
               NSEG="i32", L="i32", HV="i32", GROUP="i32", s_beta="i32")
    sig.update({name: "constexpr" for name in constexprs})
    signature = {name: sig[name] for name in arg_names(_segment_map_fwd_kernel)}
    return AotKernel(backend=backend, kernel="segment_map_fwd", specialization=tag, fn=_segment_map_fwd_kernel,
                     signature=signature, constexprs=constexprs, dialect="gluon", num_warps=launch.num_warps,
                     attrs=pointer_attrs(_segment_map_fwd_kernel, _POINTERS), maxnreg=launch.maxnreg)


def segment_map_kernels_for_aot(capability: tuple[int, int], backend: str, *, engine=None) -> list[AotKernel]:
    """Pass 1 at every specialization the forward can launch on ``capability``: every
    (K, V) in {64, 128}^2 x bf16/fp16 x qk l2 norm on/off (bf16 only: :func:`.qk_norm.l2_flags`) with int32 offsets, and int64
    offsets at K = V = 128 (the plan's configuration; the tail flag is no constexpr here)."""
    device = assumed_device(f"sm_{capability[0]}{capability[1]}")
    cases = [(K, V, dtype, l2, torch.int32) for K in (64, 128) for V in (64, 128)
             for dtype in (torch.bfloat16, torch.float16) for l2 in l2_flags(dtype)]
    cases += [(128, 128, torch.bfloat16, l2, torch.int64) for l2 in (False, True)]
    kernels = []
    for K, V, dtype, l2, cu_dtype in cases:
        launch = plan_segment_map(_aot_problem(K, V, dtype, True, False, True, True, l2), device, engine=engine)
        tag = (f"K{K}-V{V}-BC{launch.blocks['BC']}-w{launch.num_warps}-s{launch.constexprs['NUM_BUF']}-"
               f"{sig_dtype(dtype)}{'-l2' if l2 else ''}{'-cu64' if cu_dtype == torch.int64 else ''}")
        kernels.append(segment_map_aot_kernel(backend, launch, dtype, tag, cu_dtype))
    # Chained segments' pass 1 (N's blocks alone) at K = V = 128, with and without the norm.
    for l2 in (False, True):
        launch = plan_segment_map(_aot_problem(128, 128, torch.bfloat16, True, False, True, True, l2), device,
                                  engine=engine, chain=True)
        kernels.append(segment_map_aot_kernel(backend, launch, torch.bfloat16,
                                              f"K128-V128-bf16{'-l2' if l2 else ''}-chain"))
    # A float32 beta (the contract takes any float dtype for it).
    launch = plan_segment_map(_aot_problem(128, 128, torch.bfloat16, True, False, True, True, True), device,
                              engine=engine)
    kernels.append(segment_map_aot_kernel(backend, launch, torch.bfloat16, "K128-V128-bf16-l2-beta-fp32",
                                          beta_dtype=torch.float32))
    return kernels
