"""The Blackwell matrix engine: tcgen05 MMAs into TMEM accumulators, and the TMA scatter
store of a sequence's last, partial chunk.

:data:`TCGEN05` is what gluon_sm100 hands the shared pipeline kernels as their ``ENGINE``
constexpr (the contract and its usage: :mod:`gdn_dispatch.backends.gluon_common.engine`).
An accumulator is a TMEM descriptor: allocated once, overwritten or accumulated by each
MMA, read to registers with one tcgen05.ld. An MMA is issued by one thread and completes on
an mbarrier through ``tcgen05_commit``, which covers every tcgen05 op issued before it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.blackwell import (
    TensorMemoryLayout,
    allocate_tensor_memory,
    tcgen05_commit,
    tcgen05_mma,
)
from triton.experimental.gluon.language.nvidia.blackwell import tma as _bw_tma
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from gdn_dispatch.backends.gluon_common.compat import thread_barrier, tmem_reg_layout
from gdn_dispatch.backends.gluon_common.engine import GluonEngine

#: Row index handed to ``tma.async_scatter`` for a row that must not be written: far past
#: any tensor's end, so the TMA unit drops it (negative indices are illegal instructions).
SCATTER_SKIP_ROW = gl.constexpr(0x7FFFFFFF)


@gluon.constexpr_function
def acc_tmem_layout(M, N):
    """TMEM layout of an fp32 [M, N] accumulator (one MMA instruction tile: M <= 128 lanes)."""
    return TensorMemoryLayout(block=(min(M, 128), N), col_stride=1)


@gluon.constexpr_function
def acc_layout(M, N, num_warps):
    """Register layout of an fp32 [M, N] accumulator read by :func:`acc_read` (one tcgen05.ld)."""
    return tmem_reg_layout(gl.float32, [M, N], acc_tmem_layout(M, N), num_warps)


@gluon.constexpr_function
def scatter_row_layout(num_warps):
    """Layout of the row-index vector of ``tma.async_scatter``: 4 consecutive rows per
    thread (one scatter4 message), broadcast over the lanes."""
    return gl.SliceLayout(0, gl.BlockedLayout([1, 4], [32, 1], [1, num_warps], [1, 0]))


@gluon.jit
def acc_alloc(M: gl.constexpr, N: gl.constexpr):
    """A fresh fp32 [M, N] accumulator in TMEM (contents undefined)."""
    return allocate_tensor_memory(gl.float32, [M, N], acc_tmem_layout(M, N))


@gluon.jit
def acc_alloc_tf32(M: gl.constexpr, N: gl.constexpr):
    """:func:`acc_alloc` for fp32 operands (tf32 MMAs): the same TMEM."""
    return allocate_tensor_memory(gl.float32, [M, N], acc_tmem_layout(M, N))


@gluon.jit
def acc_in_flight(acc):
    """``acc`` typed as the result of an issued, unwaited :func:`mma`: the TMEM handle."""
    return acc


@gluon.jit
def mma(a, b, acc, use_acc, bar):
    """Issue ``acc = a @ b (+ acc if use_acc)`` with tcgen05, then ``tcgen05_commit(bar)``:
    ``bar`` completes one phase when this and every earlier tcgen05 op of the CTA are done.
    Returns the accumulator handle."""
    # Every warp's shared-memory operand stores (fenced by the caller) and TMEM stores must
    # land before the single issuing thread starts the MMA.
    thread_barrier()
    tcgen05_mma(a, b, acc, use_acc=use_acc)
    tcgen05_commit(bar)
    return acc


@gluon.jit
def mma_wait(acc, bar, phase):
    """Wait until every MMA issued so far is complete; returns the (readable) accumulator."""
    mbarrier.wait(bar, phase)
    return acc


@gluon.jit
def mma_wait_until(acc, bar, phase, PENDING: gl.constexpr):
    """Wait until ``acc``'s MMA is complete (``bar`` is its own barrier: its commit covers it
    and every earlier op); the ``PENDING`` MMAs issued after it may still run."""
    mbarrier.wait(bar, phase)
    return acc


@gluon.jit
def acc_read(acc):
    """The accumulator as fp32 registers in :func:`acc_layout`."""
    M: gl.constexpr = acc.shape[0]
    N: gl.constexpr = acc.shape[1]
    return acc.load(acc_layout(M, N, gl.num_warps()))


@gluon.jit
def acc_write(acc, value):
    """Overwrite the accumulator with ``value`` (fp32 registers, any layout); returns it."""
    M: gl.constexpr = value.shape[0]
    N: gl.constexpr = value.shape[1]
    v = gl.convert_layout(value, acc_layout(M, N, gl.num_warps()))
    acc.store(v)
    return acc


@gluon.jit
def mma_reg_a(a, a_smem, b, acc, use_acc, bar):
    """:func:`mma` with the left operand ``a`` in registers: tcgen05 reads its left operand
    from shared memory, so ``a`` is stored to ``a_smem`` (an NVMMA buffer the caller owns;
    every MMA that read it must be complete) and fenced here. The caller has stored and
    fenced ``b``; wait with :func:`mma_wait` as for :func:`mma`."""
    a_smem.store(a.to(a_smem.dtype))
    # The MMA reads a_smem through the async proxy.
    fence_async_shared()
    return mma(a_smem, b, acc, use_acc, bar)


@gluon.jit
def store_tail_rows(rows_desc, ptr, row_stride, smem, row0, col0, n_valid):
    """The first ``n_valid`` rows of the staged ``[BT, BN]`` tile to rows ``row0 ...`` at
    column ``col0``: one TMA scatter through ``rows_desc`` (block ``[1, BN]``), the rows
    past ``n_valid`` sent to :data:`SCATTER_SKIP_ROW`. ``ptr`` and ``row_stride`` are unused."""
    BT: gl.constexpr = smem.shape[0]
    rows = gl.arange(0, BT, layout=scatter_row_layout(gl.num_warps()))
    rows = gl.where(rows < n_valid, row0 + rows, SCATTER_SKIP_ROW)
    _bw_tma.async_scatter(rows_desc, rows, col0, smem)


#: tcgen05 + TMEM (sm_100a, sm_103a): the ``ENGINE`` of gluon_sm100's launches.
TCGEN05 = GluonEngine(
    "tcgen05", is_sm100=True, acc_alloc=acc_alloc, acc_alloc_tf32=acc_alloc_tf32, acc_in_flight=acc_in_flight,
    acc_layout=acc_layout, acc_read=acc_read, acc_write=acc_write, mma=mma, mma_reg_a=mma_reg_a, mma_wait=mma_wait,
    mma_wait_until=mma_wait_until, store_tail_rows=store_tail_rows,
)
