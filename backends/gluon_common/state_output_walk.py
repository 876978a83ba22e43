"""The state-output kernel's one-warpgroup walk (stages 4 and 5 fused on the matrix engine): the chunk-state recurrence and the output of
every chunk in one serial walk, so that neither the per-chunk state h nor v_new ever
reaches global memory.

Per (sequence, v-head, V-block of BV columns), with S the fp32 [K, BV] state at a chunk's
start and g the chunk-local gate cumsum in log2 units, one program walks its sequence's
chunks in order and per chunk of 64 rows computes::

    h_t   = S                                       (q's dtype, shared memory only)
    P     = w h_t        O = q h_t        QK = q k^T
    v_new = u - P                                   (q's dtype, shared memory only)
    S     = 2^g_last S + k^T (2^(g_last - g) v_new)
    A     = causal(QK 2^(g_i - g_j))
    o     = scale (2^g O + A v_new)                 (stored)

The serial chain is S -> h_t -> P -> v_new -> S; everything else (O, QK, A, A v_new, the
store of o) hangs off it and overlaps it. Issue order per chunk:

1. S -> registers -> ``h_smem`` (fenced); wait for w/k/q; issue ``P``, ``O``, ``QK``
   (three async MMAs, all reading ``h_smem`` or the ring); while they run, write
   ``2^g_last S`` back as the accumulator of the state update.
2. Wait for ``P`` only (``O`` and ``QK`` may still run); wait for u; ``v_new`` ->
   ``vn_smem``, the scaled rows ``vs`` -> ``vs_smem`` (fenced); issue ``S += k^T vs``.
3. Wait for ``O`` and ``QK`` (the state update may still run); ``A`` -> ``p_smem``;
   ``2^g O`` back into its accumulator (fenced); issue ``O += A v_new``.
4. Wait for everything; ``o = scale O (* 1/|q_i|)`` -> ``o_smem`` -> TMA store.

With ``DEFER_OUT`` (sm_90a, where the accumulators are registers; chosen by
:func:`state_output_defers`), step 4 of chunk t runs in chunk t + 1, right after its ``P``,
``O`` and ``QK`` were issued: A v_new of chunk t then runs under chunk t + 1's h_t store,
and the wait for it and o's store sit under chunk t + 1's MMAs instead of on the serial
chain. The gate rows of chunk t + 1 are loaded during chunk t (plain global loads whose
latency would otherwise sit on the chain; :func:`_gates_early` names the one exception).

Warps: one warpgroup, or two at BV = 128 (:func:`state_output_config`): the engine layouts
then split every [*, BV] tile's columns between the warpgroups, which share the w / k / q
ring, so one program does the work of two BV = 64 programs for one set of loads.

One exception, on sm_90a at K * BV = 8192 (K = 128, BV = 64) only (``_qk_late``): ``QK``
is issued in step 2, right after the state update, and step 3 waits for the state update
and then ``QK``. There the accumulators are registers, and the state (64 per thread)
with three [64, *] accumulators in flight while v_new is formed took all 255 registers
(ptxas spilled in one specialization); with QK late, every one compiles without spills.
The two orders run at about the same speed at that size on the H200, and BV = 64 runs
faster there than BV = 32 at several sequences of 32 v-heads (K = V = 128), so BV = 64 is
kept.

Where the data lives: S, P, O and QK are engine accumulators (TMEM on sm_100a: BV + BV +
BV + 64 columns at most; wgmma registers on sm_90a). w, k and q tiles share one ring
allocation ``[3 NUM_BUF, 64, K]`` (slot ``b`` holds w at ``3 b``, k at ``3 b + 1``, q at
``3 b + 2``) on one ready barrier per slot; u has its own ring and ready barriers (it is
needed later). Chunk t + NUM_BUF - 1's loads are issued at the top of chunk t (chunk t + 1's
with the two slots shipped).

Phase bookkeeping, written once: chunk ``t`` uses slot ``buf = t % NUM_BUF``; each ready
barrier of a slot completes once per use of the slot, so chunk t waits ``(t // NUM_BUF) &
1``. There is one barrier per MMA site (``p_bar``, ``o_bar``, ``qk_bar``, ``s_bar``,
``pv_bar``); each completes exactly once per chunk and is waited exactly once per chunk,
so chunk t waits ``t & 1``. On sm_100a a commit covers every earlier tcgen05 op, so e.g.
``qk_bar`` also implies ``P`` and ``O``; on sm_90a the waits are "at most PENDING wgmma
groups outstanding" (groups retire in issue order: P, O, QK, S, A v_new; or P, O, S, QK,
A v_new with QK late), which is what each ``ENGINE.mma_wait_until``'s PENDING counts.

Why each buffer is free when it is rewritten (no "empty" barriers):

* the ring slot of chunk t is refilled at the top of chunk t + 1 (with chunk t + NUM_BUF).
  Its readers in chunk t: the P, O, QK and state-update MMAs (all waited by the end of
  chunk t) and register reads (u for v_new), which all come before the
  ``fence_async_shared`` + CTA barrier in front of chunk t's last MMA (A v_new), so they
  precede the TMA writes (async proxy) in every thread.
* ``h_smem``: read by chunk t - 1's P and O MMAs, both waited in chunk t - 1.
* ``vn_smem``, ``vs_smem``, ``p_smem``: read by chunk t - 1's A v_new and state-update
  MMAs, waited at the end of chunk t - 1.
* ``o_smem``: read by chunk t - 1's TMA store; ``tma.store_wait(0)`` right before it is
  rewritten (the store had a whole chunk to run, so this rarely waits).
* The ring also stages the fp32 initial / final state tile (through :mod:`.state_io`'s
  ``state_in`` / ``state_out``): before chunk 0's loads (fence + CTA barrier after the
  staging reads) and after the last chunk (every load landed and was waited on, every MMA
  reading the ring finished).

Rows past a sequence's end (its last chunk only; the tiles hold the next sequence's rows
there): the state update selects those rows of ``vs`` to 0 (:func:`.recurrence.state_vs`); in ``A``
they are columns ``j > i`` of every valid row ``i``, selected to 0 by the causal mask; q
rows past the end only feed o rows that are never written (TMA scatter with row
0x7FFFFFFF on sm_100a, masked stores on sm_90a, see :mod:`.masks`).

Warp-specialized (``WS``, sm_90a, one warpgroup of state; :data:`STATE_OUTPUT_WS`): the
same walk with the serial chain (h_t, P, v_new, the state update) in one warpgroup and
everything hanging off it (QK, O, A v_new, o's store, the ring's refills) in another
(:mod:`.state_output_ws`), so that the chain no longer queues behind the output's MMAs in
one warpgroup's wgmma order.

Chained segments (``CHAIN``, :mod:`.segment_chain`): a program takes its (segment slot,
v-head, V-block) from a ticket instead of its program id, walks the slot's chunks of the
call's sequence, starts from the call's initial state (first slot) or the previous slot's
hand-over, and ends with the call's final state (last slot) or a hand-over of its own; the
walk between is the one above.

qk l2 norm: w arrives normalized from stage 3. The reciprocal row norms of q and k come
from :mod:`.qk_norm` (one launch before this one; reducing the tiles here sat on the
serial chain and was repeated by every V-block), loaded a chunk early with the gates. k's
``rk`` folds into the row scale of ``vs`` (``k_n^T vs = k^T (rk vs)``) and into the columns
of ``QK``; q's ``rq`` into the rows of o. q and k are never rewritten.

Budget (16-bit, K = 128, BV = 64, two ring slots): shared memory ring 96 KB + u ring 16 KB + h 16 KB +
v_new, vs, o 24 KB + A 8 KB = 160 KB: one program per SM (K = 128, BV = 32: 132 KB;
BV = 128: 216 KB; K = 64, BV = 64: 104 KB, two per SM). TMEM at most 3 BV + 64 = 448
columns on sm_100a. Registers on sm_90a: the state tile is K * BV / (32 warps) per
thread (64 at K * BV = 8192 on one warpgroup), each [64, N] accumulator N / warps; the
largest specializations take 255, none spills (deferring o there spilled 20 bytes, so
it is off at that size).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from gdn_dispatch.backends.gluon_common import engine as E
from gdn_dispatch.backends.gluon_common.launch_plan import MAX_STATE_TILE, NUM_WARPS
from gdn_dispatch.backends.gluon_common.recurrence import gate_decays, gate_rows
from gdn_dispatch.backends.gluon_common.segment_chain import chain_state_init, chain_state_out
from gdn_dispatch.backends.gluon_common.state_io import state_init, state_out
from gdn_dispatch.backends.gluon_common.state_output_steps import (
    norm_rows, overwrite_acc, state_output_epilogue, state_output_load, state_output_pv, state_output_update)


@gluon.constexpr_function
def state_tile_per_warpgroup(K, BV, warps):
    """fp32 values of the [K, BV] state tile each warpgroup holds (``warps`` in all): the
    register measure behind the warp count, the q k^T issue order and o's deferral
    (at most :data:`MAX_STATE_TILE`, 64 registers per thread). Callable from the host too."""
    return K * BV * NUM_WARPS // warps


@gluon.constexpr_function
def _qk_late(K, BV, IS_SM100, num_warps):
    """Issue q k^T after the state update instead of with w h_t and q h_t: on sm_90a at
    the largest state tile per thread only (64 registers: K * BV = 8192 over one
    warpgroup, 16384 over two), where the state and three [64, *] accumulators in flight
    during v_new took all 255 registers and spilled."""
    return (not IS_SM100) and state_tile_per_warpgroup(K, BV, num_warps) >= MAX_STATE_TILE


@gluon.constexpr_function
def _gates_early(QK_LATE, USE_L2NORM, HAS_TAILS, num_warps):
    """Load chunk t + 1's gate rows during chunk t; not at the largest state tile on one
    warpgroup with the l2 norm and varlen tails, where the rows held across the chunk took
    the last registers (triton 3.9 spilled there, 3.6 did not): those load them at the
    top of their own chunk."""
    return not (QK_LATE and USE_L2NORM and HAS_TAILS and num_warps == NUM_WARPS)


@gluon.jit
def state_output_walk(q_desc, k_desc, w_desc, u_desc, o_desc, o_rows_desc, o_ptr, g_cum, rnorm, h0, ht,
                      i_nh, i_h, i_v, bos, eos, NT, col_w, col_k, col_v, block, scale, HV, GROUP,
                      cu_seqlens, hand, f_start, chain_flags, L, slot, first,
                      V: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr, STATE_VK: gl.constexpr,
                      USE_L2NORM: gl.constexpr, HAS_TAILS: gl.constexpr, ENGINE: gl.constexpr,
                      DEFER_OUT: gl.constexpr, USE_POOL: gl.constexpr, INPLACE: gl.constexpr,
                      NUM_BUF: gl.constexpr, CHAIN: gl.constexpr):
    """One program's walk in one warpgroup (two at BV = 128), as the module docstring
    describes it: its sequence, v-head ``i_h`` and V-block ``i_v`` as
    :func:`.recurrence.walk_program` gives them, ``block`` its initial / final state block.
    With ``CHAIN`` the program is segment slot ``slot`` of the call's sequence
    (:func:`.segment_chain.chain_walk`; ``first``: the sequence's first slot), which starts
    from and ends with the hand-overs ``hand`` / ``f_start`` / ``chain_flags``; otherwise
    those four and ``cu_seqlens`` / ``L`` are not read."""
    BT: gl.constexpr = w_desc.block_type.shape[0]
    K: gl.constexpr = w_desc.block_type.shape[1]
    BV: gl.constexpr = u_desc.block_type.shape[1]
    dtype: gl.constexpr = w_desc.dtype
    p_layout: gl.constexpr = ENGINE.acc_layout(BT, BV, gl.num_warps())
    row_layout: gl.constexpr = gl.SliceLayout(1, p_layout)
    # Where q k^T is issued (see the module docstring): with the w h_t MMA (the design), or
    # after the state update on sm_90a at K * BV = 8192, where the accumulators are registers.
    QK_LATE: gl.constexpr = _qk_late(K, BV, ENGINE.IS_SM100, gl.num_warps())
    P_PENDING: gl.constexpr = 1 if QK_LATE else 2
    # With DEFER_OUT, chunk t's A v_new is waited and stored in chunk t + 1, after P, O
    # (and QK) of chunk t + 1 were issued: the wgmma groups outstanding then.
    TAIL_PENDING: gl.constexpr = 2 if QK_LATE else 3
    GATES_EARLY: gl.constexpr = _gates_early(QK_LATE, USE_L2NORM, HAS_TAILS, gl.num_warps())
    # The qk norm rows likewise, except where q k^T is issued late (the largest state tile
    # per warpgroup): held across the chunk there they spilled 8 bytes on two warpgroups
    # with tails; loaded at the top of their chunk, they are first read after P's wait.
    NORMS_EARLY: gl.constexpr = GATES_EARLY and not QK_LATE
    ring = gl.allocate_shared_memory(dtype, [3 * NUM_BUF, BT, K], w_desc.layout)
    u_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BT, BV], u_desc.layout)
    h_smem = gl.allocate_shared_memory(dtype, [K, BV], E.smem_layout([K, BV], dtype))
    vn_smem = gl.allocate_shared_memory(dtype, [BT, BV], u_desc.layout)
    vs_smem = gl.allocate_shared_memory(dtype, [BT, BV], u_desc.layout)
    p_smem = gl.allocate_shared_memory(dtype, [BT, BT], E.smem_layout([BT, BT], dtype))
    o_smem = gl.allocate_shared_memory(dtype, [BT, BV], o_desc.layout)
    wkq_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    u_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    # One barrier per MMA site: w h, q h, q k^T, k^T vs, A v_new.
    mma_bars = gl.allocate_shared_memory(gl.int64, [5, 1], mbarrier.MBarrierLayout())
    p_bar = mma_bars.index(0)
    o_bar = mma_bars.index(1)
    qk_bar = mma_bars.index(2)
    s_bar = mma_bars.index(3)
    pv_bar = mma_bars.index(4)
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(wkq_ready.index(i), count=1)
        mbarrier.init(u_ready.index(i), count=1)
    for i in gl.static_range(5):
        mbarrier.init(mma_bars.index(i), count=1)

    # Accumulator handles: P, O and QK are overwritten (use_acc=False) at their first MMA
    # of every chunk, so the handles stay loop-invariant (the results get other names).
    if CHAIN:
        S = chain_state_init(ENGINE.acc_alloc(K, BV), h0, hand, f_start, chain_flags, ring, block, slot, first, i_h,
                             i_v, HV, K, V, BV, STATE_VK, USE_H0, USE_POOL, ENGINE)
    else:
        S = state_init(ENGINE.acc_alloc(K, BV), h0, ring, block, i_v, K, V, BV, STATE_VK, USE_H0, USE_POOL, ENGINE)
    P = ENGINE.acc_alloc(BT, BV)
    O = ENGINE.acc_alloc(BT, BV)
    QK = ENGINE.acc_alloc(BT, BT)
    for i in gl.static_range(NUM_BUF - 1):
        state_output_load(w_desc, k_desc, q_desc, u_desc, ring, u_smem, wkq_ready, u_ready,
                          i, bos + i * BT, col_w, col_k, col_v, i < NT)
    b_g, g_last = gate_rows(g_cum, bos, eos, i_h, HV, BT, row_layout)
    i_hk = i_h // GROUP
    H = HV // GROUP
    if USE_L2NORM:
        b_rq, b_rk = norm_rows(rnorm, bos, eos, i_hk, H, BT, row_layout)
    else:
        b_rq, b_rk = b_g, b_g  # unused
    # DEFER_OUT: the previous chunk's A v_new accumulator and o row scale, stored one chunk late.
    o_prev = ENGINE.acc_in_flight(ENGINE.acc_alloc(BT, BV))
    r_prev = gl.full([BT], scale, gl.float32, layout=row_layout)

    for t in range(NT):
        buf = t % NUM_BUF
        ready_phase = (t // NUM_BUF) & 1
        mma_phase = t & 1
        row = bos + t * BT
        # Refill chunk t - 1's slot with chunk t + NUM_BUF - 1 (the module docstring says why
        # it is free).
        state_output_load(w_desc, k_desc, q_desc, u_desc, ring, u_smem, wkq_ready, u_ready,
                          (t + NUM_BUF - 1) % NUM_BUF, row + (NUM_BUF - 1) * BT, col_w, col_k, col_v,
                          t + NUM_BUF - 1 < NT)
        w_tile = ring.index(3 * buf)
        k_tile = ring.index(3 * buf + 1)
        q_tile = ring.index(3 * buf + 2)
        if not GATES_EARLY:
            b_g, g_last = gate_rows(g_cum, row, eos, i_h, HV, BT, row_layout)
        if USE_L2NORM and not NORMS_EARLY:
            b_rq, b_rk = norm_rows(rnorm, row, eos, i_hk, H, BT, row_layout)
        g_row = b_g
        rq = b_rq
        rk = b_rk
        m_t, b_d, decay = gate_decays(g_row, g_last, row, eos, BT)
        if GATES_EARLY:
            # Chunk t + 1's gate rows, loaded a chunk early: their global-load latency would
            # otherwise sit on the serial chain (past the last chunk they read row eos - 1).
            b_g, g_last = gate_rows(g_cum, row + BT, eos, i_h, HV, BT, row_layout)
        if USE_L2NORM and NORMS_EARLY:
            b_rq, b_rk = norm_rows(rnorm, row + BT, eos, i_hk, H, BT, row_layout)

        # h_t -> h_smem, the B operand of w h_t and q h_t; then P, O, QK on the engine.
        s_reg = ENGINE.acc_read(S)
        h_smem.store(s_reg.to(dtype))
        fence_async_shared()  # generic writes -> MMA reads (async proxy)
        mbarrier.wait(wkq_ready.index(buf), ready_phase)
        p = ENGINE.mma(w_tile, h_smem, overwrite_acc(P, ENGINE), False, p_bar)
        o = ENGINE.mma(q_tile, h_smem, overwrite_acc(O, ENGINE), False, o_bar)
        if not QK_LATE:
            qk = ENGINE.mma(q_tile, k_tile.permute((1, 0)), overwrite_acc(QK, ENGINE), False, qk_bar)
        # The decayed state becomes the accumulator of k^T vs (overlaps the MMAs).
        S = ENGINE.acc_write(S, s_reg * decay)
        if USE_L2NORM:
            # k's reciprocal row norms: the row scale of vs (and QK's column scale below).
            b_d = b_d * rk
        if DEFER_OUT:
            # Chunk t - 1's tail, under this chunk's MMAs: its A v_new (issued before them,
            # so long done) -> o. vn_smem and p_smem are free for this chunk after the wait.
            o_done = ENGINE.mma_wait_until(o_prev, pv_bar, mma_phase ^ 1, TAIL_PENDING)
            if t > 0:
                state_output_epilogue(ENGINE.acc_read(o_done), r_prev, o_smem, o_desc, o_rows_desc, o_ptr,
                                      HV * V, row - BT, col_v, eos - row + BT, HAS_TAILS, ENGINE)
        p = ENGINE.mma_wait_until(p, p_bar, mma_phase, P_PENDING)  # O (and QK) may still run

        S = state_output_update(S, p, u_smem.index(buf), u_ready.index(buf), ready_phase, k_tile, b_d, m_t,
                                vn_smem, vs_smem, s_bar, ENGINE)
        if QK_LATE:
            qk = ENGINE.mma(q_tile, k_tile.permute((1, 0)), overwrite_acc(QK, ENGINE), False, qk_bar)

        # o's row scale (times q's reciprocal row norms); A -> p_smem; O = 2^g O + A v_new.
        r_scale = gl.full([BT], scale, gl.float32, layout=row_layout)
        if USE_L2NORM:
            r_scale = r_scale * rq
        o = ENGINE.mma_wait_until(o, o_bar, mma_phase, 2)  # QK and S (either order) may run
        if QK_LATE:
            S = ENGINE.mma_wait_until(S, s_bar, mma_phase, 1)
            qk = ENGINE.mma_wait_until(qk, qk_bar, mma_phase, 0)
        else:
            qk = ENGINE.mma_wait_until(qk, qk_bar, mma_phase, 1)  # the state update may run
        o = state_output_pv(o, qk, g_row, rk, eos - row, p_smem, vn_smem, pv_bar, USE_L2NORM, ENGINE)
        if not QK_LATE:
            S = ENGINE.mma_wait_until(S, s_bar, mma_phase, 1)
        if DEFER_OUT:
            o_prev = o
            r_prev = r_scale
        else:
            o = ENGINE.mma_wait(o, pv_bar, mma_phase)
            state_output_epilogue(ENGINE.acc_read(o), r_scale, o_smem, o_desc, o_rows_desc, o_ptr,
                                  HV * V, row, col_v, eos - row, HAS_TAILS, ENGINE)

    if DEFER_OUT:
        if NT > 0:
            # The last chunk's tail.
            row = bos + (NT - 1) * BT
            o_done = ENGINE.mma_wait(o_prev, pv_bar, (NT - 1) & 1)
            state_output_epilogue(ENGINE.acc_read(o_done), r_prev, o_smem, o_desc, o_rows_desc, o_ptr,
                                  HV * V, row, col_v, eos - row, HAS_TAILS, ENGINE)

    # The ring is idle: every load landed and every MMA reading it was waited on.
    if CHAIN:
        # (the sequence from i_nh, which lives across the walk anyway)
        chain_state_out(ENGINE.acc_read(S), ht, i_nh, h0, block, hand, f_start, chain_flags, ring, cu_seqlens, L,
                        slot, i_nh // HV, slot * HV + i_nh % HV, i_v, K, V, BV, STATE_VK, STORE_HT, INPLACE)
    elif STORE_HT or INPLACE:
        state_out(ht, i_nh, h0, block, i_v, ENGINE.acc_read(S), ring, K, V, BV, STATE_VK, STORE_HT, INPLACE)
    tma.store_wait(0)  # shared memory must outlive the bulk stores reading it
    for i in gl.static_range(NUM_BUF):
        mbarrier.invalidate(wkq_ready.index(i))
        mbarrier.invalidate(u_ready.index(i))
    for i in gl.static_range(5):
        mbarrier.invalidate(mma_bars.index(i))
