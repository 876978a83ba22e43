"""The recurrence and the output in one warp-specialized launch on Hopper (sm_90a): the
chunk inverses, v_new, the causal scores and the gate vectors are formed on chip and never
leave the SM.

One launch per call (:data:`AUX_T`, the default)::

    o, S = fused_fwd(q, k, v, g, beta, S0)

the aux partition forming each chunk's T_u itself (:func:`_aux_inverse`, on the fp16
products of :mod:`..gluon_common.blocked_inverse`) and the state partition the causal
scores (:data:`STATE_SCORES`); or two, with :data:`AUX_T` off, the chunk inverses coming
from :mod:`..gluon_common.wy_t`::

    t_tiles, g_cum = wy_t_fwd(k, g, beta)              # T_u per (chunk, v-head)
    o, S           = fused_fwd(q, k, v, t_tiles, g_cum, S0)

One program per (sequence, v-head) walks its sequence's chunks of 64 rows, in two
partitions that share the program's shared memory through mbarrier rings:

* **aux** (one warpgroup), one chunk ahead of the state: with :data:`AUX_T` the chunk's
  T_u (k k^T, A, the blocked inverse) into a two-slot T ring, and the gate vectors and
  the rows of the state's causal scores (:data:`STATE_SCORES`); without it the causal
  scores ``q k^T 2^(g_i - g_j)`` [64, 64] and three gate vectors, into a two-slot ring.
* **state** (two warpgroups, the default partition): the serial chain. The state is held
  transposed, ``S^T`` [V, K] fp32 in registers (64 rows per warpgroup), so every product
  of the chain takes a register operand on the left and nothing of the chain goes through
  shared memory. ``u - w S`` regrouped as ``T_u (v - diag(2^g) k S)``, so that neither w
  nor u (nor T_w) is ever formed::

      P^T = S^T k^T                                         (bf16 S^T from registers)
      v_new^T = (v^T - P^T diag(2^g)) T_u^T
      S^T = 2^g_last S^T + (v_new^T 2^(g_last - g)) k       (rows past the end: 0)
      O^T = 2^g (S_old^T q^T) + v_new^T scores^T ;  o = scale (O^T)^T  (TMA store)

  It refills the k/q ring (two slots) with chunk t + 2 when it is done with chunk t, and
  the v (two) and, without :data:`AUX_T`, T (two) slots it alone reads (:func:`_state`
  with ``CHAIN``).
  ``S_old^T q^T`` is issued right behind P^T and the update beside ``v_new^T scores^T``
  (:data:`EARLY_O1`): with the update and ``S_old^T q^T`` together ptxas serializes every
  wgmma of the kernel for want of registers. Each k/q slot is one [128, K] tile, k's rows
  then q's, so that the two go out as one product ``S^T [k; q]^T`` (:data:`WIDE_KQ`).

With :data:`..gluon_common.wy_t.WY_T_SINGLE_TILE` off (T_w and T_u both written) the aux
partition forms ``w = T_w k`` [64, K] and ``u^T = (T_u v)^T`` [V, 64] too, into a w/u
ring, loading v (:data:`V_SLOTS` slots) and the T tiles itself, and the state takes ``P^T = S^T w^T``,
``v_new^T = u^T - P^T`` (:func:`_aux`): one product fewer on the chain, 80 KB more
shared memory.

Phases: chunk ``t`` uses k/q, T and w/u slot ``t % 2`` (ready phase ``(t // 2) & 1``;
``t % AUX_RING_SLOTS`` in the one-kernel build's k/q, T_u and gate rings,
:data:`AUX_RING_SLOTS`) and v slot ``t % V_SLOTS`` (phase ``(t // V_SLOTS) & 1``; T_u
alone: two slots).
"empty" barriers are waited with the opposite phase (a
fresh barrier's previous phase counts as complete), so the first use of a slot does not
wait. A partition of several warps joins its warps (a barrier within the partition)
before its one elected arrive or TMA issue, so every warp's reads and writes precede it.

Registers: 12 warps launch at 168 per thread; the aux warpgroup then asks for
:data:`AUX_REGS` and the state's two get the rest (192): the state tile is 64 per thread,
and w/u are formed in [64, 64] halves so that the aux accumulators stay at 32.

What this kernel does not do (the pipeline of :mod:`..gluon_common.forward` runs those
calls): context-parallel segments, K or V other than 64 and 128 (128 alone with
:data:`SMALL_HEADS` off), and the qk l2 norm when
:data:`QK_L2NORM` is turned off. With the norm it reads normalized copies of q and k
(:func:`..gluon_common.qk_norm.qk_l2norm_fwd`, one launch before the path's), as fla
does; with :data:`QK_NORM_ON_CHIP` it reads raw q and k and reduces their row norms in the
aux partition instead (``QK_NORM``). On sm_100a tcgen05 takes no register operand: the
twin, :mod:`..gluon_sm100.fused`, keeps ``S^T`` in tensor memory (compiled and checked
only, not routed).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from gdn_dispatch.aot import AotKernel
from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem

from gdn_dispatch.backends.gluon_common import engine as E
from gdn_dispatch.backends.gluon_common.blocked_inverse import (
    BLOCK, BLOCKS, fp16_products, inverse_layout, late_range_check_set, redo_buffer, redo_buffer_bytes,
    redo_from_buffer, squares_lost_half_range, table_layout)
from gdn_dispatch.backends.gluon_common.compat import thread_barrier, tma_load
from gdn_dispatch.backends.gluon_common.fused_aot import BASE_CASE, core_cases, fused_aot_kernels
from gdn_dispatch.backends.gluon_common.launch import launch_planned
from gdn_dispatch.backends.gluon_common.launch_plan import BoundLaunch, GridRule, LaunchPlan, tile_desc, token_stride
from gdn_dispatch.backends.gluon_common.masks import causal_gate, row_rnorm, store_chunk_tile, tile_layout
from gdn_dispatch.backends.gluon_common.pick import picked_elsewhere
from gdn_dispatch.backends.gluon_common.qk_norm import l2_flags
from gdn_dispatch.backends.gluon_common.recurrence import (
    gate_rows, gate_rows_of_cumsum, store_gate_vectors, walk_program)
from gdn_dispatch.backends.gluon_common.scopes import enter, leave
from gdn_dispatch.backends.gluon_common.state_io import state_block, state_in, state_out
from gdn_dispatch.backends.gluon_common.state_output import (
    fill_final_state_of_empty_call, state_buffers, state_constexprs)
from gdn_dispatch.backends.gluon_common.segment_chain import chain_last_slot
from gdn_dispatch.backends.gluon_common.warm_chain import chain_item, wait_hand_over, warm_chain_plan, warm_row
from gdn_dispatch.backends.gluon_common.wy import (
    ROW_VECTOR_SLOTS, chunk_rows_ahead, chunk_rows_early, chunk_t_u_on_chip, row_vector_slots, shared_row_vectors)
from gdn_dispatch.backends.gluon_common import wy_t as _wy_t
from gdn_dispatch.backends.gluon_common.wy_t import first_t_slot, t_tile_rows, t_tiles_per_chunk
from gdn_dispatch.backends.gluon_sm90.engine import lhs_reg_layout, wgmma_layout

#: Warps of the state partition (two warpgroups: 64 rows of S^T each, at V = 128; one at
#: V = 64, :func:`state_warps`) and of the aux one.
STATE_WARPS = 8
AUX_WARPS = gl.constexpr(4)
#: Registers per thread asked for the aux partition; the state partition gets the rest
#: of the register file (65536 / 12 warps = 168 at launch, then 120 aux / 192 state).
#: Measured on the H200 at 4 x 8192, HV 32 (fused kernel alone): aux 120 / state 192
#: 0.400 ms, 136 / 184 0.419, 152 / 176 0.431 (every one of them with its wgmma
#: serialized by ptxas: see :data:`EARLY_O1`).
AUX_REGS = gl.constexpr(120)
#: The aux partition's registers beside one state warpgroup (V = 64, :data:`SMALL_HEADS`):
#: the state's 256 leave it this many of the 512 per thread of two warpgroups (at 120 the
#: inverse of :data:`AUX_T` spilled 124-404 bytes there).
AUX_REGS_ONE_STATE_WARPGROUP = gl.constexpr(232)


@gluon.constexpr_function
def _aux_regs(V):
    """Registers of the aux partition beside the state of value head dim ``V``."""
    return AUX_REGS.value if V == HEAD_DIM else AUX_REGS_ONE_STATE_WARPGROUP.value


# ----------------------------------------------------------------------------------------
# Partitions


@gluon.constexpr_function
def _gates_per_slot(gate_ring_rows, ring_slots):
    """Gate vectors per scores slot: three (the update's ``2^(g_last - g)``, the row decay
    ``2^g``, the chunk decay), four with the qk l2 norm on chip (:data:`QK_NORM_ON_CHIP`:
    the update's and Z's vectors carry k's reciprocal row norms, the fourth is the output's
    ``2^g`` times q's)."""
    return gate_ring_rows // ring_slots


@gluon.constexpr_function
def _output_gate(gates):
    """The output's row-decay vector within a gate slot (:func:`_gates_per_slot`)."""
    return 3 if gates == 4 else 1


@gluon.jit
def _kq_tile(kq_ring, s, j: gl.constexpr):
    """Chunk slot ``s``'s k (``j`` 0) or q (``j`` 1) tile, [BT, K]: rows ``j * BT`` to
    ``(j + 1) * BT`` of the slot's [2 BT, K] tile, so that k and q together are one operand
    (:data:`WIDE_KQ`)."""
    BT: gl.constexpr = kq_ring.shape[1] // 2
    return kq_ring.index(s).slice(j * BT, BT)


@gluon.jit
def _load_kq(k_desc, q_desc, kq_ring, kq_ready, s, row, col_k):
    """TMA loads of one chunk's k and q tiles into k/q slot ``s``."""
    mbarrier.expect(kq_ready.index(s), 2 * k_desc.block_type.nbytes)
    tma_load(k_desc, [row, col_k], kq_ready.index(s), _kq_tile(kq_ring, s, 0))
    tma_load(q_desc, [row, col_k], kq_ready.index(s), _kq_tile(kq_ring, s, 1))


@gluon.jit
def _load_v(v_desc, v_ring, v_ready, s, row, col_v):
    """TMA load of one chunk's v tile into v slot ``s``."""
    mbarrier.expect(v_ready.index(s), v_desc.block_type.nbytes)
    tma_load(v_desc, [row, col_v], v_ready.index(s), v_ring.index(s))


@gluon.jit
def _load_t(t_desc, t_ring, t_ready, s, slot, HV, i_h):
    """TMA loads of chunk slot ``slot``'s T tiles (v-head ``i_h``) into T slot ``s``: T_w
    and T_u, or T_u alone where the ring holds one tile a slot (:data:`.wy_t.WY_T_SINGLE_TILE`)."""
    BT: gl.constexpr = t_desc.block_type.shape[0]
    TILES: gl.constexpr = t_ring.shape[0] // 2
    base = (slot * HV + i_h) * (TILES * BT)
    mbarrier.expect(t_ready.index(s), TILES * t_desc.block_type.nbytes)
    for i in gl.static_range(TILES):
        tma_load(t_desc, [base + i * BT, 0], t_ready.index(s), t_ring.index(TILES * s + i))


@gluon.jit
def _aux(v_desc, t_desc, kq_ring, v_ring, t_ring, w_ring, u_ring, s_ring, gate_ring,
         kq_ready, kq_empty, v_ready, t_ready, wu_ready, wu_empty,
         g_cum, HV, i_h, bos, eos, NT, slot0, col_v):
    BT: gl.constexpr = kq_ring.shape[1] // 2
    K: gl.constexpr = kq_ring.shape[2]
    BV: gl.constexpr = v_ring.shape[2]
    V_SLOTS: gl.constexpr = v_ring.shape[0]
    dtype: gl.constexpr = kq_ring.dtype
    acc_bt: gl.constexpr = wgmma_layout(BT, BT, gl.num_warps())
    cols: gl.constexpr = gl.SliceLayout(0, acc_bt)
    rows: gl.constexpr = gl.SliceLayout(1, acc_bt)
    # The gate rows in every warp (two per lane): their conversions stay within a warp.
    gate_layout: gl.constexpr = gl.BlockedLayout([2], [32], [gl.num_warps()], [0])
    b_g, g_last = gate_rows(g_cum, bos, eos, i_h, HV, BT, gate_layout)
    for t in range(NT):
        s = t % 2
        row = bos + t * BT
        n_valid = eos - row
        mbarrier.wait(kq_ready.index(s), (t // 2) & 1)
        k_tile = _kq_tile(kq_ring, s, 0)
        q_tile = _kq_tile(kq_ring, s, 1)
        qk = warpgroup_mma(q_tile, k_tile.permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc_bt),
                           use_acc=False, is_async=True)
        g_row = b_g
        g_end = g_last
        if t + 1 < NT:
            # The next chunk's T tiles (slot 1 - s: its last reader, chunk t - 1's u, was waited).
            _load_t(t_desc, t_ring, t_ready, 1 - s, slot0 + t + 1, HV, i_h)
        # The next chunk's gate rows, loaded while this one is formed.
        b_g, g_last = gate_rows(g_cum, row + BT, eos, i_h, HV, BT, gate_layout)
        # Slot s of the w/u ring is free once the state partition is done with chunk t - 2.
        mbarrier.wait(wu_empty.index(s), ((t // 2) & 1) ^ 1)
        # The gate vectors the state partition reads.
        store_gate_vectors(gate_ring, s, g_row, g_end, n_valid)
        qk = warpgroup_mma_wait(0, deps=(qk,))
        # Unscaled, as the pipeline rounds them (o's scale is applied in fp32 at the end).
        s_ring.index(s).store(causal_gate(qk, gl.convert_layout(g_row, rows), gl.convert_layout(g_row, cols)).to(dtype))
        # w and u^T in halves of 64 columns / rows: a [64, 64] accumulator is 32 registers.
        HALF: gl.constexpr = BT
        gl.static_assert(K == 2 * HALF and BV == 2 * HALF, "w and u are formed in two halves (K = V = 128)")
        acc_h: gl.constexpr = wgmma_layout(BT, HALF, gl.num_warps())
        mbarrier.wait(t_ready.index(s), (t // 2) & 1)
        tw = t_ring.index(2 * s)
        tu = t_ring.index(2 * s + 1)
        w0 = warpgroup_mma(tw, k_tile.slice(0, HALF, dim=1), gl.zeros([BT, HALF], gl.float32, acc_h),
                           use_acc=False, is_async=True)
        w1 = warpgroup_mma(tw, k_tile.slice(HALF, HALF, dim=1), gl.zeros([BT, HALF], gl.float32, acc_h),
                           use_acc=False, is_async=True)
        w0, w1 = warpgroup_mma_wait(0, deps=(w0, w1))
        w_ring.index(s).slice(0, HALF, dim=1).store(w0.to(dtype))
        w_ring.index(s).slice(HALF, HALF, dim=1).store(w1.to(dtype))
        # u^T = v^T T_u^T: the state reads it in its own accumulator orientation.
        v_slot = t % V_SLOTS
        mbarrier.wait(v_ready.index(v_slot), (t // V_SLOTS) & 1)
        v_smem = v_ring.index(v_slot)
        u0 = warpgroup_mma(v_smem.slice(0, HALF, dim=1).permute((1, 0)), tu.permute((1, 0)),
                           gl.zeros([HALF, BT], gl.float32, acc_h), use_acc=False, is_async=True)
        u1 = warpgroup_mma(v_smem.slice(HALF, HALF, dim=1).permute((1, 0)), tu.permute((1, 0)),
                           gl.zeros([HALF, BT], gl.float32, acc_h), use_acc=False, is_async=True)
        u0, u1 = warpgroup_mma_wait(0, deps=(u0, u1))
        u_ring.index(s).slice(0, HALF, dim=0).store(u0.to(dtype))
        u_ring.index(s).slice(HALF, HALF, dim=0).store(u1.to(dtype))
        fence_async_shared()
        # Every warp's reads of k, q, v and writes of the slot precede the releases and
        # the refill of v (v is only read here: its slots need no "empty" barrier).
        thread_barrier()
        if t + V_SLOTS < NT:
            _load_v(v_desc, v_ring, v_ready, v_slot, row + V_SLOTS * BT, col_v)
        mbarrier.arrive(kq_empty.index(s), count=1)
        mbarrier.arrive(wu_ready.index(s), count=1)


@gluon.jit
def _state(S, k_desc, q_desc, v_desc, t_desc, kq_ring, v_ring, t_ring, w_ring, u_ring, s_ring, gate_ring, o_smem,
           kq_ready, kq_empty, v_ready, t_ready, wu_ready, wu_empty, slot_free, o_desc, o_ptr, row_stride, scale, bos,
           eos, NT, col_k, col_v, HV, i_h, slot0, HAS_TAILS: gl.constexpr, ENGINE: gl.constexpr, CHAIN: gl.constexpr,
           LOADER: gl.constexpr, AUX_T: gl.constexpr = False, EARLY_O1: gl.constexpr = False, graw_ring=None,
           SCORES: gl.constexpr = False, store_from=0, WARM: gl.constexpr = False):
    """The serial chain (module docstring); returns the final S^T. With ``CHAIN`` (T_u
    alone) it forms v_new from T_u and refills the v and T slots it alone reads; ``w_ring``
    and ``u_ring`` are then unused. With ``LOADER`` (:data:`LOAD_WARP`) it refills nothing
    and releases each slot on ``slot_free`` instead. With ``AUX_T`` the aux partition
    writes the T slots (ready with the scores): it refills v alone. With ``EARLY_O1`` (and
    ``CHAIN``) the output's S_old^T q^T is issued with P^T (:data:`EARLY_O1`). With
    ``SCORES`` (:data:`STATE_SCORES`) it forms the chunk's causal scores itself into its
    scores slot, ``q k^T`` issued once those two products are done (with
    :data:`SCORES_BEHIND_V_NEW` behind v_new^T's product instead), gated with the rows the aux
    partition leaves in ``graw_ring``. With ``WARM`` (:mod:`..gluon_common.warm_chain`) the
    chunks before row ``store_from`` are walked for the state alone: their o is not stored."""
    BT: gl.constexpr = kq_ring.shape[1] // 2
    BV: gl.constexpr = o_smem.shape[1]
    dtype: gl.constexpr = kq_ring.dtype
    nw: gl.constexpr = gl.num_warps()
    acc_c: gl.constexpr = wgmma_layout(BV, BT, nw)     # P^T, O^T, u^T [V, 64]
    lhs_s: gl.constexpr = lhs_reg_layout(acc_c, 16)    # S^T as the left operand of P^T, O^T
    cols_c: gl.constexpr = gl.SliceLayout(0, acc_c)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [nw], [0])
    # Slots of the k/q, T and gate rings (:data:`AUX_RING_SLOTS`); v and scores keep two.
    RING: gl.constexpr = kq_ring.shape[0]
    NG: gl.constexpr = _gates_per_slot(gate_ring.shape[0], RING)
    # The early output product is an order of the T_u chain only.
    EARLY: gl.constexpr = CHAIN and EARLY_O1
    # The state's causal scores off the chain (:data:`SCORES_BEHIND_V_NEW`).
    LATE: gl.constexpr = EARLY and SCORES and SCORES_BEHIND_V_NEW
    gl.static_assert(RING == 2 or LATE, "three ring slots: the state's scores behind v_new^T alone")
    # P^T and S_old^T q^T as one product (:data:`WIDE_KQ`): split where v_new^T waits them.
    WIDE: gl.constexpr = LATE and WIDE_KQ
    # The whole walk, recorded once: its length against the phases' sum is what they miss.
    enter("state.walk")
    for t in range(NT):
        s = t % RING
        phase = (t // RING) & 1
        vs = t % 2
        v_phase = (t // 2) & 1
        row = bos + t * BT
        k_tile = _kq_tile(kq_ring, s, 0)
        q_tile = _kq_tile(kq_ring, s, 1)
        enter("state.operand")
        sb = gl.convert_layout(S.to(dtype), lhs_s)
        leave("state.operand")
        if CHAIN:
            p, o1 = _t_u_chain_products(sb, kq_ring, kq_ready, wu_ready, phase, s_ring,
                                        graw_ring, s, acc_c, EARLY, SCORES and not LATE, WIDE)
        else:
            mbarrier.wait(wu_ready.index(s), phase)
            # The chain: P^T alone, then the state update; O^T after, off the chain.
            p = warpgroup_mma(sb, w_ring.index(s).permute((1, 0)), gl.zeros([BV, BT], gl.float32, acc_c),
                              use_acc=False, is_async=True)
        enter("state.decay")
        decay = gl.max(gate_ring.index(NG * s + 2).slice(0, 1).load(one), axis=0)
        leave("state.decay")
        if not EARLY:
            b_d = gate_ring.index(NG * s).load(cols_c)
        if LATE:
            enter("state.v_new")
            vn, o1, qk = _v_new_then_scores(p, o1, v_ring.index(vs), v_ready.index(vs), t_ring.index(s),
                                            gate_ring.index(NG * s + 1), v_phase, acc_c, k_tile, q_tile, WIDE)
            leave("state.v_new")
        elif CHAIN:
            enter("state.v_new")
            vn = _v_new_of_t_u(p, v_ring.index(s), v_ready.index(s), t_ring.index(s), t_ready.index(s),
                               gate_ring.index(NG * s + 1), phase, acc_c, not AUX_T, EARLY)
            leave("state.v_new")
        else:
            u = u_ring.index(s).load(acc_c).to(gl.float32)
            p = warpgroup_mma_wait(0, deps=(p,))
            vn = u - p
        enter("state.update_output")
        if LATE:
            b_d = gate_ring.index(NG * s).load(cols_c)
            S, o = _update_then_scores(S, o1, vn, qk, b_d, decay, k_tile, s_ring.index(vs), eos - row,
                                       gate_ring.index(NG * s + _output_gate(NG)), graw_ring, s)
        elif EARLY:
            # Retired with v_new^T (groups retire in issue order): the wait only takes its value.
            o1 = warpgroup_mma_wait(0, deps=(o1,))
            # Read here, not held through v_new^T beside the products in flight.
            b_d = gate_ring.index(NG * s).load(cols_c)
            S, o = _update_and_output_of_o1(S, o1, vn, b_d, decay, k_tile, s_ring, gate_ring, s)
        else:
            S, o = _update_and_output(S, sb, vn, b_d, decay, k_tile, q_tile, s_ring, gate_ring, s, kq_ready,
                                      phase, not CHAIN)
        leave("state.update_output")
        enter("state.release")
        if CHAIN:
            # v was read by plain shared loads: ordered before its TMA refill below.
            fence_async_shared()
        # Every warp's MMAs reading the slots are complete (each waited its own).
        thread_barrier()
        mbarrier.arrive(wu_empty.index(s), count=1)
        leave("state.release")
        enter("state.refill")
        if LOADER:
            mbarrier.arrive(slot_free.index(s), count=1)
        elif RING > 2:
            _refill_ahead(k_desc, q_desc, v_desc, kq_ring, v_ring, kq_ready, kq_empty, v_ready, s, phase, vs, row, t,
                          NT, col_k, col_v)
        elif t + 2 < NT:
            _refill(k_desc, q_desc, v_desc, t_desc, kq_ring, v_ring, t_ring, kq_ready, kq_empty, v_ready, t_ready,
                    s, phase, row + 2 * BT, slot0 + t + 2, col_k, col_v, HV, i_h, CHAIN, AUX_T)
        leave("state.refill")
        enter("state.store")
        if WARM:
            if row >= store_from:
                _store_o(o, o_smem, scale, o_desc, o_ptr, row_stride, row, col_v, eos, HAS_TAILS, ENGINE)
        else:
            _store_o(o, o_smem, scale, o_desc, o_ptr, row_stride, row, col_v, eos, HAS_TAILS, ENGINE)
        leave("state.store")
    leave("state.walk")
    tma.store_wait(0)
    return (S,)


@gluon.jit
def _t_u_chain_products(sb, kq_ring, kq_ready, wu_ready, phase, s_ring, graw_ring, s, acc_c: gl.constexpr,
                        EARLY: gl.constexpr, SCORES: gl.constexpr, WIDE: gl.constexpr = False):
    """The T_u chain's products of one chunk, issued from S^T's operand ``sb`` once its k/q
    tiles of slot ``s`` landed: ``P^T = S^T k^T`` (the state's own product), with ``EARLY`` the output's
    ``S_old^T q^T`` behind it (else ``P^T`` again, unread); then the wait for the aux partition's slot and,
    with ``SCORES``, the chunk's causal scores into slot ``s`` of ``s_ring``. Returns the two products
    (in flight unless ``SCORES`` waited them); with ``WIDE`` (:data:`WIDE_KQ`) the two are one
    [BV, 2 BT] product of the slot's k and q rows, returned twice (in flight)."""
    BT: gl.constexpr = kq_ring.shape[1] // 2
    BV: gl.constexpr = sb.shape[0]
    acc_bt: gl.constexpr = wgmma_layout(BT, BT, gl.num_warps())
    k_tile = _kq_tile(kq_ring, s, 0)
    q_tile = _kq_tile(kq_ring, s, 1)
    enter("state.wait_tiles")
    mbarrier.wait(kq_ready.index(s), phase)
    leave("state.wait_tiles")
    enter("state.issue")
    if WIDE:
        # P^T and S_old^T q^T as one product (:data:`WIDE_KQ`), split where it is waited.
        acc_w: gl.constexpr = wgmma_layout(BV, 2 * BT, gl.num_warps())
        kq_slot = kq_ring.index(s)
        p = warpgroup_mma(gl.convert_layout(sb, lhs_reg_layout(acc_w, 16)), kq_slot.permute((1, 0)),
                          gl.zeros([BV, 2 * BT], gl.float32, acc_w), use_acc=False, is_async=True)
    else:
        p = warpgroup_mma(sb, k_tile.permute((1, 0)), gl.zeros([BV, BT], gl.float32, acc_c),
                          use_acc=False, is_async=True)
    if EARLY and not WIDE:
        # The output's S_old^T q^T behind it, from the same left operand.
        o1 = warpgroup_mma(sb, q_tile.permute((1, 0)), gl.zeros([BV, BT], gl.float32, acc_c),
                           use_acc=False, is_async=True)
    leave("state.issue")
    enter("state.wait_aux")
    mbarrier.wait(wu_ready.index(s), phase)
    leave("state.wait_aux")
    if SCORES:
        enter("state.scores")
        # q k^T once P^T and S_old^T q^T are done (in flight beside them and S^T's
        # bf16 operand, ptxas serialized every wgmma of the kernel).
        if EARLY:
            p, o1 = warpgroup_mma_wait(0, deps=(p, o1))
        else:
            p = warpgroup_mma_wait(0, deps=(p,))
        qk = warpgroup_mma(q_tile, k_tile.permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc_bt),
                           use_acc=False, is_async=True)
        _store_state_scores(qk, s_ring.index(s), graw_ring, s)
        leave("state.scores")
    if not EARLY or WIDE:
        # A jit function returns no None: the caller reads no early output product then
        # (or finds it in P^T's wide product).
        o1 = p
    return p, o1


@gluon.jit
def _refill(k_desc, q_desc, v_desc, t_desc, kq_ring, v_ring, t_ring, kq_ready, kq_empty, v_ready, t_ready, s, phase,
            row, t_slot, col_k, col_v, HV, i_h, CHAIN: gl.constexpr, AUX_T: gl.constexpr):
    """The state's refill of slot ``s`` with the chunk at ``row`` (two ahead): with ``CHAIN``
    its v and (unless ``AUX_T``) its T_u (``t_slot``), which the state alone reads; then
    k/q, once the aux partition is done with the slot (the state is its last reader)."""
    if CHAIN:
        _load_v(v_desc, v_ring, v_ready, s, row, col_v)
        if not AUX_T:
            _load_t(t_desc, t_ring, t_ready, s, t_slot, HV, i_h)
    mbarrier.wait(kq_empty.index(s), phase)
    _load_kq(k_desc, q_desc, kq_ring, kq_ready, s, row, col_k)


@gluon.jit
def _refill_ahead(k_desc, q_desc, v_desc, kq_ring, v_ring, kq_ready, kq_empty, v_ready, s, phase, vs, row, t, NT,
                  col_k, col_v):
    """:data:`AUX_RING_SLOTS` past two: the state's refills once it is done with chunk ``t``
    (at ``row``): its v slot ``vs`` with chunk t + 2 (v keeps two slots, the state its only
    reader), then k/q slot ``s`` with chunk t + RING, once the aux partition is done with it."""
    BT: gl.constexpr = kq_ring.shape[1] // 2
    RING: gl.constexpr = kq_ring.shape[0]
    if t + 2 < NT:
        _load_v(v_desc, v_ring, v_ready, vs, row + 2 * BT, col_v)
    if t + RING < NT:
        mbarrier.wait(kq_empty.index(s), phase)
        _load_kq(k_desc, q_desc, kq_ring, kq_ready, s, row + RING * BT, col_k)


@gluon.jit
def _v_new_of_t_u(p, v_slot, v_bar, t_slot, t_bar, e_g_slot, phase, acc_c: gl.constexpr, WAIT_T: gl.constexpr = True,
                  ONE_BEHIND: gl.constexpr = False):
    """``v_new^T = (v^T - P^T diag(2^g)) T_u^T`` ([V, 64], fp32 in ``acc_c``, P^T's layout)
    from the chain's ``P^T = S^T k^T`` (in flight; with ``ONE_BEHIND`` one more wgmma group
    was issued after it, waited for with it before v is read), the chunk's v and T_u slots
    (waited here, at ``phase``; T_u only with ``WAIT_T``, else the caller knows it written)
    and its row decays ``2^g``: ``u - w S`` regrouped, as T_u (v - 2^g k S)."""
    BT: gl.constexpr = v_slot.shape[0]
    BV: gl.constexpr = v_slot.shape[1]
    if ONE_BEHIND:
        # Both products done before v^T (and the decays) are loaded: their left operand's
        # registers (S^T in bf16) are held until then, and beside v^T they were more than
        # the state has.
        p = warpgroup_mma_wait(0, deps=(p,))
    z = _v_new_operand(p, v_slot, v_bar, e_g_slot, phase, acc_c, not ONE_BEHIND)
    if WAIT_T:
        mbarrier.wait(t_bar, phase)
    vn = warpgroup_mma(z, t_slot.permute((1, 0)), gl.zeros([BV, BT], gl.float32, acc_c), use_acc=False,
                       is_async=True)
    return warpgroup_mma_wait(0, deps=(vn,))


@gluon.jit
def _v_new_operand(p, v_slot, v_bar, e_g_slot, phase, acc_c: gl.constexpr, WAIT_P: gl.constexpr):
    """``v^T - P^T diag(2^g)`` as the left operand of v_new^T's product: the decays and v^T
    (its slot waited at ``phase``) read first, then P^T waited (with ``WAIT_P``; else the
    caller has it)."""
    e_g = e_g_slot.load(gl.SliceLayout(0, acc_c))
    mbarrier.wait(v_bar, phase)
    vt = v_slot.permute((1, 0)).load(acc_c).to(gl.float32)
    if WAIT_P:
        p = warpgroup_mma_wait(0, deps=(p,))
    return gl.convert_layout((vt - p * gl.expand_dims(e_g, 0)).to(v_slot.dtype), lhs_reg_layout(acc_c, 16))


@gluon.jit
def _v_new_then_scores(p, o1, v_slot, v_bar, t_slot, e_g_slot, phase, acc_c: gl.constexpr, k_tile, q_tile,
                       WIDE: gl.constexpr = False):
    """:data:`SCORES_BEHIND_V_NEW`: v_new^T as :func:`_v_new_of_t_u` forms it (T_u written by
    the aux partition), with the chunk's ``q k^T`` issued behind its product. Returns v_new^T
    (done), the output's ``O1^T = S_old^T q^T`` (done with P^T) and ``q k^T`` (in flight).
    With ``WIDE`` (:data:`WIDE_KQ`), ``p`` is the two products' [BV, 2 BT] product, split here."""
    BT: gl.constexpr = v_slot.shape[0]
    BV: gl.constexpr = v_slot.shape[1]
    acc_bt: gl.constexpr = wgmma_layout(BT, BT, gl.num_warps())
    p, o1 = _chain_products_done(p, o1, acc_c, WIDE)
    z = _v_new_operand(p, v_slot, v_bar, e_g_slot, phase, acc_c, False)
    vn = warpgroup_mma(z, t_slot.permute((1, 0)), gl.zeros([BV, BT], gl.float32, acc_c), use_acc=False,
                       is_async=True)
    qk = warpgroup_mma(q_tile, k_tile.permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc_bt),
                       use_acc=False, is_async=True)
    vn = warpgroup_mma_wait(1, deps=(vn,))
    return vn, o1, qk


@gluon.jit
def _chain_products_done(p, o1, acc_c: gl.constexpr, WIDE: gl.constexpr):
    """P^T and ``O1^T = S_old^T q^T`` waited for, each [V, 64] in ``acc_c``; with ``WIDE``
    (:data:`WIDE_KQ`) ``p`` is their one [V, 128] product and ``o1`` unused."""
    if WIDE:
        pq = warpgroup_mma_wait(0, deps=(p,))
        p, o1 = _column_halves(pq, acc_c)
    else:
        p, o1 = warpgroup_mma_wait(0, deps=(p, o1))
    return p, o1


@gluon.jit
def _column_halves(x, layout: gl.constexpr):
    """The two [M, N / 2] column halves of ``x`` ([M, N]), each in ``layout``."""
    M: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    a, b = gl.split(gl.permute(gl.reshape(x, [M, 2, N // 2]), (0, 2, 1)))
    return gl.convert_layout(a, layout), gl.convert_layout(b, layout)


@gluon.jit
def _update_and_output(S, sb, vn, b_d, decay, k_tile, q_tile, s_ring, gate_ring, s, kq_ready, phase,
                       WAIT_KQ: gl.constexpr):
    """The chain's state update ``S^T = 2^g_last S^T + (v_new^T 2^(g_last - g)) k`` and the
    chunk's ``O^T = 2^g (S_old^T q^T) + v_new^T scores^T`` (``sb``: S_old^T as the left
    operand; ``b_d``, ``decay``: the gate vectors read; with ``WAIT_KQ`` the k/q slot is
    waited for first). Returns the new S^T and O^T."""
    BT: gl.constexpr = k_tile.shape[0]
    BV: gl.constexpr = S.shape[0]
    dtype: gl.constexpr = k_tile.dtype
    acc_c: gl.constexpr = vn.type.layout
    vs = gl.convert_layout((vn * gl.expand_dims(b_d, 0)).to(dtype), lhs_reg_layout(S.type.layout, 16))
    if WAIT_KQ:
        mbarrier.wait(kq_ready.index(s), phase)
    S = warpgroup_mma(vs, k_tile, S * decay, use_acc=True, is_async=True)
    o = warpgroup_mma(sb, q_tile.permute((1, 0)), gl.zeros([BV, BT], gl.float32, acc_c),
                      use_acc=False, is_async=True)
    # wgmma groups retire in issue order: O^T is done when the state update is.
    S, o = warpgroup_mma_wait(0, deps=(S, o))
    NG: gl.constexpr = _gates_per_slot(gate_ring.shape[0], s_ring.shape[0])
    e_g = gate_ring.index(NG * s + _output_gate(NG)).load(gl.SliceLayout(0, acc_c))
    o = o * gl.expand_dims(e_g, 0)
    o = warpgroup_mma(gl.convert_layout(vn.to(dtype), lhs_reg_layout(acc_c, 16)), s_ring.index(s).permute((1, 0)), o,
                      use_acc=True, is_async=True)
    S, o = warpgroup_mma_wait(0, deps=(S, o))
    return S, o


@gluon.jit
def _update_and_output_of_o1(S, o1, vn, b_d, decay, k_tile, s_ring, gate_ring, s):
    """:data:`EARLY_O1`: the state update as :func:`_update_and_output` forms it, and the
    chunk's ``O^T = 2^g O1^T + v_new^T scores^T`` from ``O1^T = S_old^T q^T`` (done: issued
    with P^T), the two products in flight together. Returns the new S^T and O^T."""
    dtype: gl.constexpr = k_tile.dtype
    acc_c: gl.constexpr = vn.type.layout
    vs = gl.convert_layout((vn * gl.expand_dims(b_d, 0)).to(dtype), lhs_reg_layout(S.type.layout, 16))
    vnb = gl.convert_layout(vn.to(dtype), lhs_reg_layout(acc_c, 16))
    NG: gl.constexpr = _gates_per_slot(gate_ring.shape[0], s_ring.shape[0])
    e_g = gate_ring.index(NG * s + _output_gate(NG)).load(gl.SliceLayout(0, acc_c))
    S = warpgroup_mma(vs, k_tile, S * decay, use_acc=True, is_async=True)
    o = warpgroup_mma(vnb, s_ring.index(s).permute((1, 0)), o1 * gl.expand_dims(e_g, 0), use_acc=True,
                      is_async=True)
    S, o = warpgroup_mma_wait(0, deps=(S, o))
    return S, o


@gluon.jit
def _update_then_scores(S, o1, vn, qk, b_d, decay, k_tile, s_slot, n_valid, e_g_slot, graw_ring, s):
    """:data:`SCORES_BEHIND_V_NEW`: the state update issued first, then the chunk's causal
    scores stored into ``s_slot`` from ``q k^T`` (in flight before it; gated with slot ``s``
    of ``graw_ring``) while the update runs, then the output ``O^T = 2^g O1^T + v_new^T
    scores^T`` (the row decays ``2^g`` in ``e_g_slot``), as :func:`_update_and_output_of_o1`
    forms both. Returns the new S^T and O^T."""
    dtype: gl.constexpr = k_tile.dtype
    acc_c: gl.constexpr = vn.type.layout
    vs = gl.convert_layout((vn * gl.expand_dims(b_d, 0)).to(dtype), lhs_reg_layout(S.type.layout, 16))
    S = warpgroup_mma(vs, k_tile, S * decay, use_acc=True, is_async=True)
    vnb = gl.convert_layout(vn.to(dtype), lhs_reg_layout(acc_c, 16))
    # Every group but the update's: q k^T.
    enter("state.scores")
    qk = warpgroup_mma_wait(1, deps=(qk,))
    _gate_and_store_scores(qk, s_slot, graw_ring, s, n_valid)
    leave("state.scores")
    e_g = e_g_slot.load(gl.SliceLayout(0, acc_c))
    o = warpgroup_mma(vnb, s_slot.permute((1, 0)), o1 * gl.expand_dims(e_g, 0), use_acc=True, is_async=True)
    S, o = warpgroup_mma_wait(0, deps=(S, o))
    return S, o


@gluon.jit
def _store_o(o, o_smem, scale, o_desc, o_ptr, row_stride, row, col_v, eos, HAS_TAILS: gl.constexpr,
             ENGINE: gl.constexpr):
    """``o = scale (O^T)^T`` of the chunk at ``row`` through ``o_smem`` (TMA store, or the
    tail's rows alone)."""
    # The previous chunk's store must have read o_smem.
    tma.store_wait(0)
    o_smem.permute((1, 0)).store((o * scale).to(o_smem.dtype))
    fence_async_shared()
    store_chunk_tile(o_desc, o_desc, o_ptr, row_stride, o_smem, row, col_v, eos - row, HAS_TAILS, ENGINE)


@gluon.jit
def _aux_scores(kq_ring, s_ring, gate_ring, kq_ready, kq_empty, wu_ready, wu_empty, g_cum, HV, i_h, bos, eos, NT):
    """The aux work of every chunk when the state partition forms v_new from T_u itself
    (:data:`.wy_t.WY_T_SINGLE_TILE`): the causal scores and the gate vectors only, into
    rings of ``s_ring.shape[0]`` slots. With four gate vectors a slot
    (:data:`QK_NORM_ON_CHIP`) it reduces q's and k's row norms from their tiles too: the
    scores take both, the gate vectors k's and q's
    (:func:`..gluon_common.recurrence.store_gate_vectors`)."""
    BT: gl.constexpr = kq_ring.shape[1] // 2
    K: gl.constexpr = kq_ring.shape[2]
    RING_S: gl.constexpr = s_ring.shape[0]
    NG: gl.constexpr = _gates_per_slot(gate_ring.shape[0], RING_S)
    acc_bt: gl.constexpr = wgmma_layout(BT, BT, gl.num_warps())
    gate_layout: gl.constexpr = gl.BlockedLayout([2], [32], [gl.num_warps()], [0])
    half: gl.constexpr = tile_layout(BT, K // 2, gl.num_warps())
    b_g, g_last = gate_rows(g_cum, bos, eos, i_h, HV, BT, gate_layout)
    for t in range(NT):
        s = t % 2
        r = t % RING_S
        row = bos + t * BT
        enter("aux.wait_tiles")
        mbarrier.wait(kq_ready.index(s), (t // 2) & 1)
        leave("aux.wait_tiles")
        qk = warpgroup_mma(_kq_tile(kq_ring, s, 1), _kq_tile(kq_ring, s, 0).permute((1, 0)),
                           gl.zeros([BT, BT], gl.float32, acc_bt), use_acc=False, is_async=True)
        g_row = b_g
        g_end = g_last
        b_g, g_last = gate_rows(g_cum, row + BT, eos, i_h, HV, BT, gate_layout)
        if NG == 4:
            # While q k^T runs: the rows' reciprocal l2 norms, in column halves (registers).
            rq = row_rnorm(_kq_tile(kq_ring, s, 1), half, 2)
            rk = row_rnorm(_kq_tile(kq_ring, s, 0), half, 2)
        else:
            rq = g_row  # unused
            rk = g_row
        # Slot r of the scores and gate rings is free once the state is done with chunk
        # t - RING_S.
        enter("aux.wait_state")
        mbarrier.wait(wu_empty.index(r), ((t // RING_S) & 1) ^ 1)
        leave("aux.wait_state")
        enter("aux.scores")
        _store_scores_and_gates(qk, s_ring, gate_ring, r, g_row, g_end, eos - row, rq, rk, NG == 4)
        leave("aux.scores")
        mbarrier.arrive(kq_empty.index(s), count=1)
        mbarrier.arrive(wu_ready.index(r), count=1)


@gluon.jit
def _store_scores_and_gates(qk, s_ring, gate_ring, r, g_row, g_end, n_valid, rq, rk, NORMS: gl.constexpr):
    """A chunk's gate vectors (:func:`..gluon_common.recurrence.store_gate_vectors`) and
    causal scores ``q k^T 2^(g_i - g_j)`` into slot ``r`` of their rings, from ``q k^T``
    (fp32 [64, 64], still in flight: waited after the gate vectors) and the chunk's gate
    cumsum rows ``g_row`` (``g_end`` its last valid row's); with ``NORMS`` q's row and k's
    column reciprocal l2 norms ``rq``, ``rk`` scale the scores and the vectors. Fenced for
    the state's MMAs and joined over the partition's warps: the caller's arrives follow."""
    _store_gates(gate_ring, r, g_row, g_end, n_valid, rq, rk, NORMS)
    qk = warpgroup_mma_wait(0, deps=(qk,))
    acc_bt: gl.constexpr = qk.type.layout
    if NORMS:
        qk = qk * gl.expand_dims(gl.convert_layout(rq, gl.SliceLayout(1, acc_bt)), 1) \
            * gl.expand_dims(gl.convert_layout(rk, gl.SliceLayout(0, acc_bt)), 0)
    s_ring.index(r).store(causal_gate(qk, gl.convert_layout(g_row, gl.SliceLayout(1, acc_bt)),
                                      gl.convert_layout(g_row, gl.SliceLayout(0, acc_bt))).to(s_ring.dtype))
    fence_async_shared()
    thread_barrier()


@gluon.jit
def _store_gates(gate_ring, r, g_row, g_end, n_valid, rq, rk, NORMS: gl.constexpr):
    """The chunk's gate vectors into slot ``r`` (:func:`..gluon_common.recurrence.store_gate_vectors`),
    scaled by q's and k's reciprocal row norms ``rq``, ``rk`` with ``NORMS`` (else unread)."""
    if NORMS:
        store_gate_vectors(gate_ring, r, g_row, g_end, n_valid, rk, rq)
    else:
        store_gate_vectors(gate_ring, r, g_row, g_end, n_valid)


@gluon.jit
def _store_state_scores(qk, s_slot, graw_ring, r):
    """:data:`STATE_SCORES`: the causal scores ``q k^T 2^(g_i - g_j)`` into the state's
    scores slot ``s_slot`` from ``q k^T`` (in flight) and slot ``r``'s gate rows (the
    row and the column exponents, :func:`_store_gates_and_rows`); fenced for the output's
    wgmma and joined over the state's warps, each of which wrote a part of the slot."""
    _gate_and_store_scores(warpgroup_mma_wait(0, deps=(qk,)), s_slot, graw_ring, r)


@gluon.jit
def _gate_and_store_scores(qk, s_slot, graw_ring, r, n_valid=None):
    """:func:`_store_state_scores` from ``q k^T`` done; ``n_valid``: the chunk's valid rows
    (:func:`..gluon_common.masks.causal_gate`, with :data:`SCORES_MASK_IN_LOOP`), or None."""
    acc_bt: gl.constexpr = qk.type.layout
    g_i = graw_ring.index(2 * r).load(gl.SliceLayout(1, acc_bt))
    g_j = graw_ring.index(2 * r + 1).load(gl.SliceLayout(0, acc_bt))
    if SCORES_MASK_IN_LOOP:
        s_slot.store(causal_gate(qk, g_i, g_j, n_valid).to(s_slot.dtype))
    else:
        s_slot.store(causal_gate(qk, g_i, g_j).to(s_slot.dtype))
    fence_async_shared()
    thread_barrier()


@gluon.jit
def _store_gates_and_rows(gate_ring, graw_ring, r, g_row, g_end, n_valid, rq, rk, NORMS: gl.constexpr):
    """:data:`STATE_SCORES`: the chunk's gate vectors as :func:`_store_scores_and_gates`
    writes them, and, for the state's causal scores, the rows' exponent ``g_i`` and the
    columns' ``g_j`` into rows ``2 r``, ``2 r + 1`` of ``graw_ring``; with ``NORMS`` q's and
    k's reciprocal row norms go into the exponents (``g + log2 rq``, ``g - log2 rk``), so
    that the state's one exp2 per score scales it by both."""
    _store_gates(gate_ring, r, g_row, g_end, n_valid, rq, rk, NORMS)
    if NORMS:
        layout: gl.constexpr = g_row.type.layout
        graw_ring.index(2 * r).store(g_row + gl.log2(gl.convert_layout(rq, layout)))
        graw_ring.index(2 * r + 1).store(g_row - gl.log2(gl.convert_layout(rk, layout)))
    else:
        graw_ring.index(2 * r).store(g_row)
        graw_ring.index(2 * r + 1).store(g_row)
    # T_u (written before) is read by the state's wgmma.
    fence_async_shared()
    thread_barrier()


@gluon.jit
def _aux_inverse(kq_ring, t_ring, s_ring, gate_ring, tables, kq_ready, kq_empty, wu_ready, wu_empty, kk_bar,
                 g, s_g, beta, s_beta, HV, i_h, bos, eos, NT, ENGINE: gl.constexpr, graw_ring,
                 STATE_SCORES: gl.constexpr, a_save, SAVE_A: gl.constexpr, row_vectors, check_slot):
    """:data:`AUX_T`: the aux work of :func:`_aux_scores` plus the chunk inverse the T
    kernel would have sent (:func:`..gluon_common.wy.chunk_t_u_on_chip`: k k^T, the gate
    cumsum, A, the blocked inverse, beta's column scale), written as T_u into the T slot
    the state partition reads with the scores (``wu_ready``), so that the call is this one
    launch. The gate cumsum stays in registers: no ``g_cum`` is written or read. Per chunk:
    the raw gate and beta rows a chunk early; once the k / q tiles landed and the state is
    done with the chunk two back (whose T, scores and gate slots this one takes), T_u from
    the k tile straight into its slot, then q k^T, the gate vectors and the scores. With
    ``STATE_SCORES`` the state forms the scores: the aux leaves it the gate rows instead
    (:func:`_store_gates_and_rows`). With ``SAVE_A`` (the fp16 inverse), ``a_save`` is where
    A waits for its redo (:func:`..gluon_common.blocked_inverse.redo_buffer`). With
    :data:`..gluon_common.wy.SHARED_ROW_VECTORS`, ``row_vectors``
    (:func:`..gluon_common.wy.row_vector_slots`) hands the gate cumsum and beta between
    layouts. With :func:`late_range_check`, ``check_slot`` (fp32 [4]) takes the warps' sums
    of T's squares across the gate vectors' barrier."""
    BT: gl.constexpr = kq_ring.shape[1] // 2
    K: gl.constexpr = kq_ring.shape[2]
    # Slots of the k/q, T and gate rings (:data:`AUX_RING_SLOTS`).
    RING: gl.constexpr = t_ring.shape[0]
    # The qk l2 norm on chip: the gate ring has four rows a slot then.
    NORMS: gl.constexpr = _gates_per_slot(gate_ring.shape[0], RING) == 4
    dtype: gl.constexpr = kq_ring.dtype
    acc_bt: gl.constexpr = wgmma_layout(BT, BT, gl.num_warps())
    half: gl.constexpr = tile_layout(BT, K // 2, gl.num_warps())
    gl.static_assert(RING == s_ring.shape[0] or STATE_SCORES, "the aux's scores go to the T ring's slot")
    # Row vectors kept across the inverse: one register each.
    c_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    LATE_CHECK: gl.constexpr = late_range_check(SAVE_A, STATE_SCORES)
    rows = chunk_rows_early(g, s_g, beta, s_beta, bos, eos - bos, i_h, BT, True)
    enter("aux.walk")
    for t in range(NT):
        s = t % RING
        row = bos + t * BT
        n_valid = eos - row
        # The next chunk's raw rows, loaded under this chunk's inverse.
        g_raw, b_raw, rows = chunk_rows_ahead(rows, g, s_g, beta, s_beta, row, n_valid, i_h, BT)
        enter("aux.wait_tiles")
        mbarrier.wait(kq_ready.index(s), (t // RING) & 1)
        leave("aux.wait_tiles")
        k_tile = _kq_tile(kq_ring, s, 0)
        q_tile = _kq_tile(kq_ring, s, 1)
        # Slot s of the T, scores and gate rings is free once the state is done with chunk
        # t - RING: waited before the inverse, so that T_u goes to its slot as formed (held
        # across the wait it spilled more), while the state works on a chunk before t.
        enter("aux.wait_state")
        mbarrier.wait(wu_empty.index(s), ((t // RING) & 1) ^ 1)
        leave("aux.wait_state")
        enter("aux.inverse")
        if NORMS:
            # q's and k's reciprocal row norms, in column halves, before the inverse and
            # kept in a register each (reduced under q k^T's accumulator, or over k's whole
            # rows inside A's formation, they spilled): k's scales A, both the scores and
            # the gate vectors.
            rk = gl.convert_layout(row_rnorm(k_tile, half, 2), c_layout)
            rq = gl.convert_layout(row_rnorm(q_tile, half, 2), c_layout)
        else:
            rk = None
        vector_row = 2 * (t % ROW_VECTOR_SLOTS)
        vectors = row_vectors if shared_row_vectors() else None
        t_u, c, squares = chunk_t_u_on_chip(k_tile, beta, s_beta, row, n_valid, i_h, g_raw, b_raw, tables, kk_bar, 0,
                                            NORMS, ENGINE, rk, a_save if SAVE_A else None, vectors, vector_row,
                                            LATE_CHECK)
        enter("aux.store_t")
        t_ring.index(s).store(t_u.to(dtype))
        if LATE_CHECK:
            # Read after the gate vectors' barrier; the next chunk's store follows the
            # barriers of its inverse, which every warp reaches after its read.
            check_slot.store(squares)
        leave("aux.store_t")
        leave("aux.inverse")
        enter("aux.scores")
        if shared_row_vectors():
            g_row, g_end = gate_rows_of_cumsum(c, n_valid, vectors.index(vector_row))
        else:
            g_row, g_end = gate_rows_of_cumsum(c, n_valid)
        if not NORMS:
            rq = g_row  # unused
            rk = g_row
        if STATE_SCORES:
            _store_gates_and_rows(gate_ring, graw_ring, s, g_row, g_end, n_valid, rq, rk, NORMS)
        else:
            qk = warpgroup_mma(q_tile, k_tile.permute((1, 0)), gl.zeros([BT, BT], gl.float32, acc_bt),
                               use_acc=False, is_async=True)
            _store_scores_and_gates(qk, s_ring, gate_ring, s, g_row, g_end, n_valid, rq, rk, NORMS)
        leave("aux.scores")
        if LATE_CHECK:
            enter("aux.check")
            _redo_if_lost(check_slot, a_save, tables, t_ring.index(s), vectors.index(vector_row + 1), NORMS)
            leave("aux.check")
        mbarrier.arrive(kq_empty.index(s), count=1)
        mbarrier.arrive(wu_ready.index(s), count=1)
    leave("aux.walk")


@gluon.constexpr_function
def late_range_check(save_a, state_scores):
    """Whether the one-kernel build checks the fp16 inverse's range after the gate vectors'
    barrier (:data:`..gluon_common.blocked_inverse.LATE_RANGE_CHECK`; with A kept for the
    redo, the state's scores and the shared row vectors, as shipped)."""
    return late_range_check_set() and bool(save_a) and bool(state_scores) and shared_row_vectors()


@gluon.jit
def _redo_if_lost(check_slot, a_save, tables, t_slot, beta_row, NORMS: gl.constexpr):
    """:func:`late_range_check`: the four warps' sums of T's squares in ``check_slot``; where
    they say the fp16 inverse lost its range, T by rows from the A kept in ``a_save``, scaled
    by the chunk's ``beta_row`` into the T_u slot ``t_slot`` again, fenced for the state's
    wgmma and joined over the warps."""
    every: gl.constexpr = gl.BlockedLayout([BLOCKS], [32], [gl.num_warps()], [0])
    if squares_lost_half_range(check_slot.load(every)):
        layout: gl.constexpr = inverse_layout()
        t = redo_from_buffer(a_save, tables, layout, NORMS)
        u_scale = beta_row.load(gl.SliceLayout(0, layout))
        t_slot.store((t * gl.expand_dims(u_scale, 0)).to(t_slot.dtype))
        fence_async_shared()
        thread_barrier()


@gluon.jit
def _loader(k_desc, q_desc, v_desc, t_desc, kq_ring, v_ring, t_ring, kq_ready, kq_empty, v_ready, t_ready, slot_free,
            bos, NT, col_k, col_v, HV, i_h, slot0):
    """:data:`LOAD_WARP`: chunk t's k, q, v and T tiles into slot t % 2 once both the state
    (``slot_free``) and the aux partition (``kq_empty``) are done with chunk t - 2 (the
    prologue loads chunks 0 and 1)."""
    BT: gl.constexpr = kq_ring.shape[1] // 2
    for t in range(2, NT):
        s = t % 2
        phase = ((t - 2) // 2) & 1
        mbarrier.wait(slot_free.index(s), phase)
        _load_v(v_desc, v_ring, v_ready, s, bos + t * BT, col_v)
        _load_t(t_desc, t_ring, t_ready, s, slot0 + t, HV, i_h)
        mbarrier.wait(kq_empty.index(s), phase)
        _load_kq(k_desc, q_desc, kq_ring, kq_ready, s, bos + t * BT, col_k)


@gluon.jit(do_not_specialize=["HV", "GROUP", "pool_size", "s_g", "s_beta", "s_k", "N", "L", "NSEG"])
def _fused_fwd_kernel(
    q_desc, k_desc, v_desc, t_desc, o_desc, o_ptr, g_cum, g, beta, h0, ht, state_indices, cu_seqlens, k_ptr, hand,
    chain_flags, scale, HV, GROUP, pool_size, s_g, s_beta, s_k, N, L, NSEG,
    USE_H0: gl.constexpr, STORE_HT: gl.constexpr, STATE_VK: gl.constexpr, HAS_TAILS: gl.constexpr,
    USE_POOL: gl.constexpr, INPLACE: gl.constexpr, ENGINE: gl.constexpr, V_SLOTS: gl.constexpr,
    SINGLE_T: gl.constexpr, QK_NORM: gl.constexpr, AUX_T: gl.constexpr, EARLY_O1: gl.constexpr,
    STATE_SCORES: gl.constexpr, CHAIN: gl.constexpr, PICK: gl.constexpr,
):
    BT: gl.constexpr = k_desc.block_type.shape[0]
    K: gl.constexpr = k_desc.block_type.shape[1]
    V: gl.constexpr = v_desc.block_type.shape[1]
    dtype: gl.constexpr = k_desc.dtype
    gl.static_assert(not CHAIN or AUX_T, "chained segments on the one-kernel build alone")
    if CHAIN:
        if PICK:
            # The census picked the pipeline (:func:`..gluon_common.warm_chain.warm_census_fwd`).
            if picked_elsewhere(chain_flags + NSEG * HV + 1, True):
                return
        # A segment slot (:mod:`..gluon_common.warm_chain`): the walk may start before it.
        ticket = gl.atomic_add(chain_flags + NSEG * HV, 1)
        slot, i_h, i_n, seq_bos, bos, eos = chain_item(ticket, cu_seqlens, N, L, HV)
        col_k = (i_h // GROUP) * K
        col_v = i_h * V
        NT = gl.cdiv(eos - bos, BT)
    else:
        i_n, i_nh, i_h, i_v, bos, eos, NT, col_w, col_k, col_v = walk_program(cu_seqlens, HV, GROUP, K, V, V, BT,
                                                                              True)
    block = state_block(state_indices, i_n, i_h, HV, pool_size, USE_POOL)
    slot0 = first_t_slot(bos, i_n, BT, HAS_TAILS)

    # Slots of the k/q ring, and of the T and gate rings of the one-kernel build
    # (:data:`AUX_RING_SLOTS`); the other builds keep two.
    RING: gl.constexpr = ring_slots(STATE_SCORES)
    # One [2 BT, K] tile a slot, k's rows then q's (:func:`_kq_tile`): the 128-byte swizzle
    # lays it out as [2 BT, 64] column slabs, so both row halves are operands as they are and
    # the whole tile is one (:data:`WIDE_KQ`); two [BT, K] tiles side by side would not be.
    kq_ring = gl.allocate_shared_memory(dtype, [RING, 2 * BT, K], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [V_SLOTS, BT, V], v_desc.layout)
    gl.static_assert(not AUX_T or SINGLE_T, "the aux partition forms T_u alone")
    gl.static_assert(not STATE_SCORES or (AUX_T and EARLY_O1), "the state forms the scores under AUX_T alone")
    gl.static_assert(not SINGLE_T or V_SLOTS == 2, "with T_u alone the state reads v slot t % 2")
    if AUX_T:
        # T_u formed on chip (no T kernel, no t_desc), a slot per k/q slot; the inverse's tables.
        t_ring = gl.allocate_shared_memory(dtype, [RING, BT, BT], E.smem_layout([BT, BT], dtype))
        # 16 slots of 16 x 16 (shapes are powers of two): the inverse takes the first 12.
        tables = gl.allocate_shared_memory(gl.float32, [BLOCKS * BLOCKS, BLOCK, BLOCK], table_layout())
        # With the fp16 inverse, A kept for its redo (else a placeholder, never touched).
        SAVE_A: gl.constexpr = keeps_a()
        if SAVE_A:
            a_save = redo_buffer(BT, QK_NORM)
        else:
            a_save = tables
        kk_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kk_bar.index(0), count=1)
        if shared_row_vectors():
            row_vectors = row_vector_slots(BT)
        else:
            row_vectors = tables  # not read
        if late_range_check(SAVE_A, STATE_SCORES):
            # The warps' sums of T's squares (LATE_RANGE_CHECK).
            check_slot = gl.allocate_shared_memory(gl.float32, [BLOCKS], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        else:
            check_slot = tables  # not read
    elif SINGLE_T:
        # T_u alone, two slots; no w or u (the state partition forms v_new from T_u).
        t_ring = gl.allocate_shared_memory(dtype, [2, BT, BT], t_desc.layout)
    else:
        t_ring = gl.allocate_shared_memory(dtype, [4, BT, BT], t_desc.layout)
        w_ring = gl.allocate_shared_memory(dtype, [2, BT, K], k_desc.layout)
        u_ring = gl.allocate_shared_memory(dtype, [2, V, BT], E.smem_layout([V, BT], dtype))
    RING_S: gl.constexpr = 2
    s_ring = gl.allocate_shared_memory(dtype, [RING_S, BT, BT], E.smem_layout([BT, BT], dtype))
    # Three gate vectors per slot (see _aux), four with the qk l2 norm on chip (_aux_scores).
    NG: gl.constexpr = 4 if QK_NORM else 3
    gate_ring = gl.allocate_shared_memory(gl.float32, [NG * RING, BT], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    if STATE_SCORES:
        # The state's causal-gate exponents of each chunk's scores: rows, then columns.
        graw_ring = gl.allocate_shared_memory(gl.float32, [2 * RING, BT], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    else:
        graw_ring = gate_ring  # not read
    o_smem = gl.allocate_shared_memory(dtype, [BT, V], o_desc.layout)
    kq_ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    kq_empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    t_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    wu_ready = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    wu_empty = gl.allocate_shared_memory(gl.int64, [RING, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [V_SLOTS, 1], mbarrier.MBarrierLayout())
    # LOAD_WARP: the state's releases of its slots to the load warp.
    LOADER: gl.constexpr = LOAD_WARP and SINGLE_T and V_SLOTS == 2 and not AUX_T
    if LOADER:
        slot_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(slot_free.index(i), count=1)
    else:
        slot_free = kq_empty  # not read
    for i in gl.static_range(RING):
        mbarrier.init(kq_ready.index(i), count=1)
        mbarrier.init(kq_empty.index(i), count=1)
        mbarrier.init(wu_ready.index(i), count=1)
        mbarrier.init(wu_empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(t_ready.index(i), count=1)
    for i in gl.static_range(V_SLOTS):
        mbarrier.init(v_ready.index(i), count=1)

    # S^T [V, K]: the initial state staged through the k/q ring before any load is issued.
    acc_s: gl.constexpr = wgmma_layout(V, K, gl.num_warps())
    store_from = bos
    if CHAIN:
        later = bos > seq_bos
        warm = bos * 0 - 1
        if later:
            warm = warm_row(g, s_g, beta, s_beta, k_ptr, s_k, col_k, i_h, seq_bos, bos, K, BT, QK_NORM)
        if warm >= 0:
            # The forgetting suffix before the segment walked again from zeros.
            S = gl.zeros([V, K], gl.float32, acc_s)
            bos = warm
            NT = gl.cdiv(eos - bos, BT)
        elif later:
            prev = (slot - 1) * HV + i_h
            wait_hand_over(chain_flags, prev)
            S = state_in(hand, kq_ring, prev, 0, K, V, V, False, False, acc_s, True, True)
        elif USE_H0:
            S = state_in(h0, kq_ring, block, 0, K, V, V, STATE_VK, USE_POOL, acc_s, True)
        else:
            S = gl.zeros([V, K], gl.float32, acc_s)
        fence_async_shared()
        thread_barrier()
    elif USE_H0:
        S = state_in(h0, kq_ring, block, 0, K, V, V, STATE_VK, USE_POOL, acc_s, True)
        fence_async_shared()
        thread_barrier()
    else:
        S = gl.zeros([V, K], gl.float32, acc_s)

    # Chunks 0 and 1 of k/q, chunk 0 of v and T: the partitions issue the rest.
    if NT > 0:
        _load_kq(k_desc, q_desc, kq_ring, kq_ready, 0, bos, col_k)
        _load_v(v_desc, v_ring, v_ready, 0, bos, col_v)
        if not AUX_T:
            _load_t(t_desc, t_ring, t_ready, 0, slot0, HV, i_h)
    if NT > 1:
        _load_kq(k_desc, q_desc, kq_ring, kq_ready, 1, bos + BT, col_k)
        if V_SLOTS > 1:
            _load_v(v_desc, v_ring, v_ready, 1, bos + BT, col_v)
        if SINGLE_T and not AUX_T:
            _load_t(t_desc, t_ring, t_ready, 1, slot0 + 1, HV, i_h)
    for i in gl.static_range(2, RING):
        if NT > i:
            _load_kq(k_desc, q_desc, kq_ring, kq_ready, i, bos + i * BT, col_k)

    if AUX_T:
        S = gl.warp_specialize([
            (_state, (S, k_desc, q_desc, v_desc, t_desc, kq_ring, v_ring, t_ring, t_ring, t_ring, s_ring,
                      gate_ring, o_smem, kq_ready, kq_empty, v_ready, t_ready, wu_ready, wu_empty, slot_free,
                      o_desc, o_ptr, HV * V, scale, bos, eos, NT, col_k, col_v, HV, i_h, slot0, HAS_TAILS, ENGINE,
                      True, False, True, EARLY_O1, graw_ring, STATE_SCORES, store_from, CHAIN)),
            (_aux_inverse, (kq_ring, t_ring, s_ring, gate_ring, tables, kq_ready, kq_empty, wu_ready, wu_empty,
                            kk_bar.index(0), g, s_g, beta, s_beta, HV, i_h, bos, eos, NT, ENGINE, graw_ring,
                            STATE_SCORES, a_save, SAVE_A, row_vectors, check_slot)),
        ], [AUX_WARPS], [_aux_regs(V)])[0]
    elif SINGLE_T:
        # w_ring, u_ring: not allocated; the state's arguments take the T ring in their place.
        if LOADER:
            S = gl.warp_specialize([
                (_state, (S, k_desc, q_desc, v_desc, t_desc, kq_ring, v_ring, t_ring, t_ring, t_ring, s_ring,
                          gate_ring, o_smem, kq_ready, kq_empty, v_ready, t_ready, wu_ready, wu_empty, slot_free,
                          o_desc, o_ptr, HV * V, scale, bos, eos, NT, col_k, col_v, HV, i_h, slot0, HAS_TAILS, ENGINE,
                          True, True, False, EARLY_O1)),
                (_aux_scores, (kq_ring, s_ring, gate_ring, kq_ready, kq_empty, wu_ready, wu_empty, g_cum, HV, i_h,
                               bos, eos, NT)),
                (_loader, (k_desc, q_desc, v_desc, t_desc, kq_ring, v_ring, t_ring, kq_ready, kq_empty, v_ready,
                           t_ready, slot_free, bos, NT, col_k, col_v, HV, i_h, slot0)),
            ], [AUX_WARPS, 1], [LOAD_WARP_AUX_REGS, LOAD_REGS])[0]
        else:
            S = gl.warp_specialize([
                (_state, (S, k_desc, q_desc, v_desc, t_desc, kq_ring, v_ring, t_ring, t_ring, t_ring, s_ring,
                          gate_ring, o_smem, kq_ready, kq_empty, v_ready, t_ready, wu_ready, wu_empty, slot_free,
                          o_desc, o_ptr, HV * V, scale, bos, eos, NT, col_k, col_v, HV, i_h, slot0, HAS_TAILS, ENGINE,
                          True, False, False, EARLY_O1)),
                (_aux_scores, (kq_ring, s_ring, gate_ring, kq_ready, kq_empty, wu_ready, wu_empty, g_cum, HV, i_h,
                               bos, eos, NT)),
            ], [AUX_WARPS], [_aux_regs(V)])[0]
    else:
        S = gl.warp_specialize([
            (_state, (S, k_desc, q_desc, v_desc, t_desc, kq_ring, v_ring, t_ring, w_ring, u_ring, s_ring, gate_ring,
                      o_smem, kq_ready, kq_empty, v_ready, t_ready, wu_ready, wu_empty, slot_free, o_desc, o_ptr,
                      HV * V, scale, bos, eos, NT, col_k, col_v, HV, i_h, slot0, HAS_TAILS, ENGINE, False, False)),
            (_aux, (v_desc, t_desc, kq_ring, v_ring, t_ring, w_ring, u_ring, s_ring, gate_ring,
                    kq_ready, kq_empty, v_ready, t_ready, wu_ready, wu_empty,
                    g_cum, HV, i_h, bos, eos, NT, slot0, col_v)),
        ], [AUX_WARPS], [_aux_regs(V)])[0]

    if CHAIN:
        slot, i_h, i_n, seq_bos, bos, eos = chain_item(ticket, cu_seqlens, N, L, HV)
        if slot == chain_last_slot(cu_seqlens, i_n, L):
            if STORE_HT or INPLACE:
                block = state_block(state_indices, i_n, i_h, HV, pool_size, USE_POOL)
                state_out(ht, i_n * HV + i_h, h0, block, 0, S, kq_ring, K, V, V, STATE_VK, STORE_HT, INPLACE, True)
        else:
            # Handed over whether or not the next segment waits for it (it decides alone).
            state_out(hand, slot * HV + i_h, hand, -1, 0, S, kq_ring, K, V, V, False, True, False, True)
            # Every thread's part of the state is stored before the count says so.
            thread_barrier()
            gl.atomic_add(chain_flags + slot * HV + i_h, 1, sem="release")
    elif STORE_HT or INPLACE:
        # The program's indices again rather than kept live across the partitions, where
        # the register budget changes (ptxas kept them in local memory).
        i_n, i_nh, i_h, i_v, bos, eos, NT, col_w, col_k, col_v = walk_program(cu_seqlens, HV, GROUP, K, V, V, BT, True)
        block = state_block(state_indices, i_n, i_h, HV, pool_size, USE_POOL)
        state_out(ht, i_nh, h0, block, 0, S, kq_ring, K, V, V, STATE_VK, STORE_HT, INPLACE, True)


# ----------------------------------------------------------------------------------------
# Host side: admission, plan (dry run), launch, AOT list

#: Spill bytes the kernel keeps (``AotKernel.spill_bytes_allowed``): ptxas holds a few
#: scalars (loop bounds, ring offsets) in local memory around the partitions' register
#: reallocation (setmaxnreg), 40-250 bytes by specialization; the chunk loop's speed is
#: measured on the H200 instead (benchmarks/RESULTS.md).
SPILL_BYTES = 256
#: Spill bytes with :data:`AUX_T`: the blocked inverse beside the aux partition's loop
#: scalars at 120 registers (the state keeps its 192; at 128 Triton gives the state 184 and
#: both spill more). With the inverse on fp16 operands (triton 3.6.0): with
#: :data:`STATE_SCORES` 72-188 bytes per specialization at V = 128, 0-40 at K = 64
#: (:data:`SMALL_HEADS`), none at V = 64; with the scores in the aux 16-24, 324-332 with
#: the qk l2 norm on chip, 24 / 320 at K = 64 (on tf32, under 3.6.0 and 3.9.0: 80-220 and
#: 0-56; 104-136, 424-456, up to 104 / 452). In the SASS of the aux-scores l2 build (tf32:
#: 29 STL, 46 LDL) the stores are the aux partition's loop-invariant scalars at its entry,
#: reloaded a few at a time in its chunk loop.
AUX_T_SPILL_BYTES = 464
#: The same with the scores in the aux partition (:data:`STATE_SCORES` off, not shipped):
#: on fp16 products with the qk l2 norm on chip triton 3.9.0 keeps 692 bytes there (340
#: with :data:`STATE_SCORES`; 324-332 under 3.6.0), the aux's loop scalars and the norm's
#: beside the inverse and its redo.
AUX_SCORES_SPILL_BYTES = 768


def aux_t_spill_bytes(state_scores: bool) -> int:
    """The spill bytes an :data:`AUX_T` build keeps, by where its causal scores are formed
    (:data:`STATE_SCORES`)."""
    return AUX_T_SPILL_BYTES if state_scores else AUX_SCORES_SPILL_BYTES
#: Head dims the kernel is built for (the state tile and the rings fill the register file
#: and shared memory at 128).
HEAD_DIM = 128
#: With :data:`SMALL_HEADS`: K and V each 64 or 128 (V = 64: one state warpgroup).
HEAD_DIMS = (64, 128)
#: Calls with K or V of 64 take the path too (:data:`HEAD_DIMS`; with T_u alone, whose aux
#: partition forms no w or u halves); off, they run the pipeline, whose K = 64 programs
#: share an SM two at a time. H100 80GB HBM3, triton 3.6.0, bf16, H16-HV32 (``python
#: benchmarks/flag_ab.py small_heads``, ``logs/h100_small_heads.log``, two rounds): calls
#: 0.469 -> 0.453 ms at 4 x 8192 K = V = 64, 0.566 -> 0.534 at K 64 / V 128, 0.563 -> 0.499
#: at K 128 / V 64, 0.863 -> 0.824 on ragged16 K = V = 64; outputs within 1.8e-3 of the
#: pipeline's.
SMALL_HEADS = True


def head_dims() -> tuple[int, ...]:
    """The head dims (each of K and V) the path takes: :data:`HEAD_DIMS` with
    :data:`SMALL_HEADS` (and T_u alone), else :data:`HEAD_DIM` alone."""
    return HEAD_DIMS if SMALL_HEADS and _wy_t.WY_T_SINGLE_TILE else (HEAD_DIM,)


def state_warps(V: int) -> int:
    """Warps of the state partition at value head dim ``V``: a warpgroup per 64 rows of S^T."""
    return STATE_WARPS * V // HEAD_DIM
#: The fused path runs a call when its (sequence, v-head) programs fill at least this
#: share of the SMs: it has no V-split, so fewer programs leave SMs idle that the
#: two-launch pipeline (V-blocks of 32 or 64) fills. Measured on the H200 (132 SMs, bf16,
#: H = 16): 128 programs (4 x 8192, HV = 32) 0.785 ms against 0.916; 64 programs (1 x 8192,
#: HV = 64) 0.581 against 0.520; 32 programs 0.496 against 0.326.
MIN_SM_SHARE = 0.75

#: Slots of the v ring. One: the aux partition loads chunk t + 1's v once it is done with
#: chunk t's u, and waits for it after forming the next w. Two (16 KB more, 226 of the
#: 227 KB): chunk t + 2's v is loaded then, a whole chunk ahead of its use. H200, triton
#: 3.6.0, bf16 (``python benchmarks/flag_ab.py v_slots``, ``logs/h200_fused_v_slots.log``,
#: outputs bit-equal): the kernel 0.388 -> 0.359 ms at 4 x 8192 HV 32, 0.400 -> 0.376 at
#: 8 x 4096, 0.736 -> 0.675 on ragged16, 0.766 -> 0.706 at 4 x 8192 HV 64; the calls
#: 0.677 -> 0.649, 0.688 -> 0.665, 1.251 -> 1.193, 1.331 -> 1.273 ms. With T_u alone
#: (:data:`.wy_t.WY_T_SINGLE_TILE`) the state partition refills v two chunks ahead itself:
#: two slots, always (:func:`plan_fused` refuses one).
V_SLOTS = 2

#: A one-warp partition refills the k/q, v and T slots (with T_u alone, two v slots and the
#: T kernel: :data:`AUX_T` off): the state partition, which paces the kernel, spent 16% of
#: its loop on the refills (``benchmarks/partition_profile.py --shape H16-HV32-4x8192``,
#: H200, ``logs/h200_partition_profile.log``). Off: on the H200 (``python
#: benchmarks/flag_ab.py load_warp``, ``logs/h200_load_warp.log``, one sample) the kernel
#: 0.362 -> 0.350 ms at 4 x 8192 HV 32, 0.683 -> 0.679 on ragged16, 0.728 -> 0.702 at HV 64:
#: less than the refills' share, and not yet through the sanitizer.
LOAD_WARP = gl.constexpr(False)
#: With T_u alone (``CHAIN``), the state partition issues the output's ``S_old^T q^T``
#: right behind the chain's ``P^T = S^T k^T`` (both read the same bf16 S^T registers) and
#: waits for the two before reading v and the gate vectors, then issues the state update
#: and ``v_new^T scores^T`` together (:func:`_update_and_output_of_o1`), instead of the
#: update and ``S_old^T q^T`` together with the bf16 S^T and the fp32 v_new^T held until
#: then. That pair needs more registers than the state's 192, so ptxas serializes every
#: wgmma of the kernel, both partitions' (its note C7512, :data:`gdn_dispatch.aot.WGMMA_SERIALIZED`;
#: in the SASS each of the 36 16-deep steps is waited for before the next issues). In
#: this order none is (4 waits, at the groups' ends). Spill bytes (stores and loads, five
#: specializations, triton 3.6.0 / 3.9.0): 0-36 / 0-32 against 0-60 / 0-52 in the other
#: order; with :data:`AUX_T` 132-388 / 104-384 against 60-300 / 64-324. The same products
#: in the same order of accumulation: outputs bit-equal. It needs the state's 192
#: registers: with :data:`AUX_REGS` 136 (the state 184) ptxas serializes this order too.
#: H100 80GB HBM3, triton 3.6.0, bf16 (``python benchmarks/flag_ab.py early_o1``,
#: ``logs/h100_early_o1.log``, two rounds, outputs bit-equal): the kernel 0.390 -> 0.370 ms
#: at H16-HV32 4 x 8192, 0.400 -> 0.380 at 8 x 4096, 0.725 -> 0.683 on ragged16, 0.747 ->
#: 0.715 at HV 64, 0.438 -> 0.389 with the qk l2 norm on chip.
EARLY_O1 = True

#: Registers per thread of the load warp (addresses and phases only; Triton gives the
#: warp a warpgroup of its own), and of the aux partition beside it, so that the state's
#: two warpgroups keep their 192: 128 x (2 x 192 + 104 + 24) = 65536.
LOAD_REGS = gl.constexpr(24)
LOAD_WARP_AUX_REGS = gl.constexpr(104)

#: The chunk inverses formed in the aux partition (:func:`_aux_inverse`) instead of by the T
#: kernel: the call is one launch (with the qk l2 norm on normalized copies, two), T_u never
#: leaves the SM and the gate cumsum is never written. The profile of the two-launch path
#: (``benchmarks/partition_profile.py --shape H16-HV32-4x8192``, H200) has the aux partition
#: waiting 70% of its loop (3,640 of 5,030 cycles a chunk) while the T kernel takes a third
#: of the call (0.204 of 0.566 ms at H16-HV32 4 x 8192). With T_u alone and the blocked
#: inverse only (:func:`aux_t_on`); off, the T kernel
#: (:func:`~..gluon_common.wy_t.wy_t_fwd`) forms them in a launch of its own. On tf32
#: products the two launches are the faster: H100 80GB HBM3, triton 3.6.0, with
#: :data:`EARLY_O1` (``python benchmarks/flag_ab.py aux_t --with early_o1``,
#: ``logs/h100_aux_t.log``, two rounds): calls 0.576 -> 0.701 ms at H16-HV32 4 x 8192, 1.077
#: -> 1.237 on ragged16, 1.108 -> 1.357 at HV 64, 0.625 -> 1.094 with the norm on chip. With
#: the blocked inverse's factors formed first (ten dependent products per warp, not fifteen;
#: ``benchmarks/tree_ab.py``): 0.697 -> 0.623 ms at 4 x 8192, 1.238 -> 1.118 on ragged16,
#: 1.353 -> 1.226 at HV 64, against the two kernels' 0.576, 1.075 and 1.106: the single
#: warpgroup forms a tf32 inverse slower than the state consumes it (Proton's cycles read
#: 2.25e5 in ``aux.inverse``, 75% of the aux's loop, against 4.18e5 in the state's
#: ``state.wait_aux``, 62% of its loop; ``logs/h100_partition_profile_aux_t.log``). With
#: :data:`STATE_SCORES` and the inverse on fp16 products
#: (:data:`.blocked_inverse.F16_OPERANDS` with its redo by rows from A kept in shared
#: memory, :data:`.blocked_inverse.HALF_TABLES`, :data:`.blocked_inverse.DIAGONAL_SERIES`)
#: it is the faster build: ``flag_ab.py f16_inverse --with
#: aux_t,state_scores,half_tables,diagonal_series`` (``logs/h100_f16_redo_rows_ab.log``, two
#: rounds) ran its calls in 0.552 ms at H16-HV32 4 x 8192 against the same build's 0.663 on
#: tf32 products, 0.975 against 1.084 on ragged16, 1.074 against 1.282 at HV 64 (the two
#: kernels on tf32 products: 0.577 / 1.075 / 1.110 ms in another run,
#: ``logs/h100_f16_inverse_ab.log``), and 1354 GPU tests passed on the five flags
#: (``logs/h100_gpu_tests_f16_redo_rows.log``). In one run against the two kernels on tf32
#: products (``logs/h100_one_kernel_f16_vs_shipped.log``, ``bench --iters 20``, H100) the
#: call took 0.539 ms at H16-HV32 4 x 8192 (0.571), 0.554 at 8 x 4096 (0.577), 0.968 on
#: ragged16 (1.061). The pipeline's w/u kernel runs the fp16 inverse too, and at 32 and 64
#: programs (not this path) it lost 0.8-1.5% at H16-HV32 1 x 8192 (0.2446 -> 0.2483 ms), 0.5-0.7%
#: at 1 x 32768 and gained 0.5% at HV 64 1 x 8192: within a few microseconds, kept over a
#: second operand type for the shared inverse.
AUX_T = True

#: With :data:`AUX_T`: the causal scores ``q k^T 2^(g_i - g_j)`` formed by the state
#: partition (``q k^T`` issued once P^T and S_old^T q^T are done and the aux's chunk is
#: in; :data:`SCORES_BEHIND_V_NEW` moves it behind v_new^T's product), which waits on the
#: aux partition most of its loop there, instead of by the aux, whose inverse sets the pace
#: (``aux.scores`` a fifth of its loop in the profile above); the aux hands the state its
#: gate rows instead (:func:`_store_gates_and_rows`).
#: Not serialized, 44 wgmma as without it. H100 80GB HBM3, triton 3.6.0 (``python
#: benchmarks/flag_ab.py state_scores --with aux_t``, ``logs/h100_state_scores_ab.log``,
#: two rounds, outputs bit-equal): the fused kernel 0.631 -> 0.603 ms at H16-HV32 4 x
#: 8192, 1.141 -> 1.144 on ragged16, 1.256 -> 1.191 at HV 64; the GPU tests' aux-t
#: variants and fuzz cases pass with it, the sanitizers are clean. On with :data:`AUX_T`
#: (the one-kernel build ships with it); no effect without it.
STATE_SCORES = True

#: With :data:`STATE_SCORES`: the state issues the chunk's ``q k^T`` behind v_new^T's product
#: and gates and stores the scores while the state update runs
#: (:func:`_v_new_then_scores`, :func:`_update_then_scores`), instead of between P^T and
#: v_new^T, where its product, the gating and the join of the warps sat on the chain from
#: one state to the next. The same products in the same order of accumulation: outputs
#: bit-equal. sm_90a, 29 specializations: spills 0-256 bytes under Triton 3.6.0 (0-188 in
#: the other order), 0-304 under 3.9.0, no wgmma serialized, shared memory unchanged. H100
#: 80GB HBM3, triton 3.6.0 (``python benchmarks/flag_ab.py scores_behind_v_new``,
#: ``logs/h100_scores_behind_v_new.log``, two rounds): calls 1.005 -> 0.935 ms on ragged16,
#: 0.514 -> 0.519 at H16-HV32 4 x 8192, 1.015 -> 1.012 at HV 64, 0.636 -> 0.647 with the qk
#: l2 norm on chip. In Proton's profile of 4 x 8192 the state's loop is 7% shorter (its
#: wait on the aux 6% of it -> 3%) while the kernel's time stays: the two partitions
#: share the SM's issue slots and tensor cores, and a one-wave call ends with its slowest
#: program.
SCORES_BEHIND_V_NEW = gl.constexpr(True)

#: With :data:`SCORES_BEHIND_V_NEW`: slots of the one-kernel build's k/q, T_u and gate rings.
#: Two couple the partitions one chunk deep: the aux waits for chunk t's k/q tiles until the
#: state is done with chunk t - 2 and refills their slot (Proton at 4 x 8192: ~11% of the
#: aux's loop on that wait). Three (41 KB more shared memory: 180 -> 221 KB of 227) let the
#: aux run two chunks ahead; v and the state's scores keep two. H100 80GB HBM3, triton 3.6.0
#: (``python benchmarks/flag_ab.py aux_ring_slots``, ``logs/h100_aux_ring_slots.log``, two
#: rounds, outputs bit-equal): calls 0.526 -> 0.508 ms at H16-HV32 4 x 8192, 1.013 -> 0.988
#: at HV 64, 0.647 -> 0.639 with the qk l2 norm on chip, but 0.937 -> 0.977 on ragged16. In
#: Proton's profile the aux's wait for its tiles grows (859 -> 1,244 cycles a chunk): the
#: loads take the memory system's time, however early they are issued. Two as shipped.
AUX_RING_SLOTS = gl.constexpr(2)

#: The state partition's causal mask of its scores (behind v_new^T) formed in each chunk
#: from the chunk's valid rows and ids the compiler may not hoist
#: (:func:`..gluon_common.masks.causal_gate`'s ``n_valid``), instead of once before the
#: walk: hoisted, its words were spilled and reloaded every chunk, and the scores' selects
#: waited on the local loads (Nsight Compute's source counters, H100, 4 x 8192: ~10% of the
#: state warps' stall samples on those reloads). sm_90a, triton 3.6.0, the varlen build:
#: spills 112 -> 68 bytes, the state loop's local loads 18 -> 8 a chunk (15 -> 8 without
#: tails; ``python benchmarks/sass_counts.py``). H100 80GB HBM3 (``python
#: benchmarks/flag_ab.py scores_mask_in_loop``, two rounds, outputs bit-equal): calls 0.501
#: -> 0.477 ms at H16-HV32 4 x 8192, 0.975 -> 0.938 at HV 64, ragged16 0.917 -> 0.922
#: (kernel 0.941 -> 0.932). On.
SCORES_MASK_IN_LOOP = gl.constexpr(True)

#: With :data:`SCORES_BEHIND_V_NEW`: the state's two products from its register operand S^T,
#: ``P^T = S^T k^T`` and the output's ``S_old^T q^T``, issued as one [V, 2 BT] product of
#: the slot's k and q rows together (:func:`_kq_tile`: q's rows follow k's in one tile),
#: then split: half the register-operand wgmma (eight m64n128k16 for sixteen m64n64k16),
#: which the state's chain spent most of its issue on. The same products in the same
#: order of accumulation: outputs bit-equal. sm_90a, the varlen build (``python
#: benchmarks/sass_counts.py``): triton 3.6.0 spills 188 -> 84 bytes, the state loop 953 ->
#: 912 instructions and 16 -> 5 local loads; 3.9.0 224 -> 132 bytes, 31 -> 25 local loads;
#: shared memory unchanged. H100 80GB HBM3 (``python benchmarks/flag_ab.py wide_kq``,
#: ``logs/h100_wide_kq_ab.log``, two rounds): calls 0.927 -> 0.855 ms on ragged16, 0.481 ->
#: 0.481 at H16-HV32 4 x 8192, 0.930 -> 0.928 at HV 64, 0.623 -> 0.618 with the qk l2 norm
#: on chip. On.
WIDE_KQ = gl.constexpr(True)

#: With the fp16 inverse: the one-kernel build's aux keeps each chunk's A in 16 KB of
#: shared memory for the redo of a chunk past fp16's range; off, a redo forms A again from
#: k k^T (k's tile stays in its slot until the state is done with the chunk), and the aux
#: loses A's store from its chain. Before :data:`WIDE_KQ`, while the state alone set the
#: pace, off was no faster (H100, ``python benchmarks/flag_ab.py redo_forms_a``, two
#: rounds: 4 x 8192 0.477 -> 0.474 ms, ragged16 0.925 -> 0.930). With it the two
#: partitions' loops are equal at 4 x 8192 and ``aux.save_a`` is 927 of the aux's 8,054
#: cycles a chunk (Proton, ``logs/h100_partition_profile_wide_kq.log``), yet off is slower
#: there too (the same study on that build, ``logs/h100_redo_forms_a_wide_kq_ab.log``: the
#: fused kernel 0.456 / 0.457 -> 0.471 / 0.467 ms at 4 x 8192, ragged16 0.862 / 0.862 ->
#: 0.864 / 0.857): off, the redo's second formation of A sits in the aux loop's code
#: (sm_90a: that loop 1,385 -> 1,603 SASS instructions, ``_chunk_a`` 220 -> 398; the kernel
#: spills 92 bytes against 84, the state loop reloads 7 spilled values against 5). On.
AUX_KEEPS_A = gl.constexpr(True)


@gluon.constexpr_function
def keeps_a() -> bool:
    """Whether the one-kernel build's aux keeps A for the fp16 inverse's redo (the fp16
    inverse with :data:`AUX_KEEPS_A`)."""
    return fp16_products() and bool(AUX_KEEPS_A)


@gluon.constexpr_function
def ring_slots(state_scores: bool) -> int:
    """Slots of the fused kernel's k/q ring: :data:`AUX_RING_SLOTS` in the one-kernel build
    whose state forms the scores behind v_new^T, two in the others."""
    return AUX_RING_SLOTS.value if state_scores and SCORES_BEHIND_V_NEW.value else 2


def aux_t_on(engine) -> bool:
    """Whether ``engine``'s fused kernel forms the chunk inverses itself (:data:`AUX_T`,
    which needs T_u alone and the blocked inverse: sm_90a)."""
    return (AUX_T and not engine.is_sm100 and t_tiles_per_chunk(engine) == 1
            and _wy_t.WY_T_BLOCKED_INVERSE)


#: Calls with the qk l2 norm take the path (on normalized copies of q and k); off, they run
#: the pipeline with its reciprocal norms. On the H200, 4 x 8192 HV 32: 0.874 ms against
#: the pipeline's 1.055 (8 x 4096: 0.884 against 1.038).
QK_L2NORM = True

#: With T_u alone, calls with the qk l2 norm run on raw q and k: the T kernel reduces k's
#: row norms itself (its ``USE_L2NORM``) and the fused kernel's aux partition q's and k's
#: (:func:`_aux_scores`), folding them into the scores and into the gate vectors the state
#: partition already scales by (``QK_NORM``), instead of a norm kernel writing normalized
#: copies of q and k first. Every v-head of a group reduces its q/k head's norms again, so
#: it pays for groups of up to :data:`QK_NORM_ON_CHIP_MAX_GROUP` v-heads. H200, triton
#: 3.6.0, ``python benchmarks/flag_ab.py qk_norm_on_chip`` (two rounds, bf16, K = V = 128):
#: calls 0.715 -> 0.664 ms at H16-HV32 4 x 8192, 1.327 -> 1.200 on ragged16 (the norm
#: kernel's 0.129 / 0.225 ms gone, the T kernel +0.024 / +0.046, the fused kernel +0.058 /
#: +0.056), but 1.274 -> 1.297 at HV 64 (T +0.048, fused +0.106); o within 3.7e-3 of the
#: copies' (q and k no longer rounded to bf16 after the norm).
QK_NORM_ON_CHIP = True
#: The largest group (v-heads per q/k head, ``HV // H``) whose calls fold the norm in.
QK_NORM_ON_CHIP_MAX_GROUP = 2


def qk_norm_on_chip(engine) -> bool:
    """Whether the path's kernels on ``engine`` can fold the qk l2 norm in themselves
    (:data:`QK_NORM_ON_CHIP`, with T_u alone) instead of reading normalized copies."""
    return QK_NORM_ON_CHIP and t_tiles_per_chunk(engine) == 1


def norm_on_chip(problem: GDNProblem, engine) -> bool:
    """Whether the path folds ``problem``'s qk l2 norm into its two kernels
    (:func:`qk_norm_on_chip`, groups of at most :data:`QK_NORM_ON_CHIP_MAX_GROUP` v-heads)
    instead of normalizing copies of q and k first."""
    return (problem.use_qk_l2norm and qk_norm_on_chip(engine)
            and problem.HV // problem.H <= QK_NORM_ON_CHIP_MAX_GROUP)


def fused_reason(problem: GDNProblem) -> str | None:
    """Why the fused path cannot run ``problem`` (it then takes the two-launch pipeline),
    or None."""
    if len(head_dims()) > 1:
        if problem.K not in HEAD_DIMS or problem.V not in HEAD_DIMS:
            return f"head dims K, V in {HEAD_DIMS} only, got K = {problem.K}, V = {problem.V}"
    elif problem.K != HEAD_DIM or problem.V != HEAD_DIM:
        return f"head dims K = V = {HEAD_DIM} only, got K = {problem.K}, V = {problem.V}"
    if problem.use_qk_l2norm and not QK_L2NORM:
        return "the qk l2 norm (fused.QK_L2NORM is off)"
    # The T tiles' rows are int32 TMA coordinates (2 HV tiles of 64 rows per chunk slot).
    if t_tile_rows(problem.B * problem.T, problem.N, problem.HV, True) >= 2 ** 31:
        return f"{problem.B * problem.T} tokens x {problem.HV} v-heads: T tile rows past int32"
    return None


def plan_fused(problem: GDNProblem, device, *, engine, chain: bool = False) -> BoundLaunch:
    """Launch plan of :func:`fused_fwd` for ``problem`` (a dry run): one program per
    (sequence, v-head), :func:`state_warps` for the state plus the aux warpgroup; with
    ``chain`` one per (segment slot, v-head) of chained segments warmed up from their
    forgetting suffix (``CHAIN``, :mod:`..gluon_common.warm_chain`; the one-kernel build
    alone)."""
    H, HV, K, V, dtype = problem.H, problem.HV, problem.K, problem.V, problem.dtype
    BT = CHUNK_SIZE
    constexprs = {name: value for name, value in state_constexprs(problem, engine).items() if name != "USE_L2NORM"}
    constexprs["V_SLOTS"] = V_SLOTS
    t_tiles = t_tiles_per_chunk(engine)
    if t_tiles == 1 and V_SLOTS != 2:
        raise ValueError(f"fused.V_SLOTS = {V_SLOTS}: with T_u alone (wy_t.WY_T_SINGLE_TILE) the state "
                         "partition reads v slot t % 2 and refills it two chunks ahead; it needs 2 slots")
    constexprs["SINGLE_T"] = t_tiles == 1
    # A problem with the norm reaches this plan only when the norm is on chip (else the
    # plan sees the normalized copies: a problem without it).
    constexprs["QK_NORM"] = bool(problem.use_qk_l2norm) and t_tiles == 1
    on_chip_t = constexprs["AUX_T"] = aux_t_on(engine)
    # The chain order that keeps the wgmma pipelined (T_u alone: the state forms v_new).
    constexprs["EARLY_O1"] = EARLY_O1 and t_tiles == 1
    state_scores = constexprs["STATE_SCORES"] = on_chip_t and constexprs["EARLY_O1"] and STATE_SCORES
    if chain and not on_chip_t:
        raise ValueError("plan_fused: chained segments run on the one-kernel build (fused.AUX_T) alone")
    constexprs["CHAIN"] = False
    constexprs["PICK"] = False
    descriptors = (
        tile_desc("q_desc", "q", dtype, H * K, (BT, K), token_rows=True),
        tile_desc("k_desc", "k", dtype, H * K, (BT, K), token_rows=True),
        tile_desc("v_desc", "v", dtype, HV * V, (BT, V), token_rows=True),
        tile_desc("t_desc", "t", dtype, BT, (BT, BT)),
        tile_desc("o_desc", "o", dtype, HV * V, (BT, V)),
    )
    if on_chip_t:
        # No T tiles to read: the descriptor goes to the kernel as a None constexpr.
        descriptors = tuple(d for d in descriptors if d.arg != "t_desc")
        constexprs["t_desc"] = None
    launch = LaunchPlan(
        kernel="fused_fwd",
        grid_rule=GridRule(per_seq=1, times=HV),
        num_warps=state_warps(V),
        blocks={"BT": BT, "K": K, "V": V,
                "smem_bytes": fused_smem_bytes(K, V, torch.finfo(dtype).bits // 8, v_slots=V_SLOTS,
                                               single_t=t_tiles == 1,
                                               qk_norm=constexprs["QK_NORM"], aux_t=on_chip_t,
                                               state_scores=state_scores)},
        constexprs=constexprs,
        descriptors=descriptors,
        scalars={"HV": HV, "GROUP": HV // H},
        notes=(f"N x {HV} (sequence, v-head) programs, warp-specialized: state {state_warps(V) // 4} "
               f"warpgroup{'s' if V == HEAD_DIM else ''} + aux 1"
               + ("; the chunk inverses formed in the aux partition" if on_chip_t else "")
               + ("; the scores in the state partition" if state_scores else "")),
    )
    if chain:
        launch = warm_chain_plan(launch)
    return launch.bind(problem.B * problem.T, problem.N)


def fused_smem_bytes(K: int, V: int, elem: int, BT: int = CHUNK_SIZE, *, v_slots: int = 1,
                     single_t: bool = False, qk_norm: bool = False, aux_t: bool = False,
                     state_scores: bool = False, ring: int | None = None) -> int:
    """Shared memory of the kernel: k/q ring (``ring`` slots; None: :func:`ring_slots`), v
    (``v_slots`` slots), T ring (2 x 2 tiles), w, u and scores rings (2 slots), o, the gate
    vectors (``ring`` slots) and the barriers; with ``single_t``
    (:data:`.wy_t.WY_T_SINGLE_TILE`) a T ring of ``ring`` x 1 tiles and no w or u;
    with ``qk_norm`` (:data:`QK_NORM_ON_CHIP`) four gate vectors a slot; with ``aux_t``
    (:data:`AUX_T`) the blocked inverse's tables (16 KB, fp32), k k^T's barrier and, with
    the fp16 inverse (and :data:`AUX_KEEPS_A`), the 16 KB A waits in for its redo
    (:func:`..gluon_common.blocked_inverse.redo_buffer`) and, with
    :data:`..gluon_common.wy.SHARED_ROW_VECTORS`, its row vectors (2 slots x 2 fp32
    vectors); with ``state_scores`` (:data:`STATE_SCORES`) the gate rows of the state's
    scores (``ring`` x 2 fp32 vectors)."""
    ring = ring_slots(state_scores) if ring is None else ring
    t_and_wu = ring * BT * BT if single_t else 4 * BT * BT + 2 * BT * K + 2 * V * BT
    redo = redo_buffer_bytes(BT, qk_norm) if keeps_a() else 0
    vectors = ROW_VECTOR_SLOTS.value * 2 * BT * 4 if shared_row_vectors() else 0
    check = 4 * 4 if late_range_check(keeps_a(), state_scores) else 0
    inverse = 16 * 16 * 16 * 4 + 8 + redo + vectors + check if aux_t else 0
    return ((2 * ring * BT * K + v_slots * BT * V + t_and_wu + 2 * BT * BT + BT * V) * elem
            + ((4 if qk_norm else 3) + (2 if state_scores else 0)) * ring * BT * 4 + (4 * ring + 2 + v_slots) * 8
            + inverse)


def fused_fwd(problem: GDNProblem, t_tiles: torch.Tensor, g_cum: torch.Tensor, launch: LaunchPlan | BoundLaunch,
              *, q: torch.Tensor | None = None, k: torch.Tensor | None = None,
              out: tuple[torch.Tensor, torch.Tensor | None] | None = None, chain: tuple | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence and output of ``problem`` (validated, TMA-readable q / k / v) from
    the call's :func:`~..gluon_common.wy_t.wy_t_fwd` (``t_tiles``, ``g_cum``), one launch.
    With :data:`AUX_T` in the plan the kernel forms the inverses itself from the problem's
    g and beta: ``t_tiles`` is not read and ``g_cum`` only stands in for unused pointers.
    ``q``, ``k``: read instead of the problem's (with the qk l2 norm, the normalized copies
    of :func:`~..gluon_common.qk_norm.qk_l2norm_fwd`: the kernel normalizes nothing).

    Returns o ``[B, T, HV, V]`` in q's dtype and the float32 final state (``[N, HV, K, V]``
    "kv" or ``[N, HV, V, K]`` "vk") or None unless ``problem.output_final_state``; with a
    pool and ``inplace_final_state`` the pool rows are written back too. ``out``: (o,
    final state) allocated by the caller, or None to allocate them here. ``chain``: with a
    ``CHAIN`` plan (``plan_fused(..., chain=True)``), ``(hand, chain_flags, seg_len, NSEG)``:
    the sequences walked as chained segments of ``seg_len`` tokens (a multiple of the
    chunk) in ``NSEG`` slots (:mod:`gdn_dispatch.context_parallel`'s slots), ``hand`` a
    float32 ``[NSEG * HV, K, V]`` hand-over buffer and ``chain_flags`` int32 ``[NSEG * HV +
    1]`` (zeroed here, on the stream); with a ``PICK`` plan ``[NSEG * HV + 2]``, zeroed by
    the caller before the census wrote its pick word (:mod:`..gluon_common.pick`); None
    otherwise.
    """
    launch = launch.shared
    if launch.constexprs["CHAIN"] != (chain is not None):
        raise ValueError("chain: a CHAIN plan needs (hand, chain_flags, seg_len, NSEG), another plan none")
    q = problem.q if q is None else q
    k = problem.k if k is None else k
    v = problem.v
    B, T, HV, V = v.shape
    K = k.shape[3]
    N = problem.chunks.num_seqs
    vk = launch.constexprs["STATE_VK"]
    use_pool = launch.constexprs["USE_POOL"]
    o, final_state, h0 = state_buffers(q, (B, T, HV, V), N, K, vk, problem.output_final_state,
                                       problem.initial_state, use_pool, out)
    if B * T == 0 or N * HV == 0:
        return o, fill_final_state_of_empty_call(final_state, h0, use_pool, problem.state_indices)
    cu = problem.chunks.cu_seqlens
    tensors, args = fused_launch_args(
        launch, q, k, v, t_tiles, o, g_cum, h0 if h0 is not None else g_cum,
        final_state if final_state is not None else g_cum, problem.state_indices if use_pool else cu, cu,
        float(problem.scale), h0.shape[0] if use_pool else 0, problem.g, problem.beta, token_stride(problem.g),
        # k's rows are read by pointer in a chained launch alone (its warm-up bound).
        token_stride(problem.beta), 0 if chain is None else token_stride(k),
        None if chain is None else (chain[0], chain[1], N, chain[2], chain[3]))
    if chain is not None and not launch.constexprs["PICK"]:
        chain[1].zero_()
    launch_planned(_fused_fwd_kernel, launch, tensors, args, rows=B * T, num_seqs=N if chain is None else chain[3])
    return o, final_state


def fused_launch_args(launch: LaunchPlan, q, k, v, t_tiles, o, g_cum, h0, ht, state_indices, cu_seqlens, scale,
                      pool_size, g, beta, s_g, s_beta, s_k, chain: tuple | None = None) -> tuple[dict, dict]:
    """The descriptor tensors and runtime arguments of one ``_fused_fwd_kernel`` launch, the
    unused pointers replaced by a stand-in (what :func:`fused_fwd` launches with;
    :mod:`..gluon_common.call_program` binds the same lists). ``g``, ``beta`` (token
    strides ``s_g``, ``s_beta``): read with :data:`AUX_T` only; k's rows by pointer (token
    stride ``s_k``) by a ``CHAIN`` plan alone. ``chain``: a ``CHAIN``
    plan's ``(hand, chain_flags, N, seg_len, NSEG)`` (:func:`fused_fwd`); else the chain's
    pointers are stand-ins and its counts 0."""
    hand, flags, num_seqs, seg_len, slots = chain if chain is not None else (g_cum, cu_seqlens, 0, 0, 0)
    return {"q": q, "k": k, "v": v, "t": t_tiles, "o": o}, dict(
        o_ptr=o, g_cum=g_cum, g=g, beta=beta, h0=h0, ht=ht, state_indices=state_indices, cu_seqlens=cu_seqlens,
        k_ptr=k, hand=hand, chain_flags=flags, scale=scale, HV=launch.scalars["HV"], GROUP=launch.scalars["GROUP"],
        pool_size=pool_size, s_g=s_g, s_beta=s_beta, s_k=s_k, N=num_seqs, L=seg_len, NSEG=slots)


def fused_kernels_for_aot(capability: tuple[int, int], backend: str, *, engine) -> list[AotKernel]:
    """The kernel at every specialization the forward launches on sm_90a: bf16/fp16 x
    tails or not x "kv"/"vk" with a float32 initial and final state; then without either
    or with one of them; pools (float32 "kv" int32 indices in place, bfloat16 "vk" int64
    indices in place, bfloat16 only read); a bfloat16 initial state; int64 cu_seqlens. With
    :data:`SMALL_HEADS`, each other pair of :func:`head_dims` in bf16 with tails ("kv"),
    fp16 without ("vk") and (with the norm on chip) bf16 with the qk l2 norm (fp16 calls
    with the norm run on normalized copies)."""
    base = BASE_CASE
    cases = core_cases()
    cases += [{**base, **flip} for flip in (dict(h0=False, ht=False), dict(h0=True, ht=False), dict(h0=False, ht=True))]
    cases += [{**base, "pool": True, "inplace": True},
              {**base, "pool": True, "inplace": True, "vk": True, "state_dtype": torch.bfloat16,
               "index_dtype": torch.int64},
              {**base, "pool": True, "ht": False, "state_dtype": torch.bfloat16},
              {**base, "state_dtype": torch.bfloat16},
              {**base, "cu_dtype": torch.int64}]
    if qk_norm_on_chip(engine):
        # bf16 calls with the qk l2 norm run this kernel on raw q and k (QK_NORM); fp16
        # calls on normalized copies (qk_norm.l2_flags).
        cases += [{**case, "l2": True} for case in core_cases() if True in l2_flags(case["dtype"])]
    dims = head_dims()
    for K, V in ((K, V) for K in dims for V in dims if (K, V) != (HEAD_DIM, HEAD_DIM)):
        cases += [{**base, "K": K, "V": V},
                  {**base, "K": K, "V": V, "dtype": torch.float16, "tails": False, "vk": True}]
        if qk_norm_on_chip(engine):
            cases.append({**base, "K": K, "V": V, "l2": True})
    return fused_aot_kernels(cases, capability, backend, engine=engine, plan_fused=plan_fused, fn=_fused_fwd_kernel,
                             spill_bytes_allowed=aux_t_spill_bytes(STATE_SCORES) if aux_t_on(engine) else SPILL_BYTES)
