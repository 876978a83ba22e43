"""Stage 5 on the matrix engine: the output of every chunk from its start state and its
own tokens,

    o = scale * (2^g (q h) + causal(q k^T 2^(g_i - g_j)) v_new)

One program owns one (chunk, v-head, BV slice of V). Data flow of a program:

1. TMA loads: q, k (q/k head ``v_head // (HV // H)``) and the chunk's state slice
   ``h [K, BV]`` on ``ready_bars[0]``; ``v_new [64, BV]`` on ``ready_bars[1]`` (needed last).
2. Two MMAs from the same q tile: ``o_acc = q @ h`` and ``s_acc = q @ k^T``.
3. ``s`` in registers: times k's l2-norm reciprocal per column when the call normalizes
   q/k (the raw q, k enter the MMAs; scaling the [64, 64] result is cheaper than
   normalizing two operand tiles), then :func:`masks.causal_gate` (the 16-column bitmask
   with ``2^(g_i - g_j)`` folded in). ``P`` in q's dtype is staged to shared memory and
   fenced for the async proxy.
4. ``o = o_acc * 2^g_i`` in registers, then ``o += P @ v_new`` on the engine (sm_90a: the
   registers are the wgmma accumulator; sm_100a: the product lands in ``o_acc``'s TMEM,
   free once read, and is added in registers).
5. ``o *= scale (* q's l2-norm reciprocal)`` per row, staged in v_new's (free) buffer,
   stored by TMA; a sequence's last chunk writes only its own rows (see :mod:`masks`).

Rows past the sequence's end: q rows only feed o rows that are never stored; k rows only
feed columns ``j > i`` of valid rows, which the mask *selects* to 0; v_new rows meet
those exact zeros of P (they are finite: the state kernel writes every row of v_new, and
TMA zero-fills rows past the tensor's end).

Budget (K = V = BV = 128, 16-bit): shared memory q 16 + k 16 + h 32 + v_new 16 + P 8 =
88 KB; TMEM 128 + 64 = 192 columns (256 allocated) on sm_100a; on sm_90a the o and s
accumulators are 64 + 32 fp32 registers per thread at 4 warps.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem
from gdn_dispatch.device import DeviceInfo
from gdn_dispatch.varlen import ChunkTable

from gdn_dispatch.backends.gluon_common import engine as E
from gdn_dispatch.backends.gluon_common.compat import tma_load
from gdn_dispatch.backends.gluon_common.launch import launch_planned
from gdn_dispatch.backends.gluon_common.masks import (
    causal_gate, chunk_rows, row_rnorm, row_vector, store_chunk_tile, tile_layout)
from gdn_dispatch.backends.gluon_common.plan import NUM_WARPS, LaunchPlan, drop_unused_scatter, has_tails, sig_dtype
from gdn_dispatch.backends.gluon_common.wu import (
    aot_problem, as_device, chunks_have_tails, device_of, engine_is_sm100, pointer_attrs, tile_desc)


# ----------------------------------------------------------------------------------------
# Kernel


@gluon.jit
def _output_p(s_acc, g_cum, k_smem, row0, n_valid, i_h, HV, p_smem,
              USE_L2NORM: gl.constexpr, IS_SM100: gl.constexpr):
    """Masked, gated scores -> ``p_smem`` (q's dtype), fenced for the P @ v_new MMA."""
    s = E.acc_read(s_acc, IS_SM100)
    BT: gl.constexpr = s.shape[0]
    layout: gl.constexpr = s.type.layout
    g_row = row_vector(g_cum, row0, n_valid, i_h, HV, BT, gl.SliceLayout(1, layout))
    g_col = row_vector(g_cum, row0, n_valid, i_h, HV, BT, gl.SliceLayout(0, layout))
    if USE_L2NORM:
        rk = row_rnorm(k_smem, tile_layout(BT, k_smem.shape[1], gl.num_warps()))
        s = s * gl.expand_dims(gl.convert_layout(rk, gl.SliceLayout(0, layout)), 0)
    p = causal_gate(s, g_row, g_col)
    p_smem.store(p.to(p_smem.dtype))
    # The MMA reads P through the async proxy.
    fence_async_shared()


@gluon.jit
def _output_epilogue(o, q_smem, v_smem, scale, o_desc, o_rows_desc, o_ptr, row_stride,
                     row0, col0, n_valid, HAS_TAILS: gl.constexpr, USE_L2NORM: gl.constexpr,
                     IS_SM100: gl.constexpr):
    """``o * scale (* 1/|q_i|)`` -> v_new's buffer (its MMA is done) -> global rows."""
    BT: gl.constexpr = o.shape[0]
    rows: gl.constexpr = gl.SliceLayout(1, o.type.layout)
    r_scale = gl.full([BT], scale, gl.float32, layout=rows)
    if USE_L2NORM:
        rq = row_rnorm(q_smem, tile_layout(BT, q_smem.shape[1], gl.num_warps()))
        r_scale = r_scale * gl.convert_layout(rq, rows)
    v_smem.store((o * gl.expand_dims(r_scale, 1)).to(v_smem.dtype))
    # TMA store / scatter read the staged tile through the async proxy.
    fence_async_shared()
    store_chunk_tile(o_desc, o_rows_desc, o_ptr, row_stride, v_smem, row0, col0, n_valid, HAS_TAILS, IS_SM100)


@gluon.jit(do_not_specialize=["HV", "GROUP", "NV"])
def _output_fwd_kernel(
    q_desc, k_desc, h_desc, v_desc, o_desc, o_rows_desc, o_ptr,
    g_cum, cu_seqlens, chunk_seq, chunk_local, scale, HV, GROUP, NV,
    HAS_TAILS: gl.constexpr, USE_L2NORM: gl.constexpr, IS_SM100: gl.constexpr,
):
    BT: gl.constexpr = q_desc.block_type.shape[0]
    K: gl.constexpr = q_desc.block_type.shape[1]
    BV: gl.constexpr = v_desc.block_type.shape[1]
    # (chunk, v-head, V slice) flattened, V slice fastest, then v-head: neighbours share
    # q/k rows in L2.
    pid = gl.program_id(0)
    i_v = pid % NV
    i_c = pid // NV // HV
    i_h = pid // NV % HV
    row0, n_valid = chunk_rows(cu_seqlens, chunk_seq, chunk_local, i_c, BT, HAS_TAILS)

    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BT, K], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BT, K], k_desc.layout)
    h_smem = gl.allocate_shared_memory(h_desc.dtype, [K, BV], h_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BT, BV], v_desc.layout)
    p_smem = gl.allocate_shared_memory(q_desc.dtype, [BT, BT],
                                       gl.NVMMASharedLayout.get_default_for([BT, BT], q_desc.dtype))
    # ready_bars[0]: q, k, h landed; ready_bars[1]: v_new landed. mma_bars[0]: q h done;
    # [1]: q k^T done; [2]: P v_new done (one barrier per MMA site, as the engine asks).
    # Each completes one phase per program, so every wait is on phase 0.
    ready_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mma_bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready_bars.index(i), count=1)
    for i in gl.static_range(3):
        mbarrier.init(mma_bars.index(i), count=1)

    i_k = i_h // GROUP
    mbarrier.expect(ready_bars.index(0), 2 * q_desc.block_type.nbytes + h_desc.block_type.nbytes)
    tma_load(q_desc, [row0, i_k * K], ready_bars.index(0), q_smem)
    tma_load(k_desc, [row0, i_k * K], ready_bars.index(0), k_smem)
    tma_load(h_desc, [(i_c * HV + i_h) * K, i_v * BV], ready_bars.index(0), h_smem)
    mbarrier.expect(ready_bars.index(1), v_desc.block_type.nbytes)
    tma_load(v_desc, [row0, i_h * NV * BV + i_v * BV], ready_bars.index(1), v_smem)

    mbarrier.wait(ready_bars.index(0), 0)
    o_acc = E.mma(q_smem, h_smem, E.acc_alloc(BT, BV, IS_SM100), False, mma_bars.index(0), IS_SM100)
    s_acc = E.mma(q_smem, k_smem.permute((1, 0)), E.acc_alloc(BT, BT, IS_SM100), False, mma_bars.index(1),
                  IS_SM100)
    o_acc = E.mma_wait(o_acc, mma_bars.index(0), 0, IS_SM100)
    s_acc = E.mma_wait(s_acc, mma_bars.index(1), 0, IS_SM100)

    _output_p(s_acc, g_cum, k_smem, row0, n_valid, i_h, HV, p_smem, USE_L2NORM, IS_SM100)
    # o = 2^g_i (q h) back into the accumulator, then o += P v_new on the engine.
    o = E.acc_read(o_acc, IS_SM100)
    g_row = row_vector(g_cum, row0, n_valid, i_h, HV, BT, gl.SliceLayout(1, o.type.layout))
    o_acc = E.acc_write(o_acc, o * gl.expand_dims(gl.exp2(g_row), 1), IS_SM100)
    mbarrier.wait(ready_bars.index(1), 0)
    o_acc = E.mma(p_smem, v_smem, o_acc, True, mma_bars.index(2), IS_SM100)
    o_acc = E.mma_wait(o_acc, mma_bars.index(2), 0, IS_SM100)
    o = E.acc_read(o_acc, IS_SM100)

    # Row strides as HV * NV * constexpr BV (= HV * V): the masked sm_90a tail stores vectorize.
    _output_epilogue(o, q_smem, v_smem, scale, o_desc, o_rows_desc, o_ptr, HV * NV * BV,
                     row0, i_h * NV * BV + i_v * BV, n_valid, HAS_TAILS, USE_L2NORM, IS_SM100)
    # Shared memory must outlive the bulk store that reads it.
    tma.store_wait(0)
    for i in gl.static_range(2):
        mbarrier.invalidate(ready_bars.index(i))
    for i in gl.static_range(3):
        mbarrier.invalidate(mma_bars.index(i))




