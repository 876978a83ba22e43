"""The ``jit`` decorator of this backend, and the Triton helpers every stage shares.

Why not plain ``triton.jit``: triton 3.6 decides at *decoration* time (import) whether a
function is compiled or interpreted, from ``TRITON_INTERPRET`` -- for our kernels and for
triton's own ``@jit`` library functions (``tl.sum``, ``tl.cdiv``...), which are decorated
when triton is imported. This backend must do both in one process: ahead-of-time compiles
for sm_80/sm_90 (``kernels_for_aot``) next to CPU runs under the interpreter (tests,
``backend="triton_generic"`` on CPU tensors), whatever was imported first.

:class:`Kernel` is a ``JITFunction`` (``triton.compile(ASTSource(...))`` and the GPU launcher
see an ordinary kernel) whose launch, when the interpreter is on *at launch time*, runs
triton's interpreter instead, within :func:`_interpreted_calls`: the ``triton.language``
patching the interpreter applies to a kernel's module is applied to ``triton.language.core``
as well, and any ``@jit`` function the kernel calls (ours or triton's) runs as interpreted
Python; all of it is undone when the launch returns.

Helpers here: the chunk bounds from the shared chunk tables, and ``_dot`` / ``_cast``, which
keep the interpreter's bfloat16 numerics those of the GPU (its matmul multiplies raw bit
patterns and its fp32 -> bf16 conversion truncates; see their docstrings).
"""

from __future__ import annotations

import contextlib

import triton
import triton.language as tl
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction, _patch_lang
from triton.runtime.jit import JITFunction

LOG2E = 1.4426950408889634
#: eps of the fused q/k l2-normalization, as gdn_dispatch.reference.L2NORM_EPS.
L2NORM_EPS = tl.constexpr(1e-6)
_lang_core = tl.core  # makes triton.language.core visible to _patch_lang(_patch_anchor)


def interpreting() -> bool:
    """True when kernels launched now run in triton's interpreter (read at call time)."""
    return bool(knobs.runtime.interpret)


_INTERPRETED: dict[int, InterpretedFunction] = {}


def _interpreted(fn: JITFunction) -> InterpretedFunction:
    key = id(fn.fn)
    if key not in _INTERPRETED:
        _INTERPRETED[key] = InterpretedFunction(fn.fn)
    return _INTERPRETED[key]


def _call_interpreted(fn: JITFunction, *args, **kwargs):
    """``JITFunction.__call__`` during an interpreted launch: run the function's rewritten
    Python body (the language is already patched by :func:`_interpreted_calls`)."""
    return _interpreted(fn).rewrite()(*args, **kwargs)


def _patch_anchor():
    """A function whose globals hold both ``tl`` and ``tl.core`` (for ``_patch_lang``)."""


@contextlib.contextmanager
def _interpreted_calls():
    scope = _patch_lang(_patch_anchor)
    original = JITFunction.__call__
    JITFunction.__call__ = _call_interpreted
    try:
        yield
    finally:
        JITFunction.__call__ = original
        scope.restore()


class Kernel(JITFunction):
    """A ``JITFunction`` that runs in the interpreter when ``TRITON_INTERPRET`` is set at launch."""

    def run(self, *args, grid, warmup, **kwargs):
        if interpreting():
            with _interpreted_calls():
                return _interpreted(self).run(*args, grid=grid, warmup=warmup, **kwargs)
        return super().run(*args, grid=grid, warmup=warmup, **kwargs)


def jit(fn=None, *, do_not_specialize=()):
    """``triton.jit`` for this backend: the kernel runs compiled or interpreted, decided per launch."""

    def decorate(f):
        return Kernel(f, do_not_specialize=do_not_specialize)

    return decorate(fn) if fn is not None else decorate


@jit
def _chunk_rows(cu_seqlens, chunk_seq, chunk_local, i_c, BT: tl.constexpr):
    """Chunk ``i_c`` of the flat chunk list: ``t0``, its first token in the packed token axis
    (int64), and ``n_t``, how many of its ``BT`` rows belong to its sequence (int32, >= 1).

    Offset convention of every kernel: 64-bit scalar base pointers (``t0 * row_stride``)
    plus 32-bit offsets within the chunk (``o_i * row_stride + column``, below 64 * HV * 256),
    so that no [BT, BK] tile of 64-bit offsets occupies registers.
    """
    i_n = tl.load(chunk_seq + i_c)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    t0 = bos + tl.load(chunk_local + i_c).to(tl.int64) * BT
    n_t = tl.minimum(eos - t0, BT).to(tl.int32)
    return t0, n_t


@jit
def _dot(a, b, acc, PREC: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation.

    ``INTERP_BF16`` is set only under the interpreter with bfloat16 data: triton 3.6's
    interpreter stores bfloat16 as uint16 and ``np.matmul``s the bit patterns. Upcasting the
    (already bf16-rounded) operands gives what the tensor cores compute: exact products of
    bf16 values summed in fp32.
    """
    if INTERP_BF16:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PREC)


@jit
def _cast(x, dtype: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest even (the GPU's conversion) also under the
    interpreter, whose fp32 -> bf16 conversion truncates: a biased error that would make
    the CPU tests judge worse numerics than the GPU has."""
    if INTERP_BF16 and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))
