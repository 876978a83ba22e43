"""The recurrence and the output in one warp-specialized launch on Blackwell (sm_100a): the
twin of :mod:`..gluon_sm90.fused`, with the state in tensor memory. Compiled and checked
ahead of time only: it has not run on a Blackwell GPU, so the forward does not route
calls to it (``gluon_sm100.ENGINE`` offers no fused path); it is built and checked in CI so
that its structure holds while the Hopper path it mirrors changes.

Two launches per call, as on Hopper with its :data:`..gluon_sm90.fused.AUX_T` off::

    t_tiles, g_cum = wy_t_fwd(k, g, beta)              # T_w, T_u per (chunk, v-head)
    o, S           = fused_fwd(q, k, v, t_tiles, g_cum, S0)

or one, with :data:`AUX_T` (off here; its Hopper twin's is on): ``o, S = fused_fwd(q, k, v,
g, beta, S0)``, the aux partition forming each chunk's T_w and T_u itself (:func:`_aux_inverse`).

One program per (sequence, v-head), chunks of 64 rows, four partitions on mbarriers:

* **load** (one warp): TMA loads of each chunk's k, q, v, T_w and T_u into a two-slot ring.
* **mma** (one warp): every tcgen05 MMA of the program, each completing on an mbarrier
  (``tcgen05_commit``). For chunk t + 1, ahead of the chain: ``qk = q k^T`` [64, 64] and
  ``w = T_w k`` [64, K] in two [64, 64] halves (for the aux partition), ``u^T = v^T T_u^T``
  [V, 64] (for the state). For chunk t, the chain::

      P^T = S^T w^T ;  O1^T = S^T q^T          (bf16 S^T staged in shared memory)
      S^T += (v_new^T 2^(g_last - g)) k         (the scaled v_new^T from tensor memory)
      O2^T = v_new^T scores^T                   (v_new^T from tensor memory)

* **aux** (one warpgroup), a chunk ahead: the causal scores ``qk 2^(g_i - g_j)`` and
  ``w`` (bf16, from their accumulators into shared-memory rings), and the gate vectors.
  With :data:`AUX_T` first the chunk's inverse, from ``k k^T`` (an MMA of the mma
  partition into qk's tensor memory, ahead of q k^T) on mma.sync, T_w and T_u into the T
  ring; the mma partition then issues chunk t + 1's k k^T between chunk t's two halves of
  the chain and the rest of its products after them, so that its wait for the inverse
  holds back no product of the chain.
* **state** (one warpgroup, the default partition; thread r holds row r of every [V, *]
  tile): ``S^T`` [V, K] fp32 lives in tensor memory. Per chunk it stages bf16 ``S^T`` for
  the MMAs and scales the fp32 state by ``2^g_last`` in place; reads ``P^T`` and ``u^T``
  and writes ``v_new^T = u^T - P^T`` (and its gate-scaled copy) to tensor memory as the
  left operands of the update and of O2; then ``o = scale (2^g O1^T + O2^T)^T`` through
  shared memory and a TMA store (a TMA scatter for a sequence's last, partial chunk).

Tensor memory (fp32 columns of 128 lanes): S^T 128, P^T (then O2^T) 64, O1^T 64, u^T 64,
the two bf16 v_new^T tiles 32 each, qk 64, a w half 64: 512, all of it.

Phases: chunk ``t`` uses ring slot ``t % 2`` (phase ``(t // 2) & 1``); the single-buffered
tiles (P^T/O2^T, O1^T, u^T, qk, w, the staged S^T, v_new^T) alternate phases per chunk
(per half for w; with :data:`AUX_T` per MMA into qk's memory, k k^T then q k^T, and the
T slot's ``t_ready`` once per chunk). "free" barriers are waited with the opposite phase (a
fresh barrier's previous phase counts as complete). A partition of several warps joins its warps before
its one elected arrive, so every warp's reads and writes precede it.

What this kernel does not do, as its Hopper twin: the fused q/k l2 norm, context-parallel
segments, head dims other than 128.

Open points for its first run on hardware: the tensor-memory handoffs (the state's
``tcgen05.st`` of v_new^T and the scaled S^T, then an mbarrier, then the MMA warp's
``tcgen05.mma`` reading them) carry ``tcgen05.wait::st`` but no
``tcgen05.fence::before_thread_sync`` / ``after_thread_sync`` (Gluon emits none; its
Blackwell attention example hands P over through tensor memory the same way); and the
whole mbarrier protocol above has only been argued, never executed.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout, allocate_tensor_memory, tcgen05_commit, tcgen05_mma)
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from gdn_dispatch.aot import AotKernel
from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem

from gdn_dispatch.backends.gluon_common import engine as E
from gdn_dispatch.backends.gluon_common.blocked_inverse import (
    BLOCK, BLOCKS, fp16_products, inverse_layout, lost_half_range, table_layout)
from gdn_dispatch.backends.gluon_common.compat import reinterpret, thread_barrier, tma_load, tmem_reg_layout
from gdn_dispatch.backends.gluon_common.fused_aot import BASE_CASE, core_cases, fused_aot_kernels
from gdn_dispatch.backends.gluon_common.launch_plan import BoundLaunch, GridRule, LaunchPlan, tile_desc
from gdn_dispatch.backends.gluon_common.masks import causal_gate, store_chunk_tile
from gdn_dispatch.backends.gluon_common.recurrence import (
    gate_rows, gate_rows_of_cumsum, store_gate_vectors, walk_program)
from gdn_dispatch.backends.gluon_common.state_io import state_block, state_in, state_out
from gdn_dispatch.backends.gluon_common.state_output import state_constexprs
from gdn_dispatch.backends.gluon_common.wy import chunk_rows_ahead, chunk_rows_early, chunk_t_of_kk, gate_cumsum
from gdn_dispatch.backends.gluon_common.wy_t import first_t_slot

#: Warps: the state partition (the default; one warpgroup: one thread per row of V = 128),
#: then the workers: aux (one warpgroup), mma (one warp), load (one warp).
STATE_WARPS = 4
AUX_WARPS = gl.constexpr(4)
#: Registers asked per worker (aux, then the one-warp mma and load partitions); the state
#: partition gets the rest of the register file.
AUX_REGS = gl.constexpr(152)
WARP_REGS = gl.constexpr(24)
#: Head dims the kernel is built for.
HEAD_DIM = 128
#: The chunk inverses formed in the aux partition (:func:`_aux_inverse`, the blocked
#: inverse of the Hopper twin's :data:`..gluon_sm90.fused.AUX_T` on mma.sync), k k^T
#: issued by the MMA partition into q k^T's tensor memory, T_w and T_u written into the T
#: ring in place of the load partition's TMA loads: one launch per call, no T kernel, no
#: gate cumsum written, the inverse on the products the blocked inverse's flags choose
#: (fp16 as shipped). Compiled and checked only, as the whole kernel; off until it runs on
#: a Blackwell GPU (the Hopper twin's is on, timed there).
AUX_T = False
#: Spill bytes the :data:`AUX_T` build keeps (the default build keeps none): 24 with triton
#: 3.6.0 on fp16 products (8 on tf32: one register of the aux partition across the inverse,
#: stored and reloaded once a chunk), 132 with 3.9.0 on tf32 (the kernel's scalars stored
#: before the partitions' register reallocation and reloaded in them, as in the Hopper
#: twin), at any aux budget from 152 to 200 registers.
AUX_T_SPILL_BYTES = 192


@gluon.constexpr_function
def _tmem_f32(M, N):
    return TensorMemoryLayout(block=(min(M, 128), N), col_stride=1)


@gluon.constexpr_function
def _tmem_b16(M, N):
    """A packed 16-bit [M, N] tile in tensor memory (two elements per column): tcgen05's
    left operand."""
    return TensorMemoryLayout(block=(min(M, 128), N), col_stride=1)


# ----------------------------------------------------------------------------------------
# Partitions


@gluon.jit
def _load(k_desc, q_desc, v_desc, t_desc, kq, v_ring, t_ring, in_ready, in_empty,
          bos, NT, col_k, col_v, slot0, HV, i_h, AUX_T: gl.constexpr):
    """Chunk t's k, q, v, T_w and T_u (not with ``AUX_T``: the aux partition writes them)
    into ring slot t % 2 once the MMAs of chunk t - 2 have read it."""
    BT: gl.constexpr = k_desc.block_type.shape[0]
    if AUX_T:
        nbytes: gl.constexpr = 2 * k_desc.block_type.nbytes + v_desc.block_type.nbytes
    else:
        nbytes: gl.constexpr = 2 * k_desc.block_type.nbytes + v_desc.block_type.nbytes + 2 * t_desc.block_type.nbytes
    for t in range(NT):
        s = t % 2
        mbarrier.wait(in_empty.index(s), ((t // 2) & 1) ^ 1)
        bar = in_ready.index(s)
        row = bos + t * BT
        mbarrier.expect(bar, nbytes)
        tma_load(k_desc, [row, col_k], bar, kq.index(s))
        tma_load(q_desc, [row, col_k], bar, kq.index(2 + s))
        tma_load(v_desc, [row, col_v], bar, v_ring.index(s))
        if not AUX_T:
            base = ((slot0 + t) * HV + i_h) * (2 * BT)
            tma_load(t_desc, [base, 0], bar, t_ring.index(2 * s))
            tma_load(t_desc, [base + BT, 0], bar, t_ring.index(2 * s + 1))


@gluon.jit
def _mma_ahead(t, kq, v_ring, t_ring, qk_tmem, w_tmem, in_ready, qk_ready, qk_free, w_ready, w_free):
    """Chunk t's q k^T and the first half of T_w k (the aux partition's inputs)."""
    s = t % 2
    mbarrier.wait(in_ready.index(s), (t // 2) & 1)
    mbarrier.wait(qk_free, (t & 1) ^ 1)
    tcgen05_mma(kq.index(2 + s), kq.index(s).permute((1, 0)), qk_tmem, use_acc=False)
    tcgen05_commit(qk_ready)
    _mma_w_half(t, 0, kq, t_ring, w_tmem, w_ready, w_free)


@gluon.jit
def _mma_u(t, v_ring, t_ring, u_tmem, u_ready, u_free):
    """Chunk t's u^T = v^T T_u^T (the state partition's input), once u^T of t - 1 was read."""
    s = t % 2
    mbarrier.wait(u_free, (t & 1) ^ 1)
    tcgen05_mma(v_ring.index(s).permute((1, 0)), t_ring.index(2 * s + 1).permute((1, 0)), u_tmem, use_acc=False)
    tcgen05_commit(u_ready)


@gluon.jit
def _mma_w_half(t, H: gl.constexpr, kq, t_ring, w_tmem, w_ready, w_free):
    """Half ``H`` of chunk t's w = T_w k (w MMA number 2 t + H) into w's tensor memory,
    once the aux partition has read the previous one: the wait before w MMA n is for
    "free" number n - 1 (for the first half an odd one, none before the first chunk)."""
    HALF: gl.constexpr = w_tmem.shape[1]
    s = t % 2
    mbarrier.wait(w_free, H ^ 1)
    tcgen05_mma(t_ring.index(2 * s), kq.index(s).slice(H * HALF, HALF, dim=1), w_tmem, use_acc=False)
    tcgen05_commit(w_ready)


@gluon.jit
def _mma_chain_products(t, kq, w_ring, sb_smem, p_tmem, o1_tmem, aux_ready, sb_ready, o_free, p_ready):
    """The chain of chunk t, first half: P^T and O1^T from the staged S^T of chunk t - 1,
    once the aux slot is written (the state has read O1^T and O2^T of chunk t - 1 out of
    their tensor memory)."""
    s = t % 2
    mbarrier.wait(aux_ready.index(s), (t // 2) & 1)
    mbarrier.wait(sb_ready, t & 1)
    mbarrier.wait(o_free, (t & 1) ^ 1)
    tcgen05_mma(sb_smem, w_ring.index(s).permute((1, 0)), p_tmem, use_acc=False)
    tcgen05_mma(sb_smem, kq.index(2 + s).permute((1, 0)), o1_tmem, use_acc=False)
    tcgen05_commit(p_ready)


@gluon.jit
def _mma_chain_update(t, kq, sc_ring, s_tmem, p_tmem, vn_tmem, vs_tmem, in_empty, aux_empty, vn_ready, s_ready):
    """The chain of chunk t, second half: the update and O2^T, once v_new^T is in tensor
    memory (and S^T scaled); then ring slot t % 2 and aux slot t % 2 released when every
    MMA that reads them is done."""
    s = t % 2
    mbarrier.wait(vn_ready, t & 1)
    tcgen05_mma(vs_tmem, kq.index(s), s_tmem, use_acc=True)
    tcgen05_mma(vn_tmem, sc_ring.index(s).permute((1, 0)), p_tmem, use_acc=False)
    tcgen05_commit(s_ready)
    tcgen05_commit(in_empty.index(s))
    tcgen05_commit(aux_empty.index(s))


@gluon.jit
def _mma_kk(t, kq, qk_tmem, in_ready, qk_ready, qk_free):
    """:data:`AUX_T`: chunk t's k k^T into qk's tensor memory, for the aux partition's
    inverse: that memory's MMA number 2 t, after "free" number 2 t - 1 (the aux partition
    read chunk t - 1's q k^T; none before the first)."""
    s = t % 2
    mbarrier.wait(in_ready.index(s), (t // 2) & 1)
    mbarrier.wait(qk_free, 1)
    tcgen05_mma(kq.index(s), kq.index(s).permute((1, 0)), qk_tmem, use_acc=False)
    tcgen05_commit(qk_ready)


@gluon.jit
def _mma_after_kk(t, kq, v_ring, t_ring, qk_tmem, w_tmem, u_tmem, qk_ready, qk_free, w_ready, w_free, u_ready,
                  u_free, t_ready):
    """:data:`AUX_T`: chunk t's q k^T once the aux partition has read its k k^T (MMA 2 t + 1
    in that memory); then, once the aux partition has written the chunk's T tiles (its
    ``t_ready`` arrival number t), w's first half, u^T and w's second half."""
    s = t % 2
    mbarrier.wait(qk_free, 0)
    tcgen05_mma(kq.index(2 + s), kq.index(s).permute((1, 0)), qk_tmem, use_acc=False)
    tcgen05_commit(qk_ready)
    mbarrier.wait(t_ready, t & 1)
    _mma_w_half(t, 0, kq, t_ring, w_tmem, w_ready, w_free)
    _mma_u(t, v_ring, t_ring, u_tmem, u_ready, u_free)
    _mma_w_half(t, 1, kq, t_ring, w_tmem, w_ready, w_free)


@gluon.jit
def _mma(kq, v_ring, t_ring, w_ring, sc_ring, sb_smem, s_tmem, p_tmem, o1_tmem, u_tmem, vn_tmem,
         vs_tmem, qk_tmem, w_tmem, in_ready, in_empty, qk_ready, qk_free, w_ready, w_free, u_ready, u_free,
         aux_ready, aux_empty, sb_ready, p_ready, vn_ready, s_ready, o_free, t_ready, NT, AUX_T: gl.constexpr):
    if AUX_T:
        # Chunk t + 1's k k^T between chunk t's two chain halves (in the tensor pipe while
        # the state forms v_new), the rest of its products after the second: the wait for
        # its inverse comes when chunk t's chain is all issued.
        if NT > 0:
            _mma_kk(0, kq, qk_tmem, in_ready, qk_ready, qk_free)
            _mma_after_kk(0, kq, v_ring, t_ring, qk_tmem, w_tmem, u_tmem, qk_ready, qk_free, w_ready, w_free,
                          u_ready, u_free, t_ready)
        for t in range(NT):
            _mma_chain_products(t, kq, w_ring, sb_smem, p_tmem, o1_tmem, aux_ready, sb_ready, o_free, p_ready)
            if t + 1 < NT:
                _mma_kk(t + 1, kq, qk_tmem, in_ready, qk_ready, qk_free)
            _mma_chain_update(t, kq, sc_ring, s_tmem, p_tmem, vn_tmem, vs_tmem, in_empty, aux_empty, vn_ready,
                              s_ready)
            if t + 1 < NT:
                _mma_after_kk(t + 1, kq, v_ring, t_ring, qk_tmem, w_tmem, u_tmem, qk_ready, qk_free, w_ready,
                              w_free, u_ready, u_free, t_ready)
    else:
        if NT > 0:
            _mma_ahead(0, kq, v_ring, t_ring, qk_tmem, w_tmem, in_ready, qk_ready, qk_free, w_ready, w_free)
            _mma_u(0, v_ring, t_ring, u_tmem, u_ready, u_free)
        for t in range(NT):
            _mma_w_half(t, 1, kq, t_ring, w_tmem, w_ready, w_free)
            if t + 1 < NT:
                _mma_ahead(t + 1, kq, v_ring, t_ring, qk_tmem, w_tmem, in_ready, qk_ready, qk_free,
                           w_ready, w_free)
            _mma_chain_products(t, kq, w_ring, sb_smem, p_tmem, o1_tmem, aux_ready, sb_ready, o_free, p_ready)
            _mma_chain_update(t, kq, sc_ring, s_tmem, p_tmem, vn_tmem, vs_tmem, in_empty, aux_empty, vn_ready,
                              s_ready)
            if t + 1 < NT:
                _mma_u(t + 1, v_ring, t_ring, u_tmem, u_ready, u_free)


@gluon.jit
def _aux(w_ring, sc_ring, gate_ring, qk_tmem, w_tmem, qk_ready, qk_free, w_ready, w_free, aux_ready, aux_empty,
         g_cum, HV, i_h, bos, eos, NT):
    """Per chunk, a chunk ahead of the state: the gate rows (loaded a chunk early from
    ``g_cum``), then the aux slot (:func:`_aux_slot`)."""
    BT: gl.constexpr = qk_tmem.shape[0]
    gate_layout: gl.constexpr = gl.BlockedLayout([2], [32], [gl.num_warps()], [0])
    b_g, g_last = gate_rows(g_cum, bos, eos, i_h, HV, BT, gate_layout)
    for t in range(NT):
        s = t % 2
        phase = (t // 2) & 1
        row = bos + t * BT
        n_valid = eos - row
        g_row = b_g
        g_end = g_last
        # The next chunk's gate rows, loaded while this one is formed.
        b_g, g_last = gate_rows(g_cum, row + BT, eos, i_h, HV, BT, gate_layout)
        # Slot s is free once the MMAs of chunk t - 2 that read it are done.
        mbarrier.wait(aux_empty.index(s), phase ^ 1)
        _aux_slot(t, w_ring, sc_ring, gate_ring, qk_tmem, w_tmem, qk_ready, qk_free, w_ready, w_free, aux_ready,
                  g_row, g_end, n_valid, t & 1)


@gluon.jit
def _aux_slot(t, w_ring, sc_ring, gate_ring, qk_tmem, w_tmem, qk_ready, qk_free, w_ready, w_free, aux_ready,
              g_row, g_end, n_valid, QK_PHASE):
    """Aux slot t % 2 of chunk t (free): the gate vectors from the chunk's gate rows, the
    causal scores from q k^T (``qk_ready`` at ``QK_PHASE``) and both halves of w, each read
    out of tensor memory as it lands; then ``aux_ready``."""
    BT: gl.constexpr = qk_tmem.shape[0]
    HALF: gl.constexpr = w_tmem.shape[1]
    dtype: gl.constexpr = w_ring.dtype
    nw: gl.constexpr = gl.num_warps()
    acc_qk: gl.constexpr = tmem_reg_layout(gl.float32, [BT, BT], _tmem_f32(BT, BT), nw)
    acc_w: gl.constexpr = tmem_reg_layout(gl.float32, [BT, HALF], _tmem_f32(BT, HALF), nw)
    rows: gl.constexpr = gl.SliceLayout(1, acc_qk)
    cols: gl.constexpr = gl.SliceLayout(0, acc_qk)
    s = t % 2
    # The gate vectors the state partition reads.
    store_gate_vectors(gate_ring, s, g_row, g_end, n_valid)
    mbarrier.wait(qk_ready, QK_PHASE)
    qk = qk_tmem.load(acc_qk)
    thread_barrier()
    mbarrier.arrive(qk_free, count=1)
    sc_ring.index(s).store(causal_gate(qk, gl.convert_layout(g_row, rows), gl.convert_layout(g_row, cols)).to(dtype))
    for half in gl.static_range(2):
        mbarrier.wait(w_ready, (2 * t + half) & 1)
        w = w_tmem.load(acc_w)
        thread_barrier()
        mbarrier.arrive(w_free, count=1)
        w_ring.index(s).slice(half * HALF, HALF, dim=1).store(w.to(dtype))
    # The MMAs read the scores and w through the async proxy; the state reads the gates.
    fence_async_shared()
    thread_barrier()
    mbarrier.arrive(aux_ready.index(s), count=1)


#: k k^T on its way from tensor memory into the inverse's layout: row r's columns rotated
#: by r (mod 32), so that the tensor-memory layout's one-row-per-thread stores and the
#: inverse layout's reads spread over the banks.
_KK_STAGE = gl.constexpr(gl.SwizzledSharedLayout(1, 1, 32, order=[1, 0]))


@gluon.jit
def _aux_partition(w_ring, t_ring, sc_ring, gate_ring, qk_tmem, w_tmem, qk_ready, qk_free, w_ready, w_free, t_ready,
                   aux_ready, aux_empty, g_cum, g, s_g, beta, s_beta, HV, i_h, bos, eos, NT, AUX_T: gl.constexpr):
    """The aux partition: :func:`_aux_inverse` with :data:`AUX_T` (raw gate and beta rows,
    the T tiles formed here), else :func:`_aux` (gate rows from ``g_cum``)."""
    if AUX_T:
        _aux_inverse(w_ring, t_ring, sc_ring, gate_ring, qk_tmem, w_tmem, qk_ready, qk_free, w_ready, w_free,
                     t_ready, aux_ready, aux_empty, g, s_g, beta, s_beta, i_h, bos, eos, NT)
    else:
        _aux(w_ring, sc_ring, gate_ring, qk_tmem, w_tmem, qk_ready, qk_free, w_ready, w_free, aux_ready,
             aux_empty, g_cum, HV, i_h, bos, eos, NT)


@gluon.jit
def _aux_inverse(w_ring, t_ring, sc_ring, gate_ring, qk_tmem, w_tmem, qk_ready, qk_free, w_ready, w_free, t_ready,
                 aux_ready, aux_empty, g, s_g, beta, s_beta, i_h, bos, eos, NT):
    """:data:`AUX_T`: the aux work of :func:`_aux` plus the chunk's T tiles, which the T
    kernel would have sent. Per chunk: the raw gate and beta rows a chunk early; once the
    slot is free, k k^T out of qk's tensor memory (its first MMA of the chunk), the gate
    cumsum (kept in registers: no g_cum), A and the blocked inverse on mma.sync
    (:func:`..gluon_common.wy.chunk_t_of_kk`, its tables in the bytes of w slot s, free
    until this chunk's w), T_w and T_u into the T slot (``t_ready``, which the MMA
    partition waits for before w and u^T); then the gate vectors, scores and w as
    :func:`_aux` forms them, q k^T being that memory's second MMA of the chunk."""
    BT: gl.constexpr = qk_tmem.shape[0]
    dtype: gl.constexpr = w_ring.dtype
    nw: gl.constexpr = gl.num_warps()
    acc_qk: gl.constexpr = tmem_reg_layout(gl.float32, [BT, BT], _tmem_f32(BT, BT), nw)
    rows = chunk_rows_early(g, s_g, beta, s_beta, bos, eos - bos, i_h, BT, True)
    for t in range(NT):
        s = t % 2
        row = bos + t * BT
        n_valid = eos - row
        # The next chunk's raw rows, loaded under this chunk's inverse.
        g_raw, b_raw, rows = chunk_rows_ahead(rows, g, s_g, beta, s_beta, row, n_valid, i_h, BT)
        # Slot s (T tiles, w, scores, gates) is free once the MMAs of chunk t - 2 that read
        # it are done and the state has read its gates.
        mbarrier.wait(aux_empty.index(s), ((t // 2) & 1) ^ 1)
        mbarrier.wait(qk_ready, 0)
        kk = qk_tmem.load(acc_qk)
        thread_barrier()
        mbarrier.arrive(qk_free, count=1)
        c = gate_cumsum(g_raw)
        # Into the inverse's layout through the bytes of w slot s (a conversion in
        # registers takes 1.5 KB of scratch, past the 227 KB), which then hold its tables.
        staged = reinterpret(w_ring.index(s), gl.float32, [BT, BT], _KK_STAGE)
        staged.store(kk)
        thread_barrier()
        kk = staged.load(inverse_layout())
        thread_barrier()
        tables = reinterpret(w_ring.index(s), gl.float32, [BLOCKS * BLOCKS, BLOCK, BLOCK], table_layout())
        t_inv, w_scale, u_scale = chunk_t_of_kk(kk, c, beta, s_beta, row, n_valid, i_h, b_raw, tables, False)
        if fp16_products():
            if lost_half_range(t_inv):
                # Rare (entries of A or T past fp16's range): T in fp32 from k k^T, which
                # stays in registers across the inverse (its tensor memory holds q k^T by now).
                t_inv, w_scale, u_scale = chunk_t_of_kk(kk, c, beta, s_beta, row, n_valid, i_h, b_raw, tables,
                                                        False, None, None, True)
        t_cols: gl.constexpr = gl.SliceLayout(0, t_inv.type.layout)
        t_ring.index(2 * s).store((t_inv * gl.expand_dims(gl.convert_layout(w_scale, t_cols), 0)).to(dtype))
        t_ring.index(2 * s + 1).store((t_inv * gl.expand_dims(gl.convert_layout(u_scale, t_cols), 0)).to(dtype))
        # The MMAs read T through the async proxy; every warp is done with the tables
        # before this chunk's w overwrites their bytes.
        fence_async_shared()
        thread_barrier()
        mbarrier.arrive(t_ready, count=1)
        g_row, g_end = gate_rows_of_cumsum(c, n_valid)
        _aux_slot(t, w_ring, sc_ring, gate_ring, qk_tmem, w_tmem, qk_ready, qk_free, w_ready, w_free, aux_ready,
                  g_row, g_end, n_valid, 1)


@gluon.jit
def _state(sb_smem, o_smem, gate_ring, s_tmem, p_tmem, o1_tmem, u_tmem, vn_tmem, vs_tmem,
           aux_ready, aux_empty, u_ready, u_free, sb_ready, p_ready, vn_ready, s_ready, o_free,
           o_desc, o_rows_desc, o_ptr, row_stride, scale, bos, eos, NT, col_v,
           HAS_TAILS: gl.constexpr, ENGINE: gl.constexpr):
    BT: gl.constexpr = p_tmem.shape[1]
    BV: gl.constexpr = s_tmem.shape[0]
    K: gl.constexpr = s_tmem.shape[1]
    SLICE: gl.constexpr = 32
    dtype: gl.constexpr = sb_smem.dtype
    nw: gl.constexpr = gl.num_warps()
    acc_sl: gl.constexpr = tmem_reg_layout(gl.float32, [BV, SLICE], _tmem_f32(BV, SLICE), nw)
    vn_regs: gl.constexpr = tmem_reg_layout(dtype, [BV, SLICE], _tmem_b16(BV, SLICE), nw)
    cols_sl: gl.constexpr = gl.SliceLayout(0, acc_sl)
    one: gl.constexpr = gl.BlockedLayout([1], [32], [nw], [0])
    for t in range(NT):
        s = t % 2
        phase = (t // 2) & 1
        row = bos + t * BT
        # The state after chunk t - 1 (its update waited for below; the initial one for
        # t = 0): stage it in bf16 for this chunk's P^T and O1^T, then scale it by this
        # chunk's decay in place.
        mbarrier.wait(aux_ready.index(s), phase)
        decay = gl.max(gate_ring.index(3 * s + 2).slice(0, 1).load(one), axis=0)
        for c in gl.static_range(K // SLICE):
            part = s_tmem.slice(c * SLICE, SLICE)
            x = part.load(acc_sl)
            sb_smem.slice(c * SLICE, SLICE, dim=1).store(x.to(dtype))
            part.store(x * decay)
        fence_async_shared()
        thread_barrier()
        mbarrier.arrive(sb_ready, count=1)
        # v_new^T = u^T - P^T, and its gate-scaled copy, into tensor memory, in column
        # slices (a thread holds a whole row of each slice).
        mbarrier.wait(u_ready, t & 1)
        mbarrier.wait(p_ready, t & 1)
        for c in gl.static_range(BT // SLICE):
            b_d = gate_ring.index(3 * s).slice(c * SLICE, SLICE).load(cols_sl)
            vn = u_tmem.slice(c * SLICE, SLICE).load(acc_sl) - p_tmem.slice(c * SLICE, SLICE).load(acc_sl)
            vs_tmem.slice(c * SLICE, SLICE).store(gl.convert_layout((vn * gl.expand_dims(b_d, 0)).to(dtype), vn_regs))
            vn_tmem.slice(c * SLICE, SLICE).store(gl.convert_layout(vn.to(dtype), vn_regs))
        thread_barrier()
        mbarrier.arrive(u_free, count=1)
        mbarrier.arrive(vn_ready, count=1)
        # o = scale (2^g O1^T + O2^T)^T once the update and O2^T are done, through o_smem
        # (the previous chunk's store must have read it).
        mbarrier.wait(s_ready, t & 1)
        tma.store_wait(0)
        for c in gl.static_range(BT // SLICE):
            e_g = gate_ring.index(3 * s + 1).slice(c * SLICE, SLICE).load(cols_sl)
            o = o1_tmem.slice(c * SLICE, SLICE).load(acc_sl) * gl.expand_dims(e_g, 0) \
                + p_tmem.slice(c * SLICE, SLICE).load(acc_sl)
            o_smem.permute((1, 0)).slice(c * SLICE, SLICE, dim=1).store((o * scale).to(dtype))
        fence_async_shared()
        thread_barrier()
        # O1^T, O2^T and the slot's gates are read: the MMA partition may reuse their
        # tensor memory, the aux partition the slot (its other arrival: the MMAs done).
        mbarrier.arrive(o_free, count=1)
        mbarrier.arrive(aux_empty.index(s), count=1)
        store_chunk_tile(o_desc, o_rows_desc, o_ptr, row_stride, o_smem, row, col_v, eos - row, HAS_TAILS, ENGINE)
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["HV", "GROUP", "pool_size", "s_g", "s_beta"])
def _fused_fwd_kernel(
    q_desc, k_desc, v_desc, t_desc, o_desc, o_rows_desc, o_ptr, g_cum, g, beta, h0, ht, state_indices, cu_seqlens,
    scale, HV, GROUP, pool_size, s_g, s_beta,
    USE_H0: gl.constexpr, STORE_HT: gl.constexpr, STATE_VK: gl.constexpr, HAS_TAILS: gl.constexpr,
    USE_POOL: gl.constexpr, INPLACE: gl.constexpr, ENGINE: gl.constexpr, AUX_T: gl.constexpr,
):
    BT: gl.constexpr = k_desc.block_type.shape[0]
    K: gl.constexpr = k_desc.block_type.shape[1]
    V: gl.constexpr = v_desc.block_type.shape[1]
    HALF: gl.constexpr = BT
    dtype: gl.constexpr = k_desc.dtype
    gl.static_assert(K == 2 * HALF and V == 128, "built for K = V = 128")
    i_n, i_nh, i_h, i_v, bos, eos, NT, col_w, col_k, col_v = walk_program(cu_seqlens, HV, GROUP, K, V, V, BT, True)
    block = state_block(state_indices, i_n, i_h, HV, pool_size, USE_POOL)
    slot0 = first_t_slot(bos, i_n, BT, HAS_TAILS)

    # k (slots 0, 1) and q (slots 2, 3) in one allocation: its 64 KB stage the state in
    # and out (state_io).
    kq = gl.allocate_shared_memory(dtype, [4, BT, K], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [2, BT, V], v_desc.layout)
    if AUX_T:
        # T_w and T_u written by the aux partition (no T kernel, no t_desc).
        t_ring = gl.allocate_shared_memory(dtype, [4, BT, BT], E.smem_layout([BT, BT], dtype))
    else:
        t_ring = gl.allocate_shared_memory(dtype, [4, BT, BT], t_desc.layout)
    w_ring = gl.allocate_shared_memory(dtype, [2, BT, K], k_desc.layout)
    sc_ring = gl.allocate_shared_memory(dtype, [2, BT, BT], E.smem_layout([BT, BT], dtype))
    sb_smem = gl.allocate_shared_memory(dtype, [V, K], E.smem_layout([V, K], dtype))
    o_smem = gl.allocate_shared_memory(dtype, [BT, V], o_desc.layout)
    gate_ring = gl.allocate_shared_memory(gl.float32, [6, BT], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))

    s_tmem = allocate_tensor_memory(gl.float32, [V, K], _tmem_f32(V, K))
    p_tmem = allocate_tensor_memory(gl.float32, [V, BT], _tmem_f32(V, BT))
    o1_tmem = allocate_tensor_memory(gl.float32, [V, BT], _tmem_f32(V, BT))
    u_tmem = allocate_tensor_memory(gl.float32, [V, BT], _tmem_f32(V, BT))
    vn_tmem = allocate_tensor_memory(dtype, [V, BT], _tmem_b16(V, BT))
    vs_tmem = allocate_tensor_memory(dtype, [V, BT], _tmem_b16(V, BT))
    qk_tmem = allocate_tensor_memory(gl.float32, [BT, BT], _tmem_f32(BT, BT))
    w_tmem = allocate_tensor_memory(gl.float32, [BT, HALF], _tmem_f32(BT, HALF))

    in_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    in_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    aux_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    aux_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    one_bars = gl.allocate_shared_memory(gl.int64, [12, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(in_ready.index(i), count=1)
        mbarrier.init(in_empty.index(i), count=1)
        mbarrier.init(aux_ready.index(i), count=1)
        # Two arrivals: the MMAs that read the slot's w and scores (a commit), and the
        # state partition once it has read the slot's gates.
        mbarrier.init(aux_empty.index(i), count=2)
    for i in gl.static_range(12):
        mbarrier.init(one_bars.index(i), count=1)
    qk_ready = one_bars.index(0)
    qk_free = one_bars.index(1)
    w_ready = one_bars.index(2)
    w_free = one_bars.index(3)
    u_ready = one_bars.index(4)
    u_free = one_bars.index(5)
    sb_ready = one_bars.index(6)
    p_ready = one_bars.index(7)
    vn_ready = one_bars.index(8)
    s_ready = one_bars.index(9)
    o_free = one_bars.index(10)
    # AUX_T: the aux partition's T tiles of a chunk written (one arrival per chunk).
    t_ready = one_bars.index(11)

    # S^T [V, K] into tensor memory, staged through the idle k/q bytes.
    acc_s: gl.constexpr = tmem_reg_layout(gl.float32, [V, K], _tmem_f32(V, K), gl.num_warps())
    if USE_H0:
        S = state_in(h0, kq, block, 0, K, V, V, STATE_VK, USE_POOL, acc_s, True)
    else:
        S = gl.zeros([V, K], gl.float32, acc_s)
    s_tmem.store(S)
    # The staging reads precede the loader's TMA writes into the same bytes.
    fence_async_shared()
    thread_barrier()

    gl.warp_specialize([
        (_state, (sb_smem, o_smem, gate_ring, s_tmem, p_tmem, o1_tmem, u_tmem, vn_tmem, vs_tmem,
                  aux_ready, aux_empty, u_ready, u_free, sb_ready, p_ready, vn_ready, s_ready, o_free,
                  o_desc, o_rows_desc, o_ptr, HV * V, scale, bos, eos, NT, col_v, HAS_TAILS, ENGINE)),
        (_aux_partition, (w_ring, t_ring, sc_ring, gate_ring, qk_tmem, w_tmem, qk_ready, qk_free, w_ready, w_free,
                          t_ready, aux_ready, aux_empty, g_cum, g, s_g, beta, s_beta, HV, i_h, bos, eos, NT,
                          AUX_T)),
        (_mma, (kq, v_ring, t_ring, w_ring, sc_ring, sb_smem, s_tmem, p_tmem, o1_tmem, u_tmem, vn_tmem,
                vs_tmem, qk_tmem, w_tmem, in_ready, in_empty, qk_ready, qk_free, w_ready, w_free, u_ready,
                u_free, aux_ready, aux_empty, sb_ready, p_ready, vn_ready, s_ready, o_free, t_ready, NT, AUX_T)),
        (_load, (k_desc, q_desc, v_desc, t_desc, kq, v_ring, t_ring, in_ready, in_empty,
                 bos, NT, col_k, col_v, slot0, HV, i_h, AUX_T)),
    ], [AUX_WARPS, 1, 1], [AUX_REGS, WARP_REGS, WARP_REGS])

    if STORE_HT or INPLACE:
        # The last update is complete: the state partition waited for it before its last
        # output. The program's indices again rather than kept live across the partitions.
        i_n, i_nh, i_h, i_v, bos, eos, NT, col_w, col_k, col_v = walk_program(cu_seqlens, HV, GROUP, K, V, V, BT, True)
        block = state_block(state_indices, i_n, i_h, HV, pool_size, USE_POOL)
        state_out(ht, i_nh, h0, block, 0, s_tmem.load(acc_s), kq, K, V, V, STATE_VK, STORE_HT, INPLACE, True)


# ----------------------------------------------------------------------------------------
# Host side: plan (dry run), AOT list


def plan_fused(problem: GDNProblem, device, *, engine) -> BoundLaunch:
    """Launch plan of the kernel for ``problem`` (a dry run): one program per (sequence,
    v-head); the state warpgroup plus the aux warpgroup, the MMA warp and the load warp."""
    H, HV, K, V, dtype = problem.H, problem.HV, problem.K, problem.V, problem.dtype
    BT = CHUNK_SIZE
    constexprs = {name: value for name, value in state_constexprs(problem, engine).items() if name != "USE_L2NORM"}
    constexprs["AUX_T"] = AUX_T
    descriptors = (
        tile_desc("q_desc", "q", dtype, H * K, (BT, K), token_rows=True),
        tile_desc("k_desc", "k", dtype, H * K, (BT, K), token_rows=True),
        tile_desc("v_desc", "v", dtype, HV * V, (BT, V), token_rows=True),
        tile_desc("t_desc", "t", dtype, BT, (BT, BT)),
        tile_desc("o_desc", "o", dtype, HV * V, (BT, V)),
        tile_desc("o_rows_desc", "o", dtype, HV * V, (1, V), scatter=True),
    )
    if AUX_T:
        # No T tiles to read: the descriptor goes to the kernel as a None constexpr.
        descriptors = tuple(d for d in descriptors if d.arg != "t_desc")
        constexprs["t_desc"] = None
    launch = LaunchPlan(
        kernel="fused_fwd",
        grid_rule=GridRule(per_seq=1, times=HV),
        num_warps=STATE_WARPS,
        blocks={"BT": BT, "K": K, "V": V, "smem_bytes": fused_smem_bytes(K, V, torch.finfo(dtype).bits // 8),
                "tmem_columns": TMEM_COLUMNS},
        constexprs=constexprs,
        descriptors=descriptors,
        scalars={"HV": HV, "GROUP": HV // H},
        notes=(f"N x {HV} (sequence, v-head) programs, warp-specialized: state 1 warpgroup + aux 1 + mma + load warps"
               + ("; the chunk inverses formed in the aux partition" if AUX_T else "")),
    )
    return launch.bind(problem.B * problem.T, problem.N)


#: Tensor-memory columns the kernel allocates (module docstring).
TMEM_COLUMNS = 512


def fused_smem_bytes(K: int, V: int, elem: int, BT: int = CHUNK_SIZE) -> int:
    """Shared memory: k/q (2 slots each), v (2), T (2 x 2 tiles), w and scores (2), the
    staged S^T, o, the gate vectors and the barriers."""
    return (4 * BT * K + 2 * BT * V + 4 * BT * BT + 2 * BT * K + 2 * BT * BT + V * K + BT * V) * elem \
        + 6 * BT * 4 + 20 * 8


def fused_kernels_for_aot(capability: tuple[int, int], backend: str, *, engine) -> list[AotKernel]:
    """The kernel at the specializations its Hopper twin is built in: bf16/fp16 x tails or
    not x "kv"/"vk" with a float32 initial and final state; without either; a float32 pool
    in place; int64 cu_seqlens."""
    cases = core_cases() + [{**BASE_CASE, "h0": False, "ht": False}, {**BASE_CASE, "pool": True, "inplace": True},
                            {**BASE_CASE, "cu_dtype": torch.int64}]
    return fused_aot_kernels(cases, capability, backend, engine=engine, plan_fused=plan_fused, fn=_fused_fwd_kernel,
                             spill_bytes_allowed=AUX_T_SPILL_BYTES if AUX_T else 0)