# ----------------------------------------------------------------------------------------
# Host side: plan (dry run), launch, AOT list


def output_block_v(V: int, num_chunks: int, HV: int, sm_count: int) -> int:
    """BV: the whole V (up to 128), so q k^T is formed once per (chunk, v-head); halved to
    64 when the (chunk, v-head) pairs alone give fewer than two programs per SM (short
    prefills), where a second V-block per pair fills the part instead."""
    BV = min(V, 128)
    if BV == 128 and num_chunks * HV < 2 * max(sm_count, 1):
        BV = 64
    return BV


def plan_output(problem: GDNProblem, device, *, block_v: int | None = None) -> LaunchPlan:
    """Launch plan of :func:`output_fwd` for ``problem`` (a dry run: no GPU, no tensor read).

    Parameters
    ----------
    problem : a validated call; K and V in {64, 128}, bf16/fp16.
    device : DeviceInfo (``capability`` picks the engine, ``sm_count`` the V-block), or a
        bare capability tuple (its representative part).
    block_v : BV override (64, or 128 when V = 128); default :func:`output_block_v`.
    """
    return _plan_output(problem.B * problem.T, problem.H, problem.HV, problem.K, problem.V, problem.dtype,
                        problem.chunks.num_chunks, has_tails(problem), problem.use_qk_l2norm, as_device(device),
                        block_v)


