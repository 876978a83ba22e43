"""Stage 3 on the matrix engine: the WY vectors of every chunk,

    w = T (beta 2^g k)   [64, K]        u = T (beta v)   [64, V]

with ``T = (I + A)^-1`` from triton_generic's ``kkt_solve_fwd`` ([B, T, HV, 64], k's dtype).

One program owns one (chunk, v-head); the whole K and V extent is one tile each, so T is
read once and both products share it. Data flow of a program:

1. TMA loads: T and k (q/k head ``v_head // (HV // H)``) on ``ready_bars[0]``, v on
   ``ready_bars[1]``, so k is scaled while v is still in flight.
2. Row scales in registers: ``beta * 2^g_cum`` (times k's l2-norm reciprocal when the
   call normalizes q/k: stage 2 formed T from normalized k, so w must use it too) and
   ``beta``; rows past the sequence's end are selected to 0 (they hold the next
   sequence's tokens). The scaled tile overwrites its own shared buffer in place (each
   thread writes back exactly the elements it read) and is fenced for the async proxy.
3. Two MMAs on the engine: ``w_acc = T @ k_scaled``, ``u_acc = T @ v_scaled`` (TMEM on
   sm_100a, registers on sm_90a); the w MMA runs while v is scaled.
4. Epilogue: accumulator -> k's dtype -> the (now free) k / v shared buffer -> TMA store;
   the last chunk of a sequence writes only its own rows (see :mod:`masks`).

Budget (K = V = 128, 16-bit): shared memory T 8 KB + k 16 KB + v 16 KB; TMEM 256
columns (w 128 + u 128) on sm_100a; on sm_90a the two accumulators are 64 + 64 fp32
registers per thread at 4 warps (one warpgroup, wgmma M = 64).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem
from gdn_dispatch.device import DeviceInfo, assumed_device
from gdn_dispatch.varlen import ChunkTable

from gdn_dispatch.backends.gluon_common import engine as E
from gdn_dispatch.backends.gluon_common.compat import tma_load
from gdn_dispatch.backends.gluon_common.launch import launch_planned
from gdn_dispatch.backends.gluon_common.masks import L2NORM_EPS, chunk_rows, row_vector, store_chunk_tile, tile_layout
# chunks_have_tails lives with has_tails in plan; output.py imports it from here.
from gdn_dispatch.backends.gluon_common.plan import (  # noqa: F401
    NUM_WARPS, DescPlan, LaunchPlan, chunks_have_tails, drop_unused_scatter, has_tails, sig_dtype)


# ----------------------------------------------------------------------------------------
# Kernel


@gluon.jit
def _wu_scale_rows(x_smem, bar, g_cum, beta, row0, n_valid, i_h, HV,
                   DECAY: gl.constexpr, L2NORM: gl.constexpr, HAS_TAILS: gl.constexpr):
    """Wait for the tile on ``bar``, then in place ``x[r] *= beta_r (* 2^g_r) (* 1/|x_r|)``,
    with rows past the sequence's end set to 0; fenced for the MMA that reads it next."""
    BT: gl.constexpr = x_smem.shape[0]
    layout: gl.constexpr = tile_layout(BT, x_smem.shape[1], gl.num_warps())
    rows: gl.constexpr = gl.SliceLayout(1, layout)
    scale = row_vector(beta, row0, n_valid, i_h, HV, BT, rows)
    if DECAY:
        scale = scale * gl.exp2(row_vector(g_cum, row0, n_valid, i_h, HV, BT, rows))
    mbarrier.wait(bar, 0)
    x = x_smem.load(layout).to(gl.float32)
    if L2NORM:
        scale = scale * gl.rsqrt(gl.sum(x * x, axis=1) + L2NORM_EPS)
    x = x * gl.expand_dims(scale, 1)
    if HAS_TAILS:
        # select, not multiply: the next sequence's rows may hold anything finite or not.
        r = gl.arange(0, BT, layout=rows)
        x = gl.where(gl.expand_dims(r < n_valid, 1), x, 0.0)
    x_smem.store(x.to(x_smem.dtype))
    # The MMA reads x_smem through the async proxy: order these generic writes before it.
    fence_async_shared()


