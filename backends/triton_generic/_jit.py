"""The ``jit`` decorator of this backend, and the Triton helpers every stage shares.

Why not plain ``triton.jit``: triton 3.6 decides at *decoration* time (import) whether a
function is compiled or interpreted, from ``TRITON_INTERPRET`` -- for our kernels and for
triton's own ``@jit`` library functions (``tl.sum``, ``tl.cdiv``...), which are decorated
when triton is imported. This backend must do both in one process: ahead-of-time compiles
for sm_80/sm_90 (``kernels_for_aot``) next to CPU runs under the interpreter (tests,
``backend="triton_generic"`` on CPU tensors), whatever was imported first.

:class:`Kernel` is a ``JITFunction`` (``triton.compile(ASTSource(...))`` and the GPU launcher
see an ordinary kernel) whose launch, when the interpreter is on *at launch time*, runs the
kernel's body as Python in triton's interpreter (its ``GridExecutor``). The callees are
resolved explicitly, without touching ``JITFunction``: the body is rewritten as triton's
interpreter rewrites it, and every call ``f(...)`` in it becomes ``_interpreted_call(f,
...)``, which runs ``f``'s own rewritten body when ``f`` is a ``@jit`` function (ours, or
triton's library functions such as ``tl.sum``) and calls ``f`` unchanged otherwise. Values
stay what they are, so a combine function handed to ``tl.reduce`` is still the library's own
and the interpreter's fast paths recognise it.

What is still patched during an interpreted launch is what triton's interpreter patches
for any interpreted kernel: ``triton.language`` (and ``triton.language.core``, which
triton's library functions call into) get the interpreter's builtins until the launch
returns. That patching is process-wide by triton's design and so is the interpreter's grid
state; interpreted launches therefore hold :data:`_INTERPRETER_LOCK`, one at a time. (A
GPU compile in another thread during an interpreted launch would see the patched language:
interpreting is for tests and CPU debugging, not for a serving process.)

Private triton APIs used here (``triton.runtime.interpreter``: ``ASTTransformer``,
``FunctionRewriter``, ``GridExecutor``, ``_patch_lang``), checked on triton 3.6.0.

Helpers here: the rows of a chunk slot (:func:`_slot_rows`), and ``_dot`` / ``_cast``, which
keep the interpreter's bfloat16 numerics those of the GPU (its matmul multiplies raw bit
patterns and its fp32 -> bf16 conversion truncates; see their docstrings).
"""

from __future__ import annotations

import ast
import inspect
import threading

import triton.language as tl
from triton import knobs
from triton.runtime import interpreter as _interp
from triton.runtime.jit import JITFunction

from gdn_dispatch.contract import GATE_FLOOR as _contract_gate_floor

LOG2E = 1.4426950408889634
#: :data:`gdn_dispatch.contract.GATE_FLOOR` inside the kernels (gates below it count as it).
GATE_FLOOR = tl.constexpr(_contract_gate_floor)
#: eps of the fused q/k l2-normalization, as gdn_dispatch.reference.L2NORM_EPS.
L2NORM_EPS = tl.constexpr(1e-6)
_lang_core = tl.core  # makes triton.language.core visible to _patch_lang(_patch_anchor)

#: Held for the whole of an interpreted launch (the language patches and the grid state of
#: triton's interpreter are process-wide).
_INTERPRETER_LOCK = threading.RLock()


def interpreting() -> bool:
    """True when kernels launched now run in triton's interpreter (read at call time)."""
    return bool(knobs.runtime.interpret)


class _CallResolver(_interp.ASTTransformer):
    """Triton's interpreter rewrite (assignments become interpreter tensors), plus every
    call ``f(*a, **kw)`` turned into ``_interpreted_call(f, *a, **kw)``."""

    def visit_Assign(self, node):
        node.value = self.visit(node.value)
        return super().visit_Assign(node)

    def visit_Call(self, node):
        self.generic_visit(node)
        return ast.Call(func=ast.Name(id="_interpreted_call", ctx=ast.Load()),
                        args=[node.func, *node.args], keywords=node.keywords)


class _Rewriter(_interp.FunctionRewriter):
    """Rewrites one ``@jit`` function for the interpreter into a private namespace: a copy
    of its module's globals with the interpreter's names and ``_interpreted_call`` added
    (the module itself is left as it is)."""

    ast_transformer = _CallResolver()

    def _compile_and_exec(self, transformed_ast):
        code = compile(transformed_ast, filename=self.filename, mode="exec")
        namespace = {**vars(_interp), **self.fn.__globals__, "_interpreted_call": _interpreted_call}
        local_namespace = dict(self.kwargs)
        exec(code, namespace, local_namespace)
        return local_namespace[self.fn.__name__]