def _plan_output(rows, H, HV, K, V, dtype, NT, tails, l2norm, info: DeviceInfo, block_v=None) -> LaunchPlan:
    is_sm100 = engine_is_sm100(info.capability)
    BT = CHUNK_SIZE
    BV = block_v or output_block_v(V, NT, HV, info.sm_count)
    if BV not in (64, 128) or V % BV:
        raise ValueError(f"block_v: expected 64 or 128 dividing V = {V}, got {BV}")
    NV = V // BV
    descriptors, constexprs = drop_unused_scatter((
        tile_desc("q_desc", "q", dtype, rows, H * K, (BT, K)),
        tile_desc("k_desc", "k", dtype, rows, H * K, (BT, K)),
        tile_desc("h_desc", "h", dtype, max(NT, 1) * HV * K, V, (K, BV)),
        tile_desc("v_desc", "v_new", dtype, rows, HV * V, (BT, BV)),
        tile_desc("o_desc", "o", dtype, rows, HV * V, (BT, BV)),
        tile_desc("o_rows_desc", "o", dtype, rows, HV * V, (1, BV), scatter=True),
    ), {"HAS_TAILS": tails, "USE_L2NORM": l2norm, "IS_SM100": is_sm100})
    elem = torch.finfo(dtype).bits // 8
    return LaunchPlan(
        kernel="output_fwd",
        grid=(NT * HV * NV,),
        num_warps=NUM_WARPS,
        # TMEM: the [64, BV] o and [64, 64] s accumulators share lanes (M = 64 takes 16 of
        # each 32-lane quarter), so max(BV, 64) columns; P v_new accumulates onto o.
        blocks={"BT": BT, "K": K, "BV": BV, "NV": NV,
                "smem_bytes": (2 * BT * K + K * BV + BT * BV + BT * BT) * elem,
                "tmem_columns": max(BV, BT) if is_sm100 else 0},
        constexprs=constexprs,
        descriptors=descriptors,
        scalars={"HV": HV, "GROUP": HV // H, "NV": NV},
        notes=f"BV={BV}: {NT} chunks x {HV} v-heads x {NV} V-blocks on {info.sm_count} SMs",
    )


def output_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    g_cum: torch.Tensor,
    chunks: ChunkTable,
    launch: LaunchPlan | None = None,
    *,
    scale: float,
    use_qk_l2norm: bool = False,
    device_info: DeviceInfo | None = None,
    block_v: int | None = None,
) -> torch.Tensor:
    """The output of every token, ``o = scale (2^g (q h) + causal(q k^T 2^(g_i - g_j)) v_new)``
    (one launch).

    Parameters
    ----------
    q, k : Tensor ``[B, T, H, K]``, bf16/fp16, contiguous, 16-byte aligned (raw: with the qk
        l2 norm the kernel applies the row norms itself); v-head ``j`` reads q/k head
        ``j // (HV // H)``. K in {64, 128}.
    v_new : Tensor ``[B, T, HV, V]``, q's dtype, contiguous: ``u - w h`` from the state
        stage (every row written, so rows past a sequence's end are finite). V in {64, 128}.
    h : Tensor ``[NT, HV, K, V]``, q's dtype, contiguous: the state at the start of every
        chunk (flat chunk order of ``chunks``), ``[K, V]`` per chunk and v-head.
    g_cum : float32 Tensor ``[B, T, HV]``, contiguous: chunk-local gate cumsum in log2 units.
    chunks : ChunkTable of the call.
    launch : the ``output_fwd`` LaunchPlan of :func:`plan_output` (what the orchestrator
        passes); None plans from the tensors with ``use_qk_l2norm``, ``device_info``
        (probed from q's device when None) and ``block_v``, which are ignored when
        ``launch`` is given.
    scale : float, the output scale.

    Returns
    -------
    o : Tensor ``[B, T, HV, V]`` in q's dtype.
    """
    o = torch.empty_like(v_new)
    B, T, H, K = q.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    if chunks.num_chunks == 0 or B * T == 0 or HV == 0:
        return o
    if launch is None:
        launch = _plan_output(B * T, H, HV, K, V, q.dtype, chunks.num_chunks, chunks_have_tails(chunks, T),
                              use_qk_l2norm, device_of(q, device_info), block_v)
    tensors = {"q": q, "k": k, "h": h, "v_new": v_new, "o": o}
    launch_planned(_output_fwd_kernel, launch, tensors, dict(
        o_ptr=o, g_cum=g_cum,
        cu_seqlens=chunks.cu_seqlens, chunk_seq=chunks.chunk_seq, chunk_local=chunks.chunk_local,
        scale=float(scale), HV=launch.scalars["HV"], GROUP=launch.scalars["GROUP"], NV=launch.scalars["NV"],
    ))
    return o


