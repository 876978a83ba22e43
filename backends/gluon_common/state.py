"""Stage 4 on the matrix engine: the chunk-state recurrence, the one serial stage.

Per (sequence, v-head, V-block of BV columns), with S the fp32 [K, BV] state at a chunk's
start and g the chunk-local gate cumsum in log2 units::

    h_t = S                                   (stored, q's dtype, for the output stage)
    v_new = u - w h_t                         (stored, q's dtype, for the output stage)
    S = 2^g_last S + k^T (2^(g_last - g) v_new)

One program walks its sequence's chunks in order. Where the data lives:

* S: TMEM (sm_100a; ``K`` lanes x ``BV`` columns) or wgmma registers (sm_90a). Each chunk
  reads it to registers once: the 16-bit copy goes to ``h_smem`` (B operand of w h_t and
  the TMA store of h_t), the decayed copy ``2^g_last S`` is written back as the accumulator
  that ``k^T vs`` is added to (``use_acc=True``).
* ``w h_t``: a second accumulator ``P`` [64, BV] (TMEM on sm_100a), overwritten each chunk.
* w, u, k tiles: double-buffered shared memory filled by TMA. Chunk t + 1's loads are
  issued at the top of chunk t, so they land while chunk t computes. Each stream has its own
  ready barrier per slot (``w_ready``, ``u_ready``, ``k_ready``): w is needed first, then u,
  then k, and each wait only covers its own bytes.

Phase bookkeeping, written once: chunk ``t`` uses slot ``buf = t % 2``; each ready barrier
of a slot completes once per use of the slot, so chunk t waits ``(t // 2) & 1``; the two MMA
barriers (``p_bar``: w h_t, ``s_bar``: k^T vs) complete once per chunk, so chunk t waits
``t & 1``. No "empty" barriers: a slot is refilled at the top of chunk t + 1 only after every
reader of chunk t - 1 finished (both MMAs waited; the register reads of u and k precede the
fence + CTA barrier in front of chunk t - 1's second MMA).

TMA stores (h_t, then v_new_t, per chunk): the ``store_wait(0)`` before ``h_smem`` is
rewritten at chunk t also covers ``vn_smem``, rewritten later in the same chunk: every store
of chunk t - 1 has read its tile by then (they had a whole MMA to run, so it rarely waits).
Waiting for all, not "all but one", stays right however the compiler splits a wide store
over issuing threads (it does split [64, 128] tiles over two warps).

Rows past a sequence's end (its last chunk only): the TMA tiles hold the next sequence's
rows there. They reach v_new's rows past the end, which are never written (TMA scatter with
row 0x7FFFFFFF on sm_100a, masked stores on sm_90a, see :mod:`.masks`), and they must not
reach S: the scaled ``vs`` rows past the end are *selected* to 0, which removes w's and u's
rows (they only enter through v_new) and multiplies k's rows past the end by 0.

qk l2 norm: w arrives normalized from stage 3; k's row norms ``r`` are folded into the row
scale of vs (``k_n^T vs = k^T (r vs)``), so k is never rewritten.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from gdn_dispatch.aot import AotKernel
from gdn_dispatch.varlen import ChunkTable

from gdn_dispatch.backends.gluon_common import engine as E
from gdn_dispatch.backends.gluon_common.compat import HAS_PUBLIC_REINTERPRET, thread_barrier, tma_load, tma_store
from gdn_dispatch.backends.gluon_common.launch import launch_planned
from gdn_dispatch.backends.gluon_common.masks import row_rnorm, store_chunk_tile, tile_layout
from gdn_dispatch.backends.gluon_common.plan import LaunchPlan, MAX_STATE_TILE, plan_state, sig_dtype

#: Slots of the w / u / k rings: chunk t computes while chunk t + 1 lands.
NUM_BUF = gl.constexpr(2)


@gluon.constexpr_function
def _io_layout(rows, cols, num_warps):
    """Coalesced fp32 register layout of a [rows, cols] state tile: 16-byte vectors along
    the contiguous columns."""
    tpc = min(32, max(cols // 4, 1))
    return gl.BlockedLayout([1, 4], [32 // tpc, tpc], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _staging_layout():
    """Shared layout of the fp32 state staging tile (read back transposed for "vk")."""
    return gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])


@gluon.jit
def _tile_offsets(R: gl.constexpr, C: gl.constexpr, stride, r0, c0, layout: gl.constexpr):
    """``(r0 + r) * stride + c0 + c`` over an [R, C] tile in ``layout``."""
    r = gl.arange(0, R, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, C, layout=gl.SliceLayout(0, layout))
    return gl.expand_dims((r0 + r) * stride, 1) + gl.expand_dims(c0 + c, 0)


@gluon.jit
def _staging(ring, rows: gl.constexpr, cols: gl.constexpr):
    """An fp32 [rows, cols] view of the w/k ring's bytes, for moving a state tile between
    layouts while the ring is idle (rows * cols * 4 <= the ring's bytes: BV <= 128)."""
    if HAS_PUBLIC_REINTERPRET:
        view = ring.reinterpret(gl.float32, [rows, cols], _staging_layout())
    else:
        view = ring._reinterpret(gl.float32, [rows, cols], _staging_layout())
    return view


@gluon.jit
def _state_in(h0, ring, i_nh, i_v, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
              STATE_VK: gl.constexpr, layout: gl.constexpr):
    """The initial state's [K, BV] tile (columns ``i_v * BV ...``) of (sequence, v-head)
    ``i_nh`` as fp32 in ``layout``, staged through the idle ``ring``. "vk" tiles are read
    coalesced as [BV, K] and read back through a transposed view (no transpose kernel)."""
    base = h0 + i_nh.to(gl.int64) * (K * V)
    if STATE_VK:
        io_vk: gl.constexpr = _io_layout(BV, K, gl.num_warps())
        stage = _staging(ring, BV, K)
        stage.store(gl.load(base + _tile_offsets(BV, K, K, i_v * BV, 0, io_vk)).to(gl.float32))
        s = stage.permute((1, 0)).load(layout)
    else:
        io_kv: gl.constexpr = _io_layout(K, BV, gl.num_warps())
        stage = _staging(ring, K, BV)
        stage.store(gl.load(base + _tile_offsets(K, BV, V, 0, i_v * BV, io_kv)).to(gl.float32))
        s = stage.load(layout)
    return s


@gluon.jit
def _state_out(ht, s, ring, i_nh, i_v, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
               STATE_VK: gl.constexpr):
    """Write the fp32 [K, BV] register tile ``s`` into the final state in its layout,
    staged through the idle ``ring`` (the mirror of :func:`_state_in`)."""
    base = ht + i_nh.to(gl.int64) * (K * V)
    if STATE_VK:
        stage = _staging(ring, BV, K)
        stage.permute((1, 0)).store(s)
        io_vk: gl.constexpr = _io_layout(BV, K, gl.num_warps())
        gl.store(base + _tile_offsets(BV, K, K, i_v * BV, 0, io_vk), stage.load(io_vk))
    else:
        stage = _staging(ring, K, BV)
        stage.store(s)
        io_kv: gl.constexpr = _io_layout(K, BV, gl.num_warps())
        gl.store(base + _tile_offsets(K, BV, V, 0, i_v * BV, io_kv), stage.load(io_kv))


@gluon.jit
def _walk_program(cu_seqlens, HV, GROUP, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr, BT: gl.constexpr):
    """This program's walk: (sequence ``i_n``, ``i_nh`` = i_n * HV + v-head, v-head ``i_h``,
    V-block ``i_v``), its sequence's rows ``bos .. eos`` and chunk count, and the tile
    columns of its w, k (q/k head ``i_h // GROUP``) and u / v blocks.

    Axis 0 is (sequence, v-head, V-block) with the V-block fastest: the V-blocks of one
    head stream the same w and k tiles at the same time, so L2 serves all but the first.
    """
    pid = gl.program_id(0)
    i_v = pid % (V // BV)
    i_nh = pid // (V // BV)
    i_n = i_nh // HV
    i_h = i_nh % HV
    bos = gl.load(cu_seqlens + i_n)
    eos = gl.load(cu_seqlens + i_n + 1)
    NT = gl.cdiv(eos - bos, BT)
    return i_n, i_nh, i_h, i_v, bos, eos, NT, i_h * K, (i_h // GROUP) * K, i_h * V + i_v * BV


@gluon.jit
def _state_init(S, h0, ring, i_nh, i_v, K: gl.constexpr, V: gl.constexpr, BV: gl.constexpr,
                STATE_VK: gl.constexpr, USE_H0: gl.constexpr, IS_SM100: gl.constexpr):
    """Write the initial state's [K, BV] tile (zeros without one) into the accumulator ``S``,
    staged through the idle ``ring`` (:func:`_state_in`); returns ``S``."""
    s_layout: gl.constexpr = E.acc_layout(K, BV, IS_SM100, gl.num_warps())
    if USE_H0:
        s0 = _state_in(h0, ring, i_nh, i_v, K, V, BV, STATE_VK, s_layout)
        # The staging reads (generic proxy) must precede chunk 0's TMA writes into the same
        # bytes (async proxy), in every thread, before the one issuing thread starts them.
        fence_async_shared()
        thread_barrier()
    else:
        s0 = gl.zeros([K, BV], gl.float32, layout=s_layout)
    return E.acc_write(S, s0, IS_SM100)


@gluon.jit
def _state_load(w_desc, u_desc, k_desc, wk_smem, u_smem, w_ready, u_ready, k_ready,
                buf, row, col_w, col_k, col_v, pred):
    """Issue the TMA loads of one chunk's w [BT, K], u [BT, BV] and k [BT, K] tiles into ring
    slot ``buf`` (w: ``wk_smem[2 buf]``, k: ``wk_smem[2 buf + 1]``), each completing on its
    own ready barrier (skipped when not ``pred``)."""
    mbarrier.expect(w_ready.index(buf), w_desc.block_type.nbytes, pred=pred)
    tma_load(w_desc, [row, col_w], w_ready.index(buf), wk_smem.index(2 * buf), pred=pred)
    mbarrier.expect(u_ready.index(buf), u_desc.block_type.nbytes, pred=pred)
    tma_load(u_desc, [row, col_v], u_ready.index(buf), u_smem.index(buf), pred=pred)
    mbarrier.expect(k_ready.index(buf), k_desc.block_type.nbytes, pred=pred)
    tma_load(k_desc, [row, col_k], k_ready.index(buf), wk_smem.index(2 * buf + 1), pred=pred)


@gluon.jit
def _gate_rows(g_cum, row, eos, i_h, HV, BT: gl.constexpr, row_layout: gl.constexpr):
    """One chunk's gate cumsum rows ``b_g`` (0 past the sequence's end; rows in
    ``row_layout``) and its last valid row's ``g_last``, as loaded from ``g_cum``. Both
    loads are plain global loads, so a caller may issue them a chunk early."""
    rows = row + gl.arange(0, BT, layout=row_layout)
    b_g = gl.load(g_cum + rows.to(gl.int64) * HV + i_h, mask=rows < eos, other=0.0)
    g_last = gl.load(g_cum + (gl.minimum(row + BT, eos) - 1).to(gl.int64) * HV + i_h)
    return b_g, g_last


@gluon.jit
def _gate_decays(b_g, g_last, row, eos, BT: gl.constexpr):
    """Row mask, per-row decay ``2^(g_last - g)`` (0 past the sequence's end) and the
    chunk decay ``2^g_last`` of one chunk from its :func:`_gate_rows`."""
    rows = row + gl.arange(0, BT, layout=b_g.type.layout)
    m_t = rows < eos
    # where(), not a multiply by the mask: past the end b_g is 0 and 2^g_last may be tiny
    # or the row may hold anything; the row must contribute exactly nothing.
    b_d = gl.where(m_t, gl.exp2(g_last - b_g), 0.0)
    return m_t, b_d, gl.exp2(g_last)


@gluon.jit
def _state_gates(g_cum, row, eos, i_h, HV, BT: gl.constexpr, row_layout: gl.constexpr):
    """:func:`_gate_decays` of the chunk at ``row``, loaded now."""
    b_g, g_last = _gate_rows(g_cum, row, eos, i_h, HV, BT, row_layout)
    return _gate_decays(b_g, g_last, row, eos, BT)


@gluon.jit
def _state_vs(v, b_d, m_t, k_tile, USE_L2NORM: gl.constexpr):
    """The B operand of the state update: ``r * 2^(g_last - g) * v_new`` per row, rows past
    the sequence's end selected to 0 (``r``: k's row-norm reciprocals with the l2 norm)."""
    if USE_L2NORM:
        BT: gl.constexpr = k_tile.shape[0]
        K: gl.constexpr = k_tile.shape[1]
        r = row_rnorm(k_tile, tile_layout(BT, K, gl.num_warps()))
        b_d = b_d * gl.convert_layout(r, b_d.type.layout)
    return gl.where(gl.expand_dims(m_t, 1), v * gl.expand_dims(b_d, 1), 0.0)


@gluon.jit(do_not_specialize=["HV", "GROUP"])
def _state_fwd_kernel(
    w_desc, u_desc, k_desc, h_desc, vn_desc, vn_rows_desc,
    v_new, g_cum, h0, ht, cu_seqlens, seq_chunk_start, HV, GROUP,
    V: gl.constexpr, USE_H0: gl.constexpr, STORE_HT: gl.constexpr, STATE_VK: gl.constexpr,
    USE_L2NORM: gl.constexpr, HAS_TAILS: gl.constexpr, IS_SM100: gl.constexpr,
):
    BT: gl.constexpr = w_desc.block_type.shape[0]
    K: gl.constexpr = w_desc.block_type.shape[1]
    BV: gl.constexpr = u_desc.block_type.shape[1]
    dtype: gl.constexpr = w_desc.dtype
    p_layout: gl.constexpr = E.acc_layout(BT, BV, IS_SM100, gl.num_warps())
    row_layout: gl.constexpr = gl.SliceLayout(1, p_layout)
    i_n, i_nh, i_h, i_v, bos, eos, NT, col_w, col_k, col_v = _walk_program(cu_seqlens, HV, GROUP, K, V, BV, BT)
    i_c0 = gl.load(seq_chunk_start + i_n)

    # w and k share one ring allocation (same tile shape and layout), so that its bytes can
    # stage the fp32 state tile in and out while no chunk is in flight.
    wk_smem = gl.allocate_shared_memory(dtype, [2 * NUM_BUF, BT, K], w_desc.layout)
    u_smem = gl.allocate_shared_memory(dtype, [NUM_BUF, BT, BV], u_desc.layout)
    h_smem = gl.allocate_shared_memory(dtype, [K, BV], h_desc.layout)
    vn_smem = gl.allocate_shared_memory(dtype, [BT, BV], vn_desc.layout)
    vs_smem = gl.allocate_shared_memory(dtype, [BT, BV], vn_desc.layout)
    w_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    u_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    p_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    s_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(w_ready.index(i), count=1)
        mbarrier.init(u_ready.index(i), count=1)
        mbarrier.init(k_ready.index(i), count=1)
    mbarrier.init(p_bar, count=1)
    mbarrier.init(s_bar, count=1)

    S = _state_init(E.acc_alloc(K, BV, IS_SM100), h0, wk_smem, i_nh, i_v, K, V, BV, STATE_VK, USE_H0, IS_SM100)
    P = E.acc_alloc(BT, BV, IS_SM100)
    _state_load(w_desc, u_desc, k_desc, wk_smem, u_smem, w_ready, u_ready, k_ready,
                0, bos, col_w, col_k, col_v, NT > 0)

    for t in range(NT):
        buf = t % NUM_BUF
        ready_phase = (t // NUM_BUF) & 1
        mma_phase = t & 1
        row = bos + t * BT
        # Refill the other slot with chunk t + 1 (see the module docstring for why it is free).
        _state_load(w_desc, u_desc, k_desc, wk_smem, u_smem, w_ready, u_ready, k_ready,
                    1 - buf, row + BT, col_w, col_k, col_v, t + 1 < NT)
        m_t, b_d, decay = _state_gates(g_cum, row, eos, i_h, HV, BT, row_layout)

        # h_t -> h_smem: B operand of w h_t, and stored for the output stage.
        s_reg = E.acc_read(S, IS_SM100)
        tma.store_wait(0)  # chunk t-1's stores have read h_smem and vn_smem
        h_smem.store(s_reg.to(dtype))
        fence_async_shared()  # generic writes -> MMA and TMA reads (async proxy)
        mbarrier.wait(w_ready.index(buf), ready_phase)
        p = E.mma(wk_smem.index(2 * buf), h_smem, P, False, p_bar, IS_SM100)
        tma_store(h_desc, [((i_c0 + t) * HV + i_h) * K, i_v * BV], h_smem)
        # The decayed state becomes the accumulator of k^T vs (overlaps the w h_t MMA).
        S = E.acc_write(S, s_reg * decay, IS_SM100)
        p = E.mma_wait(p, p_bar, mma_phase, IS_SM100)

        # v_new = u - w h_t -> vn_smem -> global (rows past the end dropped).
        mbarrier.wait(u_ready.index(buf), ready_phase)
        b_v = u_smem.index(buf).load(p_layout).to(gl.float32) - E.acc_read(p, IS_SM100)
        vn_smem.store(b_v.to(dtype))
        fence_async_shared()
        store_chunk_tile(vn_desc, vn_rows_desc, v_new, HV * V, vn_smem, row, col_v, eos - row,
                         HAS_TAILS, IS_SM100)

        # S = 2^g_last S + k^T vs
        mbarrier.wait(k_ready.index(buf), ready_phase)
        k_tile = wk_smem.index(2 * buf + 1)
        vs = _state_vs(b_v, b_d, m_t, k_tile, USE_L2NORM)
        vs_smem.store(vs.to(dtype))
        # Orders the vs writes *and* this chunk's register reads of u / k before the MMA and
        # before the TMA refill of this slot two chunks on (both async proxy).
        fence_async_shared()
        S = E.mma(k_tile.permute((1, 0)), vs_smem, S, True, s_bar, IS_SM100)
        S = E.mma_wait(S, s_bar, mma_phase, IS_SM100)

    if STORE_HT:
        # The ring is idle: every load landed and every MMA reading it was waited on.
        _state_out(ht, E.acc_read(S, IS_SM100), wk_smem, i_nh, i_v, K, V, BV, STATE_VK)
    tma.store_wait(0)  # shared memory must outlive the bulk stores reading it
    for i in gl.static_range(NUM_BUF):
        mbarrier.invalidate(w_ready.index(i))
        mbarrier.invalidate(u_ready.index(i))
        mbarrier.invalidate(k_ready.index(i))
    mbarrier.invalidate(p_bar)
    mbarrier.invalidate(s_bar)


# ---------------------------------------------------------------------------------------
# Host side


def _pointer_signature(dtype: torch.dtype) -> dict:
    return {"v_new": f"*{sig_dtype(dtype)}", "g_cum": "*fp32", "h0": "*fp32", "ht": "*fp32",
            "cu_seqlens": "*i32", "seq_chunk_start": "*i32", "HV": "i32", "GROUP": "i32"}


def state_signature(launch: LaunchPlan, dtype: torch.dtype) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of ``_state_fwd_kernel`` for ``launch``, in argument
    order, as a launch of it would specialize (16-byte-aligned pointers)."""
    names = _state_fwd_kernel.arg_names
    constexprs = {"V": launch.scalars["V"], **launch.constexprs}
    sig = {d.arg: d.signature for d in launch.descriptors}
    sig.update(_pointer_signature(dtype))
    sig.update({name: "constexpr" for name in constexprs})
    signature = {name: sig[name] for name in names}
    pointers = ("v_new", "g_cum", "h0", "ht", "cu_seqlens", "seq_chunk_start")
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in pointers}
    return signature, constexprs, attrs


def state_aot_kernel(backend: str, launch: LaunchPlan, dtype: torch.dtype, tag: str) -> AotKernel:
    """The AotKernel that compiles exactly what ``state_fwd`` launches for ``launch``."""
    signature, constexprs, attrs = state_signature(launch, dtype)
    return AotKernel(backend=backend, kernel="state_fwd", specialization=tag, fn=_state_fwd_kernel,
                     signature=signature, constexprs=constexprs, dialect="gluon",
                     num_warps=launch.num_warps, attrs=attrs, maxnreg=launch.maxnreg)


def state_fwd(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g_cum: torch.Tensor,
    chunks: ChunkTable,
    launch: LaunchPlan,
    *,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Run the recurrence over every sequence's chunks (one launch).

    Parameters
    ----------
    k : Tensor ``[B, T, H, K]``, bf16/fp16, contiguous (raw: with the qk l2 norm the kernel
        applies k's row norms itself).
    w : Tensor ``[B, T, HV, K]``, k's dtype (stage 3; from l2-normalized k when asked).
    u : Tensor ``[B, T, HV, V]``, k's dtype (stage 3).
    g_cum : float32 Tensor ``[B, T, HV]``, chunk-local gate cumsum in log2 units.
    chunks : ChunkTable of the call.
    launch : the ``state_fwd`` LaunchPlan of :func:`gdn_dispatch.backends.gluon_common.plan.plan_state`
        (grid, BV, constexprs incl. the state layout, descriptors).
    initial_state : Tensor ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk", as the
        plan's ``STATE_VK``), any float dtype (read as float32), contiguous; None: zeros.
    output_final_state : also return the state after each sequence's last token.

    Returns
    -------
    h : Tensor ``[NT, HV, K, V]``, k's dtype: the state at the start of every chunk (flat
        chunk order of the ChunkTable), always [K, V].
    v_new : Tensor ``[B, T, HV, V]``, k's dtype: ``u - w h``.
    final_state : float32 Tensor in the plan's layout, or None. A zero-length sequence's
        final state is its initial state (zeros without one).
    """
    B_T, HV, K, V = u.shape[0] * u.shape[1], u.shape[-2], k.shape[-1], u.shape[-1]
    N, NT = chunks.num_seqs, chunks.num_chunks
    vk = launch.constexprs["STATE_VK"]
    h = torch.empty(NT, HV, K, V, dtype=k.dtype, device=k.device)
    v_new = torch.empty_like(u)
    final_state = None
    if output_final_state:
        final_state = torch.empty((N, HV, V, K) if vk else (N, HV, K, V), dtype=torch.float32, device=k.device)
    h0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    if NT == 0 or B_T == 0 or N * HV == 0:
        # Nothing to walk (every sequence is empty): the final state is the initial one.
        if final_state is not None:
            final_state.copy_(h0) if h0 is not None else final_state.zero_()
        return h, v_new, final_state
    tensors = {"w": w, "u": u, "k": k, "h": h, "v_new": v_new}
    launch_planned(_state_fwd_kernel, launch, tensors, dict(
        v_new=v_new, g_cum=g_cum,
        h0=h0 if h0 is not None else g_cum, ht=final_state if final_state is not None else g_cum,
        cu_seqlens=chunks.cu_seqlens, seq_chunk_start=chunks.seq_chunk_start,
        HV=launch.scalars["HV"], GROUP=launch.scalars["GROUP"], V=launch.scalars["V"],
    ))
    return h, v_new, final_state


def _aot_problem(K: int, V: int, dtype: torch.dtype, tails: bool, vk: bool, h0: bool, ht: bool, l2: bool):
    """A tiny CPU problem whose plan has the asked flags (only shapes and flags matter)."""
    from gdn_dispatch.testing import random_problem

    shape = dict(lengths=[64, 65]) if tails else dict(batch=(2, 128))
    return random_problem(**shape, H=2, HV=4, K=K, V=V, dtype=dtype, layout="vk" if vk else "kv", h0=h0, ht=ht,
                          l2=l2)


def state_kernels_for_aot(capability: tuple[int, int], backend: str) -> list[AotKernel]:
    """The state kernel at every specialization it can launch on ``capability``.

    Every (K, V) in {64, 128}^2 at every V-block it can launch with, x bf16/fp16 x varlen
    tails or not x "kv"/"vk" (with initial and final state and the l2 norm: the Qwen3.5
    call); then K = V = 128 / BV = 64 with the remaining flags off one at a time (no initial
    or final state, no l2 norm).
    """
    from gdn_dispatch.device import assumed_device

    device = assumed_device(f"sm_{capability[0]}{capability[1]}")
    base = dict(dtype=torch.bfloat16, tails=True, vk=False, h0=True, ht=True, l2=True)
    cases = []
    for K in (64, 128):
        for V in (64, 128):
            for BV in (32, 64, 128):
                if BV > V or K * BV > MAX_STATE_TILE:
                    continue
                for dtype in (torch.bfloat16, torch.float16):
                    for tails in (True, False):
                        for vk in (False, True):
                            cases.append((K, V, BV, {**base, "dtype": dtype, "tails": tails, "vk": vk}))
    for flip in (dict(h0=False, ht=False), dict(h0=True, ht=False), dict(h0=False, ht=True), dict(l2=False)):
        cases.append((128, 128, 64, {**base, **flip}))
    kernels = []
    for K, V, BV, flags in cases:
        launch = plan_state(_aot_problem(K, V, **flags), device, block_v=BV)
        tag = (f"K{K}-V{V}-BV{BV}-{sig_dtype(flags['dtype'])}-{'tails' if flags['tails'] else 'full'}-"
               f"{'vk' if flags['vk'] else 'kv'}{'-h0' if flags['h0'] else ''}{'-ht' if flags['ht'] else ''}"
               f"{'-l2' if flags['l2'] else ''}")
        kernels.append(state_aot_kernel(backend, launch, flags["dtype"], tag))
    return kernels
