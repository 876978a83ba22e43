"""The matrix engine both Gluon backends share: one call per MMA step on Blackwell and Hopper.

Usage (for kernel authors; every helper takes ``IS_SM100: gl.constexpr`` last)::

    from gdn_dispatch.backends.gluon_common import engine as E

    acc = E.acc_alloc(64, BV, IS_SM100)                  # TMEM descriptor (sm100) | fp32 zeros (sm90)
    acc = E.mma(a_smem, b_smem, acc, False, bar, IS_SM100)  # issue acc = a @ b (use_acc=True: +=), async
    acc = E.mma_wait(acc, bar, phase, IS_SM100)            # wait for every MMA issued so far
    acc = E.mma_wait_until(acc, bar, phase, 1, IS_SM100)   # wait for this one; 1 later may run
    x = E.acc_read(acc, IS_SM100)                          # fp32 registers in E.acc_layout(64, BV, ...)
    acc = E.acc_write(acc, x * 2.0, IS_SM100)              # overwrite the accumulator from registers
    acc = E.mma_reg_a(x, a_smem, b_smem, acc, False, bar, IS_SM100)  # left operand from registers

* Operands ``a`` [M, K] and ``b`` [K, N] are shared-memory descriptors in an NVMMASharedLayout
  (``E.smem_layout(shape, dtype)`` or a TMA descriptor's ``.layout``); ``b`` may be a
  ``.permute((1, 0))`` view, and so may ``a`` for 16-bit types (k^T from a [64, K] k tile).
* Always rebind the result (``acc = E.mma(...)``): on sm90 the accumulator is a value
  (a wgmma token, then a register tensor), on sm100 the same TMEM descriptor comes back.
* ``bar`` is one mbarrier per MMA site (``gl.allocate_shared_memory(gl.int64, [1],
  mbarrier.MBarrierLayout())`` + ``mbarrier.init(bar, count=1)``; allocate it on both archs,
  sm90 ignores it). ``E.mma`` commits every tcgen05 op issued so far to it, so it completes
  once per call: wait with ``phase = (number of earlier completions) & 1``.
* Two MMAs in flight at once: give each its own ``bar`` and wait each (on sm90 the first
  ``mma_wait`` waits for both wgmma groups, the second returns at once).
* Before an MMA reads shared memory written from registers: ``smem.store(x)`` then
  ``fence_async_shared()`` (generic -> async proxy). :func:`mma` issues a CTA barrier itself
  so that every warp's stores (and TMEM stores from :func:`acc_write`) precede the issue.
* Register layouts: ``E.acc_layout(M, N, IS_SM100, num_warps)`` is where ``acc_read`` lands
  and what ``acc_write`` expects; rows as ``gl.SliceLayout(1, that)``. Use ``num_warps=4``
  (one warpgroup: wgmma's M = 64 per warpgroup, tcgen05's 128 TMEM lanes).
* TMEM budget (sm100): an fp32 [M, N] accumulator takes N columns (M <= 128); <= 512 in all.
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
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from gdn_dispatch.backends.gluon_common.compat import thread_barrier, tmem_reg_layout


@gluon.constexpr_function
def smem_layout(shape, dtype):
    """NVMMASharedLayout for an MMA operand / TMA tile of ``shape`` (widest swizzle that fits)."""
    return gl.NVMMASharedLayout.get_default_for(list(shape), dtype)


@gluon.constexpr_function
def acc_tmem_layout(M, N):
    """TMEM layout of an fp32 [M, N] accumulator (one MMA instruction tile: M <= 128 lanes)."""
    return TensorMemoryLayout(block=(min(M, 128), N), col_stride=1)


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
def acc_layout(M, N, IS_SM100, num_warps):
    """Register layout of an fp32 [M, N] accumulator read by :func:`acc_read` (and of
    anything written back by :func:`acc_write`)."""
    if IS_SM100:
        return tmem_reg_layout(gl.float32, [M, N], acc_tmem_layout(M, N), num_warps)
    return wgmma_layout(M, N, num_warps)


@gluon.jit
def acc_alloc(M: gl.constexpr, N: gl.constexpr, IS_SM100: gl.constexpr):
    """A fresh fp32 [M, N] accumulator: TMEM (sm100, contents undefined) or zeros (sm90)."""
    if IS_SM100:
        acc = allocate_tensor_memory(gl.float32, [M, N], acc_tmem_layout(M, N))
    else:
        acc = gl.zeros([M, N], gl.float32, layout=wgmma_layout(M, N, gl.num_warps()))
    return acc


@gluon.jit
def acc_alloc_tf32(M: gl.constexpr, N: gl.constexpr, IS_SM100: gl.constexpr):
    """:func:`acc_alloc` for fp32 operands (tf32 MMAs): on sm90 the wgmma instruction's K
    is 8, and the accumulator layout names it; TMEM is the same on sm100."""
    if IS_SM100:
        acc = allocate_tensor_memory(gl.float32, [M, N], acc_tmem_layout(M, N))
    else:
        acc = gl.zeros([M, N], gl.float32, layout=wgmma_layout(M, N, gl.num_warps(), 8))
    return acc


@gluon.jit
def acc_in_flight(acc, IS_SM100: gl.constexpr):
    """``acc`` typed as the result of an issued, unwaited :func:`mma`: the initial value of
    a loop-carried accumulator that each iteration leaves in flight for the next (sm90's
    async wgmma result is a token type, not a tensor; sm100 returns the TMEM handle)."""
    if IS_SM100:
        out = acc
    else:
        out = warpgroup_mma_init(acc)
    return out


@gluon.jit
def mma(a, b, acc, use_acc, bar, IS_SM100: gl.constexpr):
    """Issue ``acc = a @ b (+ acc if use_acc)`` asynchronously; returns the accumulator handle.

    sm100: tcgen05_mma into TMEM, then tcgen05_commit(bar): ``bar`` completes one phase when
    this and every earlier tcgen05 op of the CTA are done. sm90: an async wgmma (its own
    commit group); ``bar`` is unused.
    """
    # Every warp's shared-memory operand stores (fenced by the caller) and TMEM stores must
    # land before the single issuing thread starts the MMA.
    thread_barrier()
    if IS_SM100:
        tcgen05_mma(a, b, acc, use_acc=use_acc)
        tcgen05_commit(bar)
        out = acc
    else:
        out = warpgroup_mma(a, b, acc, use_acc=use_acc, is_async=True)
    return out


@gluon.jit
def mma_wait(acc, bar, phase, IS_SM100: gl.constexpr):
    """Wait until every MMA issued so far is complete; returns the (readable) accumulator."""
    if IS_SM100:
        mbarrier.wait(bar, phase)
        out = acc
    else:
        out = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    return out


@gluon.jit
def mma_wait_until(acc, bar, phase, PENDING: gl.constexpr, IS_SM100: gl.constexpr):
    """Wait until ``acc``'s MMA is complete while the ``PENDING`` MMAs issued after it may
    still run; returns the (readable) accumulator.

    sm100: ``bar`` is that MMA's own barrier (its commit covers it and every earlier op).
    sm90: wgmma groups retire in issue order, so "at most PENDING outstanding" is exactly
    "this one and everything before it are done".
    """
    if IS_SM100:
        mbarrier.wait(bar, phase)
        out = acc
    else:
        out = warpgroup_mma_wait(num_outstanding=PENDING, deps=(acc,))
    return out


@gluon.jit
def acc_read(acc, IS_SM100: gl.constexpr):
    """The accumulator as fp32 registers in ``acc_layout(M, N, IS_SM100, num_warps)``."""
    if IS_SM100:
        M: gl.constexpr = acc.shape[0]
        N: gl.constexpr = acc.shape[1]
        out = acc.load(acc_layout(M, N, True, gl.num_warps()))
    else:
        out = acc
    return out


@gluon.jit
def acc_write(acc, value, IS_SM100: gl.constexpr):
    """Overwrite the accumulator with ``value`` (fp32 registers, any layout); returns it."""
    M: gl.constexpr = value.shape[0]
    N: gl.constexpr = value.shape[1]
    v = gl.convert_layout(value, acc_layout(M, N, IS_SM100, gl.num_warps()))
    if IS_SM100:
        acc.store(v)
        out = acc
    else:
        out = v
    return out


# ----------------------------------------------------------------------------------------
# Left operand from registers (sm90 wgmma; staged through shared memory on sm100)


@gluon.constexpr_function
def lhs_reg_layout(acc_reg_layout, bitwidth):
    """sm90: the register layout wgmma reads a left operand in, for an accumulator in
    ``acc_reg_layout`` and operands of ``bitwidth`` bits (a 32-bit register holds
    ``32 // bitwidth`` consecutive k: 2 for 16-bit types, 1 for fp32 / tf32)."""
    return gl.DotOperandLayout(operand_index=0, parent=acc_reg_layout, k_width=32 // bitwidth)


@gluon.jit
def mma_reg_a(a, a_smem, b, acc, use_acc, bar, IS_SM100: gl.constexpr):
    """:func:`mma` with the left operand ``a`` in registers (any layout, ``a_smem``'s dtype
    and shape): issue ``acc = a @ b (+ acc if use_acc)`` asynchronously.

    sm90: wgmma reads ``a`` from registers (converted to :func:`lhs_reg_layout` of the
    accumulator's layout); ``a_smem`` is unused, so nothing is stored. sm100: tcgen05 reads
    its left operand from shared memory, so ``a`` is stored to ``a_smem`` (an NVMMA buffer
    the caller owns; every MMA that read it must be complete) and fenced here. Either way
    the caller has stored and fenced ``b``; wait with :func:`mma_wait` as for :func:`mma`.
    On sm90 ``acc`` must be a register tensor (a fresh :func:`acc_alloc_tf32` /
    :func:`acc_alloc`, or a waited accumulator), not a pending wgmma token.
    """
    if IS_SM100:
        a_smem.store(a.to(a_smem.dtype))
        # The MMA reads a_smem through the async proxy.
        fence_async_shared()
        out = mma(a_smem, b, acc, use_acc, bar, True)
    else:
        a_regs = gl.convert_layout(a.to(a_smem.dtype), lhs_reg_layout(acc.type.layout, a_smem.dtype.primitive_bitwidth))
        # Every warp's stores of b (fenced by the caller) must land before the wgmma reads it.
        thread_barrier()
        out = warpgroup_mma(a_regs, b, acc, use_acc=use_acc, is_async=True)
    return out


@gluon.jit
def tf32_lhs_order(x):
    """``x`` [M, K] (fp32) with the columns of every group of 8 reordered, k = 8q + 2t + e
    -> 8q + 4e + t: in that k order the sm90 tf32 accumulator layout (:func:`acc_layout`)
    already is wgmma's left-operand register layout, so :func:`mma_reg_a` of a product's
    result moves no data (a pure relabeling, no shuffles). The right operand must then be
    stored in :func:`tf32_rhs_order` (the same reorder of its rows): ``(x P)(P^T y) = x y``.
    The MMA is the same on sm100 (in any layout): there it only costs what it saves on sm90."""
    M: gl.constexpr = x.shape[0]
    K: gl.constexpr = x.shape[1]
    return gl.reshape(gl.permute(gl.reshape(x, [M, K // 8, 4, 2]), (0, 1, 3, 2)), [M, K])


@gluon.jit
def tf32_rhs_order(y):
    """``y`` [K, N] with its rows reordered as :func:`tf32_lhs_order` reorders the columns of
    the left operand (k = 8q + 2t + e -> 8q + 4e + t); store it for the MMA to read."""
    K: gl.constexpr = y.shape[0]
    N: gl.constexpr = y.shape[1]
    return gl.reshape(gl.permute(gl.reshape(y, [K // 8, 4, 2, N]), (0, 2, 1, 3)), [K, N])