def output_signature(launch: LaunchPlan, dtype: torch.dtype) -> dict:
    """Argument types of ``_output_fwd_kernel`` for ``launch``, as a launch would specialize."""
    sig = {d.arg: d.signature for d in launch.descriptors}
    sig.update(o_ptr="*" + sig_dtype(dtype), g_cum="*fp32", cu_seqlens="*i32", chunk_seq="*i32",
               chunk_local="*i32", scale="fp32", HV="i32", GROUP="i32", NV="i32")
    sig.update({name: "constexpr" for name in launch.constexprs})
    return {name: sig[name] for name in _output_fwd_kernel.arg_names}


def output_kernels_for_aot(capability: tuple[int, int], backend: str | None = None) -> list:
    """Every output specialization launchable on ``capability``: K in {64, 128} x BV in
    {64, 128} (BV = 64 serves V = 64 and V = 128; V is not a compile-time constant),
    tails (varlen) on/off, qk l2norm on/off, bf16/fp16."""
    from gdn_dispatch.aot import AotKernel

    is_sm100 = engine_is_sm100(capability)
    backend = backend or ("gluon_sm100" if is_sm100 else "gluon_sm90")
    device = as_device(capability)
    kernels = []
    for dtype in (torch.bfloat16, torch.float16):
        for K in (64, 128):
            for BV in (64, 128):
                for tails in (False, True):
                    for l2 in (False, True):
                        launch = plan_output(aot_problem(K, BV, dtype, tails, l2), device, block_v=BV)
                        tag = f"K{K}-BV{BV}-{'varlen' if tails else 'dense'}{'-l2' if l2 else ''}-{sig_dtype(dtype)}"
                        kernels.append(AotKernel(
                            backend=backend, kernel="output_fwd", specialization=tag, fn=_output_fwd_kernel,
                            signature=output_signature(launch, dtype), constexprs=dict(launch.constexprs),
                            dialect="gluon", num_warps=launch.num_warps,
                            attrs=pointer_attrs(_output_fwd_kernel, ["o_ptr", "g_cum", "cu_seqlens",
                                                                     "chunk_seq", "chunk_local"]),
                        ))
    return kernels
