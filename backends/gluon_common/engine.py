"""The matrix-engine contract of the shared Gluon pipeline: what a backend hands its kernels.

The pipeline kernels are written once; the MMA steps they take come from the backend that
launched them, as the kernels' ``ENGINE`` constexpr argument: a :class:`GluonEngine`
whose attributes are ``@gluon.jit`` / ``@gluon.constexpr_function`` functions.
``gluon_sm100.engine.TCGEN05`` issues tcgen05 MMAs into TMEM accumulators;
``gluon_sm90.engine.WGMMA`` issues asynchronous wgmma with register accumulators. The
kernels never import either (the backends import the pipeline).

Usage (for kernel authors)::

    acc = ENGINE.acc_alloc(64, BV)                    # TMEM descriptor (sm100) | fp32 zeros (sm90)
    acc = ENGINE.mma(a_smem, b_smem, acc, False, bar) # issue acc = a @ b (use_acc=True: +=), async
    acc = ENGINE.mma_wait(acc, bar, phase)            # wait for every MMA issued so far
    acc = ENGINE.mma_wait_until(acc, bar, phase, 1)   # wait for this one; 1 later may run
    x = ENGINE.acc_read(acc)                          # fp32 registers in ENGINE.acc_layout(64, BV, nw)
    acc = ENGINE.acc_write(acc, x * 2.0)              # overwrite the accumulator from registers
    acc = ENGINE.mma_reg_a(x, a_smem, b_smem, acc, False, bar)  # left operand from registers
    if ENGINE.IS_SM100: ...                           # the rare engine-specific step, as a constexpr

* Operands ``a`` [M, K] and ``b`` [K, N] are shared-memory descriptors in an NVMMASharedLayout
  (:func:`smem_layout` or a TMA descriptor's ``.layout``); ``b`` may be a
  ``.permute((1, 0))`` view, and so may ``a`` for 16-bit types (k^T from a [64, K] k tile).
* Always rebind the result (``acc = ENGINE.mma(...)``): on sm90 the accumulator is a value
  (a wgmma token, then a register tensor), on sm100 the same TMEM descriptor comes back.
* ``bar`` is one mbarrier per MMA site (``gl.allocate_shared_memory(gl.int64, [1],
  mbarrier.MBarrierLayout())`` + ``mbarrier.init(bar, count=1)``; allocate it on both
  engines, wgmma ignores it). tcgen05's ``mma`` commits every op issued so far to it, so it
  completes once per call: wait with ``phase = (number of earlier completions) & 1``.
* Two MMAs in flight at once: give each its own ``bar`` and wait each (on sm90 the first
  ``mma_wait`` waits for both wgmma groups, the second returns at once).
* Before an MMA reads shared memory written from registers: ``smem.store(x)`` then
  ``fence_async_shared()`` (generic -> async proxy). ``mma`` issues a CTA barrier itself
  so that every warp's stores (and TMEM stores from ``acc_write``) precede the issue.
* Register layouts: ``ENGINE.acc_layout(M, N, num_warps)`` is where ``acc_read`` lands and
  what ``acc_write`` expects; rows as ``gl.SliceLayout(1, that)``. Use ``num_warps=4``
  (one warpgroup: wgmma's M = 64 per warpgroup, tcgen05's 128 TMEM lanes).
* ``ENGINE.store_tail_rows(rows_desc, ptr, row_stride, smem, row0, col0, n_valid)`` writes
  the first ``n_valid`` rows of a staged tile (a sequence's last chunk): a TMA scatter on
  sm100, masked register stores on sm90 (no TMA scatter there).
* TMEM budget (sm100): an fp32 [M, N] accumulator takes N columns (M <= 128); <= 512 in all.

Every engine provides the same names (:data:`ENGINE_API`); the host reads ``is_sm100``
(plans: descriptors, register caps, TMEM budgets).
"""

from __future__ import annotations

import hashlib

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

#: The functions every engine provides, by name.
ENGINE_API = ("acc_alloc", "acc_alloc_tf32", "acc_in_flight", "acc_layout", "acc_read", "acc_write", "mma",
              "mma_reg_a", "mma_wait", "mma_wait_until", "store_tail_rows")


class GluonEngine(str):
    """One matrix engine: its name (the string value) with the :data:`ENGINE_API`
    functions as attributes, built once by its backend package.

    A kernel constexpr must survive what Triton does with constexpr values: its compile
    caches key on ``cache_key`` (else ``str`` / ``repr``), so both name the engine and hash
    the source of its functions (editing an engine recompiles the kernels that take it);
    launch hooks serialize constexprs to JSON, which a ``str`` is. The functions are
    instance attributes, so Triton reads them unbound.

    Attributes
    ----------
    is_sm100 : bool, for the host (plans: descriptors, register caps, TMEM budgets).
    IS_SM100 : the same as a kernel constexpr, for the rare engine-specific kernel step.
    """

    def __new__(cls, name: str, *, is_sm100: bool, **functions):
        missing = sorted(set(ENGINE_API) - set(functions))
        extra = sorted(set(functions) - set(ENGINE_API))
        if missing or extra:
            raise TypeError(f"engine {name!r}: missing {missing}, unexpected {extra} (see ENGINE_API)")
        engine = super().__new__(cls, name)
        engine.is_sm100 = bool(is_sm100)
        engine.IS_SM100 = gl.constexpr(bool(is_sm100))
        for attr, fn in functions.items():
            setattr(engine, attr, fn)
        return engine

    @property
    def cache_key(self) -> str:
        keys = [getattr(self, name).cache_key for name in ENGINE_API]
        return hashlib.sha256(f"{str.__str__(self)}:{':'.join(keys)}".encode()).hexdigest()

    def __repr__(self) -> str:
        return f"GluonEngine({str.__str__(self)}, {self.cache_key[:16]})"


@gluon.constexpr_function
def smem_layout(shape, dtype):
    """NVMMASharedLayout for an MMA operand / TMA tile of ``shape`` (widest swizzle that fits)."""
    return gl.NVMMASharedLayout.get_default_for(list(shape), dtype)


@gluon.jit
def tf32_lhs_order(x):
    """``x`` [M, K] (fp32) with the columns of every group of 8 reordered, k = 8q + 2t + e
    -> 8q + 4e + t: in that k order the sm90 tf32 accumulator layout (``acc_layout``)
    already is wgmma's left-operand register layout, so ``mma_reg_a`` of a product's
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