_REWRITTEN: dict[object, object] = {}


def _rewritten(fn: JITFunction):
    """The interpreter's Python version of ``fn``'s body, with its callees resolved (cached)."""
    body = _REWRITTEN.get(fn.fn)
    if body is None:
        body = _REWRITTEN[fn.fn] = _Rewriter(fn.fn).rewrite_ast()
    return body


def _interpreted_call(f, *args, **kwargs):
    """A call inside an interpreted body: a ``@jit`` callee runs as its rewritten Python."""
    if isinstance(f, JITFunction):
        return _rewritten(f)(*args, **kwargs)
    return f(*args, **kwargs)


def _patch_anchor():
    """A function whose globals hold both ``tl`` and ``tl.core`` (for ``_patch_lang``)."""


def _run_interpreted(kernel: JITFunction, args, kwargs, grid):
    with _INTERPRETER_LOCK:
        scope = _interp._patch_lang(_patch_anchor)
        try:
            body = _rewritten(kernel)
            arg_names = list(inspect.signature(kernel.fn).parameters)
            return _interp.GridExecutor(body, arg_names, grid)(*args, **kwargs)
        finally:
            scope.restore()


class Kernel(JITFunction):
    """A ``JITFunction`` that runs in the interpreter when ``TRITON_INTERPRET`` is set at launch."""

    def run(self, *args, grid, warmup, **kwargs):
        if interpreting():
            if warmup:
                return None
            return _run_interpreted(self, args, kwargs, grid)
        return super().run(*args, grid=grid, warmup=warmup, **kwargs)


def jit(fn=None, *, do_not_specialize=()):
    """``triton.jit`` for this backend: the kernel runs compiled or interpreted, decided per launch."""

    def decorate(f):
        return Kernel(f, do_not_specialize=do_not_specialize)

    return decorate(fn) if fn is not None else decorate


@jit
def _slot_rows(cu_seqlens, i_s, N, BT: tl.constexpr):
    """Chunk slot ``i_s`` (see :mod:`gdn_dispatch.varlen`): ``t0``, its first token in the
    packed token axis (int64), and ``n_t``, how many of its ``BT`` rows belong to its
    sequence (int32; ``<= 0`` at an idle slot, whose program exits).

    The sequence is the largest ``n`` with ``cu[n] // BT + n <= i_s``, found by bisection
    over ``cu_seqlens`` (int32 or int64) with the invariant ``s_lo <= i_s < s_hi``; ``s_N`` is
    the slot count, so ``n < N``.

    Offset convention of every kernel: 64-bit scalar base pointers (``t0 * row_stride``)
    plus 32-bit offsets within the chunk (``o_i * row_stride + column``, below 64 * HV * 256),
    so that no [BT, BK] tile of 64-bit offsets occupies registers.
    """
    lo = N * 0
    hi = N + 0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        s_mid = tl.load(cu_seqlens + mid).to(tl.int64) // BT + mid
        below = s_mid <= i_s
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    bos = tl.load(cu_seqlens + lo).to(tl.int64)
    eos = tl.load(cu_seqlens + lo + 1).to(tl.int64)
    t0 = bos + (i_s - (bos // BT + lo)) * BT
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
def _prefetch_l2(ptrs, on):
    """Hint the L2 to fetch the 128-byte line of each pointer of ``ptrs`` where ``on`` (int32,
    same shape) is nonzero; returns zeros (the hint has no result). Not for the interpreter."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, on], dtype=tl.int32, is_pure=False, pack=1)


@jit
def _tf32_round(x):
    """fp32 ``x`` rounded to its 10 leading mantissa bits (TF32), as an fp32 value: an MMA
    reads it unchanged however it treats the 13 bits below (truncation or rounding)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@jit
def _bf16_round(x):
    """fp32 ``x`` rounded to nearest even at bf16's 7 mantissa bits, as an fp32 value: its
    conversion to bf16 (a store, or ``.to``) is then exact on the GPU and under the
    interpreter alike."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)


@jit
def _cast(x, dtype: tl.constexpr, INTERP_BF16: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest even (the GPU's conversion) also under the
    interpreter, whose fp32 -> bf16 conversion truncates: a biased error that would make
    the CPU tests judge worse numerics than the GPU has."""
    if INTERP_BF16 and dtype == tl.bfloat16:
        x = _bf16_round(x.to(tl.float32))
    return x.to(dtype)


def next_pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for n <= 1), in plain Python: triton's own
    next_power_of_2 is a constexpr function, about 10 us a call on the host path."""
    return 1 << (max(int(n), 1) - 1).bit_length()
