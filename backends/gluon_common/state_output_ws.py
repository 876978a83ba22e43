"""The state-output walk warp-specialized (sm_90a, one warpgroup of state; the plan's
``WS``, :data:`.state_output.STATE_OUTPUT_WS`): the serial chain of :mod:`.state_output`
in one partition, everything that hangs off it in others, so that the chain's chunk step
no longer queues behind the output's MMAs and elementwise work.

In the one-warpgroup walk every MMA of a chunk (``P = w h``, ``O = q h``, ``QK = q k^T``,
the state update, ``A v_new``) goes through one warpgroup's wgmma queue, which retires in
issue order, and the scores, the output's scaling and the store of o run on the same
warps as the chain. Here:

* **chain** (the default partition, four warps): per chunk ``h_t = S`` -> ``h_smem[t % HV_SLOTS]``;
  ``P = w h_t``; ``v_new = u - P`` -> ``vn_smem[t % HV_SLOTS]``, its scaled rows -> ``vs_smem``;
  ``S = 2^g_last S + k^T vs``. Nothing else: the gate rows of the next chunk are loaded a
  chunk early, and its wgmma queue holds its own two products only.
* **output** (:data:`OUTPUT_PARTITIONS` workers of four warps, taking alternate chunks):
  ``QK = q k^T`` as soon as the chunk's tiles land; once the chain has stored h_t and
  v_new, ``O = q h_t``, ``A = causal(QK 2^(g_i - g_j))`` -> its own ``p_smem``, ``O = 2^g O
  + A v_new``, the store of o through its own ``o_smem``. The partition of chunk t also
  refills the ring: slot ``t % NUM_BUF`` with chunk ``t + NUM_BUF`` once the chain is done
  with chunk t too.

Barriers (each completes once per use of its slot; chunk t's phase of a ring slot is
``(t // NUM_BUF) & 1``, of an h / v_new slot ``(t // HV_SLOTS) & 1``, ``HV_SLOTS`` two or
three, :func:`hv_slots`):

* ``wkq_ready`` / ``u_ready`` [NUM_BUF]: TMA transactions of the chunk's w, k, q / u
  (the chain and the chunk's output partition wait ``wkq_ready``; the chain alone reads u).
* ``chain_done`` [NUM_BUF]: the chain's last read of the slot (its state update waited;
  u was read into registers before the update's fence).
* ``hv_ready`` [HV_SLOTS]: h_t and v_new stored and fenced by every chain warp.
* ``hv_empty`` [HV_SLOTS]: the MMAs of chunk t's output partition reading h_t and v_new
  are complete (slot t % HV_SLOTS; with two slots and two output partitions each its own).
  The chain waits it with the opposite phase before storing h_(t+HV_SLOTS) (a fresh
  barrier's previous phase counts as complete, so the first HV_SLOTS chunks do not wait).
  An output partition at chunk t has passed chunk t - 2, so the chain has stored chunk
  t - HV_SLOTS, and cannot have stored t + HV_SLOTS: it waits within one phase.

No wait cycle: the chain at chunk t needs chunk t - HV_SLOTS's output partition done
with it (and the ring's chunk t, which chunk t - NUM_BUF's output partition issued when
done with that chunk, t - NUM_BUF <= t - HV_SLOTS); an output partition at chunk j needs
the chain done with chunk j, and its own chunks go in order. A partition of several
warps joins its warps (a barrier within the partition) before its one elected arrive or
TMA issue.

The initial state is staged through the idle ring before the partitions start, and the
final state after they return (:mod:`.state_io`), as in the one-warpgroup walk. Shared
memory: the walk's plus ``HV_SLOTS - 1`` more h and v_new tiles and an A and o tile per further
output partition (:func:`.state_output.state_output_smem_bytes`).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from gdn_dispatch.backends.gluon_common import engine as E
from gdn_dispatch.backends.gluon_common.compat import thread_barrier
from gdn_dispatch.backends.gluon_common.recurrence import gate_decays, gate_rows
from gdn_dispatch.backends.gluon_common.scopes import enter, leave
from gdn_dispatch.backends.gluon_common.state_io import state_init, state_out
from gdn_dispatch.backends.gluon_common.state_output_steps import (
    norm_rows, overwrite_acc, state_output_epilogue, state_output_load, state_output_pv, state_output_update)

#: Warps of an output partition (one warpgroup: wgmma's M = 64 rows of a chunk).
OUTPUT_WARPS = gl.constexpr(4)
#: Output partitions; two take alternate chunks (chunk t's h / v_new slot t % 2 is then one
#: partition's own, and so are its A and o tiles). One paced the chain on the H200 (16/32 x
#: 32768, BV = 32: the chain waited for its h / v_new slot 40% of its loop,
#: ``benchmarks/partition_profile.py --ws-walk``, ``logs/h200_partition_profile.log``).
#: Two against one (``python benchmarks/flag_ab.py ws_outputs``, ``logs/h200_ws_outputs.log``,
#: three arms): the kernel 0.742 -> 0.644 ms at 16/32 x 32768 (BV = 32), 0.188 -> 0.156 at
#: 16/32 x 8192, 0.238 -> 0.214 at 16/64 x 8192 (BV = 64), 0.061 -> 0.057 as context
#: parallelism's pass 2 at 2/4 x 32768.
OUTPUT_PARTITIONS = gl.constexpr(2)


@gluon.constexpr_function
def output_partitions(BV, l2):
    """Output partitions of a walk of ``BV`` columns with (``l2``) or without the qk l2 norm:
    :data:`OUTPUT_PARTITIONS`, but one at BV = 64 with the norm, where two left the chain
    8-16 bytes of registers short (ptxas spilled in the specializations without tails).
    Callable from the host too."""
    return 1 if (BV == 64 and l2) else OUTPUT_PARTITIONS.value


@gluon.constexpr_function
def output_regs(partitions):
    """Registers per thread of each output partition; the chain gets the rest of the
    register file (65536 = 128 x (chain + partitions x this) at one program per SM: K =
    128, where the ring fills the shared memory). With two, 144 (the chain 224): no spills
    at BV = 64 with the qk l2 norm, where 152 left the chain 16 bytes short."""
    return 240 if partitions == 1 else 144


#: h / v_new slots of a walk whose ring has three slots or more (:func:`hv_slots`): three let
#: the chain run three chunks ahead of the output partitions instead of two. H100 (16/32 x
#: 32768, BV = 32, two output partitions; ``python benchmarks/partition_profile.py
#: --ws-walk``, ``logs/h100_partition_profile_ws_walk.log``): with two slots the chain waits
#: for its slot 24% of its loop and the output partitions for the chain 33% of theirs. The
#: third slot takes 12 KB at BV = 32 (three ring slots then fill 221 KB); at BV = 64 the
#: ring has two slots, which hold the chain two chunks ahead whatever this says. H200,
#: triton 3.6.0 (``python benchmarks/flag_ab.py ws_hv_slots``, ``logs/h200_ws_hv_slots.log``,
#: two rounds, outputs bit-equal; the walk's GPU tests passed with three): this kernel 0.661
#: / 0.638 -> 0.671 / 0.671 ms at 16/32 x 32768, 0.157 / 0.158 -> 0.159 / 0.159 at 16/32 x
#: 8192, unchanged at 16/64 x 8192 (two slots there). The chain running further ahead does
#: not shorten its step: two.
HV_SLOTS_MAX = gl.constexpr(2)


@gluon.constexpr_function
def hv_slots(ring_slots):
    """h / v_new slots of a walk with ``ring_slots`` ring slots: :data:`HV_SLOTS_MAX`, but no
    more than the ring's (the chain at chunk t waits for chunk t's tiles, which the output
    partition of chunk t - ring_slots issues when done with that chunk). Callable from the
    host too."""
    return max(2, min(HV_SLOTS_MAX.value, ring_slots))


@gluon.jit
def _chain(S, ring, u_smem, h_smem, vn_smem, vs_smem, wkq_ready, u_ready, chain_done, hv_ready, hv_empty,
           p_bar, s_bar, g_cum, rnorm, bos, eos, NT, i_h, HV, GROUP,
           NUM_BUF: gl.constexpr, USE_L2NORM: gl.constexpr, ENGINE: gl.constexpr, HV_SLOTS: gl.constexpr):
    """The serial chain (module docstring); returns the final state."""
    BT: gl.constexpr = ring.shape[1]
    BV: gl.constexpr = u_smem.shape[2]
    dtype: gl.constexpr = ring.dtype
    row_layout: gl.constexpr = gl.SliceLayout(1, ENGINE.acc_layout(BT, BV, gl.num_warps()))
    P = ENGINE.acc_alloc(BT, BV)
    i_hk = i_h // GROUP
    H = HV // GROUP
    b_g, g_last = gate_rows(g_cum, bos, eos, i_h, HV, BT, row_layout)
    if USE_L2NORM:
        _, b_rk = norm_rows(rnorm, bos, eos, i_hk, H, BT, row_layout)
    # The whole walk, recorded once: its length against the phases' sum is what they miss.
    enter("chain.walk")
    for t in range(NT):
        buf = t % NUM_BUF
        ready_phase = (t // NUM_BUF) & 1
        hs = t % HV_SLOTS
        row = bos + t * BT
        m_t, b_d, decay = gate_decays(b_g, g_last, row, eos, BT)
        if USE_L2NORM:
            # k's reciprocal row norms: the row scale of vs.
            b_d = b_d * b_rk
        # The next chunk's rows, a chunk early: their load latency would sit on the chain.
        b_g, g_last = gate_rows(g_cum, row + BT, eos, i_h, HV, BT, row_layout)
        if USE_L2NORM:
            _, b_rk = norm_rows(rnorm, row + BT, eos, i_hk, H, BT, row_layout)

        s_reg = ENGINE.acc_read(S)
        # h / v_new slot hs is free once the output partition is done with chunk t - HV_SLOTS.
        enter("chain.wait_output")
        mbarrier.wait(hv_empty.index(hs), ((t // HV_SLOTS) & 1) ^ 1)
        leave("chain.wait_output")
        enter("chain.h_store")
        h_tile = h_smem.index(hs)
        h_tile.store(s_reg.to(dtype))
        fence_async_shared()  # generic writes -> MMA reads (async proxy)
        leave("chain.h_store")
        enter("chain.wait_tiles")
        mbarrier.wait(wkq_ready.index(buf), ready_phase)
        leave("chain.wait_tiles")
        enter("chain.p")
        k_tile = ring.index(3 * buf + 1)
        p = ENGINE.mma(ring.index(3 * buf), h_tile, overwrite_acc(P, ENGINE), False, p_bar)
        # The decayed state becomes the accumulator of k^T vs (overlaps P).
        S = ENGINE.acc_write(S, s_reg * decay)
        p = ENGINE.mma_wait(p, p_bar, t & 1)
        leave("chain.p")
        enter("chain.update")
        S = state_output_update(S, p, u_smem.index(buf), u_ready.index(buf), ready_phase, k_tile, b_d, m_t,
                                vn_smem.index(hs), vs_smem, s_bar, ENGINE)
        # h_t and v_new are stored and fenced by every warp: the update's MMA joined them.
        mbarrier.arrive(hv_ready.index(hs), count=1)
        S = ENGINE.mma_wait(S, s_bar, t & 1)
        leave("chain.update")
        enter("chain.release")
        # Every warp's update MMA (the last reader of w and k here) is complete.
        thread_barrier()
        mbarrier.arrive(chain_done.index(buf), count=1)
        leave("chain.release")
    leave("chain.walk")
    return (S,)


@gluon.jit
def _output(ring, u_smem, h_smem, vn_smem, p_smem, o_smem, wkq_ready, u_ready, chain_done, hv_ready, hv_empty,
            qk_bar, o_bar, pv_bar, w_desc, k_desc, q_desc, u_desc, o_desc, o_rows_desc, o_ptr,
            g_cum, rnorm, scale, bos, eos, NT, i_h, HV, GROUP, col_w, col_k, col_v,
            V: gl.constexpr, NUM_BUF: gl.constexpr, USE_L2NORM: gl.constexpr, HAS_TAILS: gl.constexpr,
            ENGINE: gl.constexpr, FIRST: gl.constexpr, STEP: gl.constexpr, HV_SLOTS: gl.constexpr):
    """Everything off the chain (module docstring), and the ring's refills, for chunks
    ``FIRST, FIRST + STEP, ...`` (``p_smem``, ``o_smem``: this partition's A and o tiles)."""
    BT: gl.constexpr = ring.shape[1]
    BV: gl.constexpr = u_smem.shape[2]
    row_layout: gl.constexpr = gl.SliceLayout(1, ENGINE.acc_layout(BT, BV, gl.num_warps()))
    O = ENGINE.acc_alloc(BT, BV)
    QK = ENGINE.acc_alloc(BT, BT)
    i_hk = i_h // GROUP
    H = HV // GROUP
    b_g, g_last = gate_rows(g_cum, bos + FIRST * BT, eos, i_h, HV, BT, row_layout)
    if USE_L2NORM:
        b_rq, b_rk = norm_rows(rnorm, bos + FIRST * BT, eos, i_hk, H, BT, row_layout)
    else:
        b_rq, b_rk = b_g, b_g  # unused
    enter("output.walk")
    for t in range(FIRST, NT, STEP):
        buf = t % NUM_BUF
        ready_phase = (t // NUM_BUF) & 1
        hs = t % HV_SLOTS
        row = bos + t * BT
        g_row = b_g
        rq = b_rq
        rk = b_rk
        # This partition's next chunk's rows, loaded early.
        b_g, g_last = gate_rows(g_cum, row + STEP * BT, eos, i_h, HV, BT, row_layout)
        if USE_L2NORM:
            b_rq, b_rk = norm_rows(rnorm, row + STEP * BT, eos, i_hk, H, BT, row_layout)

        enter("output.wait_tiles")
        mbarrier.wait(wkq_ready.index(buf), ready_phase)
        leave("output.wait_tiles")
        q_tile = ring.index(3 * buf + 2)
        qk = ENGINE.mma(q_tile, ring.index(3 * buf + 1).permute((1, 0)), overwrite_acc(QK, ENGINE), False, qk_bar)
        enter("output.wait_chain")
        mbarrier.wait(hv_ready.index(hs), (t // HV_SLOTS) & 1)
        leave("output.wait_chain")
        enter("output.products")
        o = ENGINE.mma(q_tile, h_smem.index(hs), overwrite_acc(O, ENGINE), False, o_bar)
        qk = ENGINE.mma_wait_until(qk, qk_bar, t & 1, 1)  # q h_t may still run
        o = ENGINE.mma_wait(o, o_bar, t & 1)
        o = state_output_pv(o, qk, g_row, rk, eos - row, p_smem, vn_smem.index(hs), pv_bar, USE_L2NORM, ENGINE)
        o = ENGINE.mma_wait(o, pv_bar, t & 1)
        leave("output.products")
        enter("output.release")
        # Every warp's MMAs reading h_t, v_new and the slot's q and k are complete.
        thread_barrier()
        mbarrier.arrive(hv_empty.index(hs), count=1)
        leave("output.release")
        if t + NUM_BUF < NT:
            # The slot takes chunk t + NUM_BUF once the chain is done with it too.
            enter("output.refill")
            mbarrier.wait(chain_done.index(buf), ready_phase)
            state_output_load(w_desc, k_desc, q_desc, u_desc, ring, u_smem, wkq_ready, u_ready,
                              buf, row + NUM_BUF * BT, col_w, col_k, col_v, True)
            leave("output.refill")
        enter("output.store")
        r_scale = gl.full([BT], scale, gl.float32, layout=row_layout)
        if USE_L2NORM:
            r_scale = r_scale * rq
        state_output_epilogue(ENGINE.acc_read(o), r_scale, o_smem, o_desc, o_rows_desc, o_ptr,
                              HV * V, row, col_v, eos - row, HAS_TAILS, ENGINE)
        leave("output.store")
    leave("output.walk")
    tma.store_wait(0)  # shared memory must outlive the bulk stores reading it


@gluon.jit
def state_output_ws_walk(q_desc, k_desc, w_desc, u_desc, o_desc, o_rows_desc, o_ptr, g_cum, rnorm, h0, ht,
                         i_nh, i_h, i_v, bos, eos, NT, col_w, col_k, col_v, block, scale, HV, GROUP,
                         V: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr, STATE_VK: gl.constexpr,
                         USE_L2NORM: gl.constexpr, HAS_TAILS: gl.constexpr, ENGINE: gl.constexpr,
                         USE_POOL: gl.constexpr, INPLACE: gl.constexpr, NUM_BUF: gl.constexpr):
    """One program's walk (its sequence, v-head ``i_h`` and V-block ``i_v``, as
    :func:`.recurrence.walk_program` gives them; ``block`` its initial / final state block)
    in the two partitions of the module docstring, with the final state stored as the
    one-warpgroup walk stores it."""
    gl.static_assert(not ENGINE.IS_SM100, "the warp-specialized walk is built for wgmma (sm_90a)")
    gl.static_assert(gl.num_warps() == 4, "one warpgroup holds the state")
    BT: gl.constexpr = w_desc.block_type.shape[0]
    K: gl.constexpr = w_desc.block_type.shape[1]
    BV: gl.constexpr = u_desc.block_type.shape[1]
    dtype: gl.constexpr = w_desc.dtype

    ring = gl.allocate_shared_memory(dtype, [3 * NUM_BUF, BT, K], w_desc.layout)
    u_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BT, BV], u_desc.layout)
    HV_SLOTS: gl.constexpr = hv_slots(NUM_BUF)
    h_smem = gl.allocate_shared_memory(dtype, [HV_SLOTS, K, BV], E.smem_layout([K, BV], dtype))
    vn_smem = gl.allocate_shared_memory(dtype, [HV_SLOTS, BT, BV], u_desc.layout)
    vs_smem = gl.allocate_shared_memory(dtype, [BT, BV], u_desc.layout)
    PARTS: gl.constexpr = output_partitions(BV, USE_L2NORM)
    p_smem = gl.allocate_shared_memory(dtype, [PARTS, BT, BT], E.smem_layout([BT, BT], dtype))
    o_smem = gl.allocate_shared_memory(dtype, [PARTS, BT, BV], o_desc.layout)
    wkq_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    u_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    chain_done = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    hv_ready = gl.allocate_shared_memory(gl.int64, [HV_SLOTS, 1], mbarrier.MBarrierLayout())
    hv_empty = gl.allocate_shared_memory(gl.int64, [HV_SLOTS, 1], mbarrier.MBarrierLayout())
    # One barrier per MMA site (the engine contract; wgmma does not read them): w h, k^T vs
    # in the chain; q k^T, q h, A v_new in each output partition.
    NBARS: gl.constexpr = 2 + 3 * PARTS
    mma_bars = gl.allocate_shared_memory(gl.int64, [NBARS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(wkq_ready.index(i), count=1)
        mbarrier.init(u_ready.index(i), count=1)
        mbarrier.init(chain_done.index(i), count=1)
    for i in gl.static_range(HV_SLOTS):
        mbarrier.init(hv_ready.index(i), count=1)
        mbarrier.init(hv_empty.index(i), count=1)
    for i in gl.static_range(NBARS):
        mbarrier.init(mma_bars.index(i), count=1)

    S = state_init(ENGINE.acc_alloc(K, BV), h0, ring, block, i_v, K, V, BV, STATE_VK, USE_H0, USE_POOL, ENGINE)
    # The first NUM_BUF chunks: the output partition issues the rest.
    for i in gl.static_range(NUM_BUF):
        state_output_load(w_desc, k_desc, q_desc, u_desc, ring, u_smem, wkq_ready, u_ready,
                          i, bos + i * BT, col_w, col_k, col_v, i < NT)

    gl.static_assert(PARTS == 1 or PARTS == 2, "one or two output partitions")
    # A partition's waits on a ring slot's barriers may run at most one phase ahead of
    # them. With two partitions and one slot, partition 1 would wait for chunk 1's phase
    # while chunk 0's is still open, and pass at once (a fresh barrier's previous phase
    # counts as complete). From two slots on, the partition of chunk t has waited for
    # chunk t - 2 (and with it for the chain's chunk t - NUM_BUF) before it waits on the
    # slot's next phase.
    gl.static_assert(PARTS == 1 or NUM_BUF >= 2, "two output partitions need two ring slots or more")
    if PARTS == 2:
        S = gl.warp_specialize([
            (_chain, (S, ring, u_smem, h_smem, vn_smem, vs_smem, wkq_ready, u_ready, chain_done, hv_ready, hv_empty,
                      mma_bars.index(0), mma_bars.index(1), g_cum, rnorm, bos, eos, NT, i_h, HV, GROUP,
                      NUM_BUF, USE_L2NORM, ENGINE, HV_SLOTS)),
            (_output, (ring, u_smem, h_smem, vn_smem, p_smem.index(0), o_smem.index(0), wkq_ready, u_ready,
                       chain_done, hv_ready, hv_empty, mma_bars.index(2), mma_bars.index(3), mma_bars.index(4),
                       w_desc, k_desc, q_desc, u_desc, o_desc, o_rows_desc, o_ptr, g_cum, rnorm, scale, bos, eos,
                       NT, i_h, HV, GROUP, col_w, col_k, col_v, V, NUM_BUF, USE_L2NORM, HAS_TAILS, ENGINE,
                       0, 2, HV_SLOTS)),
            (_output, (ring, u_smem, h_smem, vn_smem, p_smem.index(1), o_smem.index(1), wkq_ready, u_ready,
                       chain_done, hv_ready, hv_empty, mma_bars.index(5), mma_bars.index(6), mma_bars.index(7),
                       w_desc, k_desc, q_desc, u_desc, o_desc, o_rows_desc, o_ptr, g_cum, rnorm, scale, bos, eos,
                       NT, i_h, HV, GROUP, col_w, col_k, col_v, V, NUM_BUF, USE_L2NORM, HAS_TAILS, ENGINE,
                       1, 2, HV_SLOTS)),
        ], [OUTPUT_WARPS, OUTPUT_WARPS], [output_regs(2), output_regs(2)])[0]
    else:
        S = gl.warp_specialize([
            (_chain, (S, ring, u_smem, h_smem, vn_smem, vs_smem, wkq_ready, u_ready, chain_done, hv_ready, hv_empty,
                      mma_bars.index(0), mma_bars.index(1), g_cum, rnorm, bos, eos, NT, i_h, HV, GROUP,
                      NUM_BUF, USE_L2NORM, ENGINE, HV_SLOTS)),
            (_output, (ring, u_smem, h_smem, vn_smem, p_smem.index(0), o_smem.index(0), wkq_ready, u_ready,
                       chain_done, hv_ready, hv_empty, mma_bars.index(2), mma_bars.index(3), mma_bars.index(4),
                       w_desc, k_desc, q_desc, u_desc, o_desc, o_rows_desc, o_ptr, g_cum, rnorm, scale, bos, eos,
                       NT, i_h, HV, GROUP, col_w, col_k, col_v, V, NUM_BUF, USE_L2NORM, HAS_TAILS, ENGINE,
                       0, 1, HV_SLOTS)),
        ], [OUTPUT_WARPS], [output_regs(1)])[0]

    # The ring is idle: every load landed and every MMA reading it was waited on.
    if STORE_HT or INPLACE:
        state_out(ht, i_nh, h0, block, i_v, ENGINE.acc_read(S), ring, K, V, BV, STATE_VK, STORE_HT, INPLACE)
    for i in gl.static_range(NUM_BUF):
        mbarrier.invalidate(wkq_ready.index(i))
        mbarrier.invalidate(u_ready.index(i))
        mbarrier.invalidate(chain_done.index(i))
    for i in gl.static_range(HV_SLOTS):
        mbarrier.invalidate(hv_ready.index(i))
        mbarrier.invalidate(hv_empty.index(i))
    for i in gl.static_range(NBARS):
        mbarrier.invalidate(mma_bars.index(i))