@gluon.jit
def _wu_epilogue(acc, smem, desc, rows_desc, ptr, row_stride, row0, col0, n_valid,
                 HAS_TAILS: gl.constexpr, IS_SM100: gl.constexpr):
    """Accumulator -> ``smem`` (a free operand buffer of the same shape) -> global rows."""
    smem.store(E.acc_read(acc, IS_SM100).to(smem.dtype))
    # TMA store / scatter read smem through the async proxy.
    fence_async_shared()
    store_chunk_tile(desc, rows_desc, ptr, row_stride, smem, row0, col0, n_valid, HAS_TAILS, IS_SM100)


@gluon.jit(do_not_specialize=["HV", "GROUP"])
def _wu_fwd_kernel(
    a_desc, k_desc, v_desc, w_desc, u_desc, w_rows_desc, u_rows_desc, w_ptr, u_ptr,
    g_cum, beta, cu_seqlens, chunk_seq, chunk_local, HV, GROUP,
    HAS_TAILS: gl.constexpr, USE_L2NORM: gl.constexpr, IS_SM100: gl.constexpr,
):
    BT: gl.constexpr = a_desc.block_type.shape[0]
    K: gl.constexpr = k_desc.block_type.shape[1]
    V: gl.constexpr = v_desc.block_type.shape[1]
    # (chunk, v-head) flattened with the v-head fastest: programs sharing a k head run
    # side by side and hit the same k rows in L2.
    pid = gl.program_id(0)
    i_c = pid // HV
    i_h = pid % HV
    row0, n_valid = chunk_rows(cu_seqlens, chunk_seq, chunk_local, i_c, BT, HAS_TAILS)

    a_smem = gl.allocate_shared_memory(a_desc.dtype, [BT, BT], a_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BT, K], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BT, V], v_desc.layout)
    # ready_bars[0]: T and k landed; ready_bars[1]: v landed; mma_bars[0]: w = T k done;
    # mma_bars[1]: u = T v done (one barrier per MMA site, as the engine asks). Each
    # completes exactly one phase per program, so every wait is on phase 0.
    ready_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mma_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ready_bars.index(i), count=1)
        mbarrier.init(mma_bars.index(i), count=1)

    mbarrier.expect(ready_bars.index(0), a_desc.block_type.nbytes + k_desc.block_type.nbytes)
    tma_load(a_desc, [row0, i_h * BT], ready_bars.index(0), a_smem)
    tma_load(k_desc, [row0, (i_h // GROUP) * K], ready_bars.index(0), k_smem)
    mbarrier.expect(ready_bars.index(1), v_desc.block_type.nbytes)
    tma_load(v_desc, [row0, i_h * V], ready_bars.index(1), v_smem)

    _wu_scale_rows(k_smem, ready_bars.index(0), g_cum, beta, row0, n_valid, i_h, HV,
                   True, USE_L2NORM, HAS_TAILS)
    w_acc = E.mma(a_smem, k_smem, E.acc_alloc(BT, K, IS_SM100), False, mma_bars.index(0), IS_SM100)
    _wu_scale_rows(v_smem, ready_bars.index(1), g_cum, beta, row0, n_valid, i_h, HV,
                   False, False, HAS_TAILS)
    u_acc = E.mma(a_smem, v_smem, E.acc_alloc(BT, V, IS_SM100), False, mma_bars.index(1), IS_SM100)
    w_acc = E.mma_wait(w_acc, mma_bars.index(0), 0, IS_SM100)
    u_acc = E.mma_wait(u_acc, mma_bars.index(1), 0, IS_SM100)

    # The MMAs are complete, so k_smem / v_smem are free to stage w / u.
    # Row strides as HV * constexpr: the masked sm_90a tail stores then vectorize.
    _wu_epilogue(w_acc, k_smem, w_desc, w_rows_desc, w_ptr, HV * K, row0, i_h * K, n_valid, HAS_TAILS, IS_SM100)
    _wu_epilogue(u_acc, v_smem, u_desc, u_rows_desc, u_ptr, HV * V, row0, i_h * V, n_valid, HAS_TAILS, IS_SM100)
    # Shared memory must outlive the bulk stores that read it.
    tma.store_wait(0)
    for i in gl.static_range(2):
        mbarrier.invalidate(ready_bars.index(i))
        mbarrier.invalidate(mma_bars.index(i))




# ----------------------------------------------------------------------------------------
# Host side: plan (dry run), launch, AOT list


def engine_is_sm100(capability: tuple[int, int]) -> bool:
    """True for the tcgen05/TMEM engine (sm_100, sm_103), False for wgmma (sm_90);
    ValueError for anything else (these kernels exist for those two only)."""
    if capability[0] == 10:
        return True
    if capability[0] == 9:
        return False
    raise ValueError(f"capability: the Gluon kernels need sm_90 or sm_100/sm_103, got {tuple(capability)}")


def as_device(device) -> DeviceInfo:
    """A DeviceInfo from a DeviceInfo or a bare capability (its representative part)."""
    if isinstance(device, DeviceInfo):
        return device
    return assumed_device(f"sm_{device[0]}{device[1]}")


def tile_desc(arg: str, tensor: str, dtype: torch.dtype, rows: int, cols: int, block, scatter: bool = False):
    """DescPlan of the row-major 2-D view ``[rows, cols]`` with TMA box ``block``; a scatter
    descriptor (box ``[1, BN]``) carries the layout of the staged ``[64, BN]`` tile."""
    layout_shape = (CHUNK_SIZE, block[1]) if scatter else None
    return DescPlan(arg, tensor, (rows, cols), (cols, 1), tuple(block), dtype, layout_shape)


def wy_descriptors(rows: int, H: int, HV: int, K: int, V: int, dtype: torch.dtype) -> tuple:
    """The k and v tiles a WY kernel reads and the w and u tiles (and tail rows) it writes,
    whole [64, K] / [64, V] per (chunk, head): shared by this stage and :mod:`.wy`."""
    BT = CHUNK_SIZE
    return (
        tile_desc("k_desc", "k", dtype, rows, H * K, (BT, K)),
        tile_desc("v_desc", "v", dtype, rows, HV * V, (BT, V)),
        tile_desc("w_desc", "w", dtype, rows, HV * K, (BT, K)),
        tile_desc("u_desc", "u", dtype, rows, HV * V, (BT, V)),
        tile_desc("w_rows_desc", "w", dtype, rows, HV * K, (1, K), scatter=True),
        tile_desc("u_rows_desc", "u", dtype, rows, HV * V, (1, V), scatter=True),
    )


def plan_wu(problem: GDNProblem, device) -> LaunchPlan:
    """Launch plan of :func:`wu_fwd` for ``problem`` (a dry run: no GPU, no tensor read).

    Parameters
    ----------
    problem : a validated call; K and V in {64, 128}, bf16/fp16.
    device : DeviceInfo (``capability`` picks the engine), or a bare capability tuple.

    One program per (chunk, v-head), v-head fastest; whole K and V tiles (the w/u work per
    chunk is small, and T is then read once); 4 warps (one warpgroup: wgmma's M = 64).
    """
    return _plan_wu(problem.B * problem.T, problem.H, problem.HV, problem.K, problem.V, problem.dtype,
                    problem.chunks.num_chunks, has_tails(problem), problem.use_qk_l2norm, as_device(device))


def _plan_wu(rows, H, HV, K, V, dtype, NT, tails, l2norm, info: DeviceInfo) -> LaunchPlan:
    is_sm100 = engine_is_sm100(info.capability)
    BT = CHUNK_SIZE
    descriptors, constexprs = drop_unused_scatter(
        (tile_desc("a_desc", "A_inv", dtype, rows, HV * BT, (BT, BT)), *wy_descriptors(rows, H, HV, K, V, dtype)),
        {"HAS_TAILS": tails, "USE_L2NORM": l2norm, "IS_SM100": is_sm100})
    elem = torch.finfo(dtype).bits // 8
    return LaunchPlan(
        kernel="wu_fwd",
        grid=(NT * HV,),
        num_warps=NUM_WARPS,
        # TMEM: M = 64 accumulators take 16 of each 32-lane TMEM quarter, so the compiler
        # packs w and u side by side in lanes: max(K, V) columns, not K + V.
        blocks={"BT": BT, "K": K, "V": V, "smem_bytes": BT * (BT + K + V) * elem,
                "tmem_columns": max(K, V) if is_sm100 else 0},
        constexprs=constexprs,
        descriptors=descriptors,
        scalars={"HV": HV, "GROUP": HV // H},
        notes=f"{NT} chunks x {HV} v-heads, whole [64, {K}] / [64, {V}] tiles",
    )


def device_of(tensor: torch.Tensor, device_info=None) -> DeviceInfo:
    """``device_info``, else the probed DeviceInfo of ``tensor``'s device."""
    if device_info is not None:
        return device_info
    from gdn_dispatch.device import default_probe

    return default_probe().for_torch_device(tensor.device)


def wu_fwd(
    k: torch.Tensor,
    v: torch.Tensor,
    g_cum: torch.Tensor,
    beta: torch.Tensor,
    A_inv: torch.Tensor,
    chunks: ChunkTable,
    launch: LaunchPlan | None = None,
    *,
    use_qk_l2norm: bool = False,
    device_info: DeviceInfo | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The WY vectors of each chunk: ``w = T (beta 2^g_cum k)``, ``u = T (beta v)`` (one launch).

    Parameters
    ----------
    k : Tensor ``[B, T, H, K]``, bf16/fp16, contiguous, 16-byte aligned (raw: with the qk
        l2 norm the kernel normalizes k's rows itself); v-head ``j`` reads k head
        ``j // (HV // H)``. K in {64, 128}.
    v : Tensor ``[B, T, HV, V]``, k's dtype, contiguous, 16-byte aligned. V in {64, 128}.
    g_cum : float32 Tensor ``[B, T, HV]``, contiguous: chunk-local gate cumsum in log2
        units (triton_generic ``chunk_cumsum_fwd(g, chunks, scale=log2(e))``).
    beta : Tensor ``[B, T, HV]``, any float dtype (read as fp32), contiguous.
    A_inv : Tensor ``[B, T, HV, 64]``, k's dtype, contiguous: row ``t`` holds row
        ``t - c0`` of its chunk's ``T = (I + A)^-1`` (triton_generic ``kkt_solve_fwd(k,
        g_cum, beta, chunks, use_qk_l2norm=...)`` with the same l2norm flag).
    chunks : ChunkTable of the call.
    launch : the ``wu_fwd`` LaunchPlan of :func:`plan_wu` (what the orchestrator passes);
        None plans from the tensors with ``use_qk_l2norm`` and ``device_info`` (probed
        from k's device when None), which are ignored when ``launch`` is given.

    Returns
    -------
    w : Tensor ``[B, T, HV, K]``, k's dtype; every row of every chunk written.
    u : Tensor ``[B, T, HV, V]``, k's dtype; likewise.
    """
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    w = torch.empty(B, T, HV, K, dtype=k.dtype, device=k.device)
    u = torch.empty_like(v)
    if chunks.num_chunks == 0 or B * T == 0 or HV == 0:
        return w, u
    if launch is None:
        launch = _plan_wu(B * T, H, HV, K, V, k.dtype, chunks.num_chunks, chunks_have_tails(chunks, T),
                          use_qk_l2norm, device_of(k, device_info))
    tensors = {"A_inv": A_inv, "k": k, "v": v, "w": w, "u": u}
    launch_planned(_wu_fwd_kernel, launch, tensors, dict(
        w_ptr=w, u_ptr=u, g_cum=g_cum, beta=beta,
        cu_seqlens=chunks.cu_seqlens, chunk_seq=chunks.chunk_seq, chunk_local=chunks.chunk_local,
        HV=launch.scalars["HV"], GROUP=launch.scalars["GROUP"],
    ))
    return w, u


def pointer_attrs(fn, names) -> dict:
    """``tt.divisibility`` 16 on pointer arguments, as a launch with torch tensors passes."""
    return {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def aot_problem(K: int, V: int, dtype: torch.dtype, tails: bool, l2: bool, H: int = 1, HV: int = 2):
    """A small CPU GDNProblem with these specializations (for plans of AOT entries)."""
    from gdn_dispatch.contract import make_problem

    T = 2 * CHUNK_SIZE + (17 if tails else 0)
    q = torch.zeros(1, T, H, K, dtype=dtype)
    v = torch.zeros(1, T, HV, V, dtype=dtype)
    g = torch.zeros(1, T, HV)
    return make_problem(q, q, v, g, g, use_qk_l2norm_in_kernel=l2)


def wu_signature(launch: LaunchPlan, dtype: torch.dtype, beta_dtype: torch.dtype | None = None) -> dict:
    """Argument types of ``_wu_fwd_kernel`` for ``launch``, as a launch would specialize."""
    sig = {d.arg: d.signature for d in launch.descriptors}
    ptr = "*" + sig_dtype(dtype)
    sig.update(w_ptr=ptr, u_ptr=ptr, g_cum="*fp32", beta="*" + sig_dtype(beta_dtype or dtype),
               cu_seqlens="*i32", chunk_seq="*i32", chunk_local="*i32", HV="i32", GROUP="i32")
    sig.update({name: "constexpr" for name in launch.constexprs})
    return {name: sig[name] for name in _wu_fwd_kernel.arg_names}


def wu_kernels_for_aot(capability: tuple[int, int], backend: str | None = None) -> list:
    """Every w/u specialization launchable on ``capability``: K, V in {64, 128}, tails
    (varlen) on/off, qk l2norm on/off, bf16/fp16, beta in float32 or in q's dtype (the
    kernel reads either; models pass both)."""
    from gdn_dispatch.aot import AotKernel

    is_sm100 = engine_is_sm100(capability)
    backend = backend or ("gluon_sm100" if is_sm100 else "gluon_sm90")
    device = as_device(capability)
    kernels = []
    for dtype in (torch.bfloat16, torch.float16):
        for beta_dtype in (torch.float32, dtype):
            for K in (64, 128):
                for V in (64, 128):
                    for tails in (False, True):
                        for l2 in (False, True):
                            launch = plan_wu(aot_problem(K, V, dtype, tails, l2), device)
                            tag = (f"K{K}-V{V}-{'varlen' if tails else 'dense'}{'-l2' if l2 else ''}"
                                   f"-{sig_dtype(dtype)}-beta{sig_dtype(beta_dtype)}")
                            kernels.append(AotKernel(
                                backend=backend, kernel="wu_fwd", specialization=tag, fn=_wu_fwd_kernel,
                                signature=wu_signature(launch, dtype, beta_dtype),
                                constexprs=dict(launch.constexprs), dialect="gluon", num_warps=launch.num_warps,
                                attrs=pointer_attrs(_wu_fwd_kernel, ["w_ptr", "u_ptr", "g_cum", "beta",
                                                                     "cu_seqlens", "chunk_seq", "chunk_local"]),
                            ))
    return kernels
