"""The Hopper matrix engine: asynchronous wgmma with register accumulators, and masked
register stores for a sequence's last, partial chunk (Hopper has no TMA scatter).

:data:`WGMMA` is what gluon_sm90 hands the shared pipeline kernels as their ``ENGINE``
constexpr (the contract and its usage: :mod:`gdn_dispatch.backends.gluon_common.engine`).
An accumulator is a register tensor in an NVMMA distributed layout, or, while its MMA is in
flight, a wgmma token; every MMA is its own commit group, and groups retire in issue order,
so waiting for "at most PENDING outstanding" waits for one MMA and every earlier one.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from gdn_dispatch.backends.gluon_common.compat import thread_barrier
from gdn_dispatch.backends.gluon_common.engine import GluonEngine
from gdn_dispatch.backends.gluon_common.masks import tile_layout


@gluon.constexpr_function
def wgmma_layout(M, N, num_warps, instr_k=16):
    """Hopper fp32 accumulator layout: warps stack along M (16 rows each), instr N = N;
    ``instr_k`` is the instruction's K (16 for 16-bit operands, 8 for tf32)."""
    warps_m = num_warps
    while warps_m > 1 and M < 16 * warps_m:
        warps_m //= 2
    warps_n = num_warps // warps_m
    n = N // warps_n
    while n > 256 or N % n:
        n //= 2
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps_m, warps_n], instr_shape=[16, n, instr_k])


@gluon.constexpr_function
def acc_layout(M, N, num_warps):
    """Register layout of an fp32 [M, N] accumulator (what :func:`acc_read` returns and
    :func:`acc_write` expects)."""
    return wgmma_layout(M, N, num_warps)


@gluon.constexpr_function
def lhs_reg_layout(acc_reg_layout, bitwidth):
    """The register layout wgmma reads a left operand in, for an accumulator in
    ``acc_reg_layout`` and operands of ``bitwidth`` bits (a 32-bit register holds
    ``32 // bitwidth`` consecutive k: 2 for 16-bit types, 1 for fp32 / tf32)."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_reg_layout, k_width=32 // bitwidth)


@gluon.jit
def acc_alloc(M: gl.constexpr, N: gl.constexpr):
    """A fresh fp32 [M, N] accumulator: zeros in registers."""
    return gl.zeros([M, N], gl.float32, layout=wgmma_layout(M, N, gl.num_warps()))


@gluon.jit
def acc_alloc_tf32(M: gl.constexpr, N: gl.constexpr):
    """:func:`acc_alloc` for fp32 operands (tf32 MMAs): the wgmma instruction's K is 8, and
    the accumulator layout names it."""
    return gl.zeros([M, N], gl.float32, layout=wgmma_layout(M, N, gl.num_warps(), 8))


@gluon.jit
def acc_in_flight(acc):
    """``acc`` typed as the result of an issued, unwaited :func:`mma` (a wgmma token, not a
    tensor): the initial value of a loop-carried accumulator left in flight each iteration."""
    return warpgroup_mma_init(acc)


@gluon.jit
def mma(a, b, acc, use_acc, bar):
    """Issue ``acc = a @ b (+ acc if use_acc)`` as an async wgmma (its own commit group);
    ``bar`` is unused. Returns the accumulator (a token until waited)."""
    # Every warp's shared-memory operand stores (fenced by the caller) must land before the
    # MMA starts.
    thread_barrier()
    return warpgroup_mma(a, b, acc, use_acc=use_acc, is_async=True)


@gluon.jit
def mma_wait(acc, bar, phase):
    """Wait until every MMA issued so far is complete; returns the (readable) accumulator."""
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit
def mma_wait_until(acc, bar, phase, PENDING: gl.constexpr):
    """Wait until ``acc``'s MMA is complete while the ``PENDING`` MMAs issued after it may
    still run: wgmma groups retire in issue order, so "at most PENDING outstanding" is
    exactly "this one and everything before it are done"."""
    return warpgroup_mma_wait(num_outstanding=PENDING, deps=(acc,))


@gluon.jit
def acc_read(acc):
    """The accumulator as fp32 registers (it already is)."""
    return acc


@gluon.jit
def acc_write(acc, value):
    """Overwrite the accumulator with ``value`` (fp32 registers, any layout); returns it."""
    M: gl.constexpr = value.shape[0]
    N: gl.constexpr = value.shape[1]
    v = gl.convert_layout(value, acc_layout(M, N, gl.num_warps()))
    return v


@gluon.jit
def mma_reg_a(a, a_smem, b, acc, use_acc, bar):
    """:func:`mma` with the left operand ``a`` in registers (any layout, ``a_smem``'s dtype
    and shape): wgmma reads it from registers, converted to :func:`lhs_reg_layout` of the
    accumulator's layout; ``a_smem`` is unused, so nothing is stored. The caller has stored
    and fenced ``b``. ``acc`` must be a register tensor (a fresh :func:`acc_alloc_tf32` /
    :func:`acc_alloc`, or a waited accumulator), not a pending wgmma token."""
    a_regs = gl.convert_layout(a.to(a_smem.dtype), lhs_reg_layout(acc.type.layout, a_smem.dtype.primitive_bitwidth))
    # Every warp's stores of b (fenced by the caller) must land before the wgmma reads it.
    thread_barrier()
    return warpgroup_mma(a_regs, b, acc, use_acc=use_acc, is_async=True)


@gluon.jit
def store_tail_rows(rows_desc, ptr, row_stride, smem, row0, col0, n_valid):
    """The first ``n_valid`` rows of the staged ``[BT, BN]`` tile to rows ``row0 ...`` at
    column ``col0`` of ``ptr`` (row stride ``row_stride`` elements): read back from shared
    memory in a coalesced register layout, written with masked stores. ``rows_desc`` is
    unused."""
    BT: gl.constexpr = smem.shape[0]
    BN: gl.constexpr = smem.shape[1]
    layout: gl.constexpr = tile_layout(BT, BN, gl.num_warps())
    x = smem.load(layout)
    rows = gl.arange(0, BT, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    offs = gl.expand_dims((row0 + rows).to(gl.int64) * row_stride, 1) + gl.expand_dims(col0 + cols, 0)
    gl.store(ptr + offs, x, mask=gl.expand_dims(rows < n_valid, 1))


#: wgmma with register accumulators (sm_90a): the ``ENGINE`` of gluon_sm90's launches.
WGMMA = GluonEngine(
    "wgmma", is_sm100=False, acc_alloc=acc_alloc, acc_alloc_tf32=acc_alloc_tf32, acc_in_flight=acc_in_flight,
    acc_layout=acc_layout, acc_read=acc_read, acc_write=acc_write, mma=mma, mma_reg_a=mma_reg_a, mma_wait=mma_wait,
    mma_wait_until=mma_wait_until, store_tail_rows=store_tail_rows,
)
