"""Launching a planned Gluon kernel without re-running Triton's argument binder.

``fn[grid](**kwargs)`` makes Triton, on every call, bind and specialize each argument
(types, 16-byte pointer alignment, integer divisibility), hash a cache key, look the
compiled kernel up, and rebuild each TMA descriptor's host object before it encodes it.
That is the largest host cost of a forward's launches (about 100 us a launch on the
H200's host), and at small prefills the host, not the GPU, sets the time of a call.

A :class:`~.launch_plan.LaunchPlan` already fixes everything the binder derives except
the pointer arguments' dtypes and alignments and the device. So the first launch of a
plan per *launch specialization* (device, and dtype + ``data_ptr() % 16 == 0`` of every
tensor argument; the value classes Triton specializes integers on, except for arguments
the kernel declares ``do_not_specialize``, which Triton keys by type alone) goes through
Triton's JIT as usual, and the compiled kernel it returns is kept on the plan
(``LaunchPlan.compiled``). Later launches with the same specialization call that kernel's
launcher directly, with the arguments in the kernel's order and each descriptor as the
four fields the launcher reads (:class:`TmaArg`). The kernel, the launcher and the
descriptor encoding are Triton's own; only the binder and the cache lookup are skipped,
and they would have found this kernel.

A plan is shared by every call of its class, whatever the call's token count ``B * T``
and sequence count ``N``: the grid (the plan's :class:`~.launch_plan.GridRule`) and each
descriptor's row count are computed here per launch from those two numbers and the
tensors. Neither is part of what Triton specializes on (a descriptor's signature is its
block and layout; the kernels' sequence and row counts are ``do_not_specialize``), so a
new length compiles nothing and binds nothing.

The direct path uses Triton's CompiledKernel launch interface (``run``, ``function``,
``packed_metadata``) and its launcher's reading of descriptor arguments, so it is taken only
on the Triton releases it was verified with (:data:`.compat.DIRECT_LAUNCH_TRITON`). Another
release, a compiled kernel without that interface, a registered launch hook (profilers
such as proton read launch metadata), or ``GDN_DISPATCH_JIT_LAUNCH=1`` (read at call time)
send every launch through ``fn[grid]``. Results are the same either way.
"""

from __future__ import annotations

import os

import torch

from gdn_dispatch.backends.gluon_common import compat
from gdn_dispatch.backends.gluon_common.launch_plan import LaunchPlan

#: Set to "1" to launch every kernel through Triton's JIT (binder on every call).
JIT_LAUNCH_ENV = "GDN_DISPATCH_JIT_LAUNCH"


class TmaArg:
    """What Triton's launcher reads of a host TensorDescriptor: base tensor, global shape
    and strides (elements), padding. The block shape and shared layout are the compiled
    kernel's (its ``tensordesc_meta``), fixed by the plan."""

    __slots__ = ("base", "shape", "strides", "padding")

    def __init__(self, base: torch.Tensor, shape: list, strides: list):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, "zero"


def _value_class(value, specialized: bool = True):
    """The part of one runtime argument Triton's binder specializes on (an integer that is
    not ``specialized``: its type alone)."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if not specialized:
            return -2**31 <= value < 2**31
        return value == 1, value % 16 == 0, -2**31 <= value < 2**31
    return type(value)


def launch_specialization(device_index: int, args: dict, unspecialized: frozenset = frozenset()) -> tuple:
    """The key a compiled kernel of one plan is kept under: the device, the argument names,
    and the value class of each runtime argument (tensors: dtype and 16-byte alignment;
    integers named in ``unspecialized``: their type only)."""
    key = [device_index, tuple(args)]
    for name, value in args.items():
        if isinstance(value, torch.Tensor):  # the common case, inline: this runs per launch
            key.append(value.dtype)
            key.append(value.data_ptr() % 16 == 0)
        else:
            key.append(_value_class(value, name not in unspecialized))
    return tuple(key)


def unspecialized_args(fn) -> frozenset:
    """The parameters of ``fn`` declared ``do_not_specialize`` (by name or position), by name."""
    declared = getattr(fn, "do_not_specialize", None) or ()
    return frozenset(name for i, name in enumerate(compat.arg_names(fn)) if i in declared or name in declared)


class _Runtime:
    """Triton's launch knobs, the current device and the current-stream query, looked up
    once (an import per launch costs ~0.5 us). The driver is reached only when a kernel is
    launched directly, so CPU-only processes never touch it."""

    def __init__(self):
        import triton
        from triton import knobs

        self.knobs = knobs.runtime
        self.direct = compat.direct_launch_verified(triton.__version__)
        self.current_device = torch.cuda.current_device if torch.cuda.is_available() else lambda: None
        self._stream = None

    def hooks_set(self) -> bool:
        """Whether a launch hook is registered (profilers such as proton)."""
        return compat.launch_hooks_set(self.knobs)

    def stream(self, device: int) -> int:
        if self._stream is None:
            self._stream = compat.current_stream_query()
        return self._stream(device)


_RUNTIME: _Runtime | None = None


def _runtime() -> _Runtime:
    global _RUNTIME
    if _RUNTIME is None:
        _RUNTIME = _Runtime()
    return _RUNTIME


class _Slots:
    """Where each argument of one kernel goes for one plan: the kernel's argument list with
    the plan's constexprs filled in, the descriptor positions; and the kernel's
    ``do_not_specialize`` arguments."""

    def __init__(self, fn, launch: LaunchPlan):
        names = compat.arg_names(fn)
        self.unspecialized = unspecialized_args(fn)
        self.template = [launch.constexprs.get(name) for name in names]
        self.descs = [(names.index(d.arg), d) for d in launch.descriptors]
        self.index = {name: i for i, name in enumerate(names)}


_MISSING = object()
#: LaunchPlan.compiled holds the plan's _Slots under this key, beside the kernels (keyed by tuples).
_SLOTS = "slots"


def launch_planned(fn, launch: LaunchPlan, tensors: dict, args: dict, *, rows: int, num_seqs: int) -> None:
    """Launch the Gluon kernel ``fn`` as ``launch`` plans it, for one call.

    Parameters
    ----------
    fn : the ``@gluon.jit`` kernel the plan is for.
    launch : its shared LaunchPlan (grid rule, warps, register cap, constexprs, descriptors).
    tensors : the tensors the plan's descriptors view, by ``DescPlan.tensor`` name; each is
        checked against its plan (dtype, whole rows, contiguity or, for inputs read in
        place, token rows TMA reads) on every launch, which also gives its row count and
        row stride (:meth:`~.launch_plan.DescPlan.view_of`).
    args : every other runtime argument of ``fn`` by name (pointer tensors, int and float
        scalars), in the same order on every call; the constexprs come from the plan.
    rows, num_seqs : the call's counts the grid is computed from
        (:class:`~.launch_plan.GridRule`): the rows the stage counts (``B * T``, or
        ``B * T * H`` for the norms) and ``N``.

    Launches on the current CUDA device and stream, as ``fn[grid]`` would.
    """
    runtime = _runtime()
    if not runtime.direct or os.environ.get(JIT_LAUNCH_ENV, "") == "1" or runtime.hooks_set():
        _jit_launch(fn, launch, tensors, args, launch.grid_rule(rows, num_seqs))
        return
    slots = launch.compiled.get(_SLOTS)
    if slots is None:
        slots = launch.compiled[_SLOTS] = _Slots(fn, launch)
    device = runtime.current_device()
    key = launch_specialization(device, args, slots.unspecialized)
    kernel = launch.compiled.get(key, _MISSING)
    if kernel is _MISSING:
        kernel = _jit_launch(fn, launch, tensors, args, launch.grid_rule(rows, num_seqs))
        launch.compiled[key] = kernel if all(hasattr(kernel, name) for name in compat.COMPILED_KERNEL_API) else None
        return
    if kernel is None:  # a Triton whose compiled kernels lack the launch interface
        _jit_launch(fn, launch, tensors, args, launch.grid_rule(rows, num_seqs))
        return
    values = list(slots.template)
    for i, d in slots.descs:
        # What DescPlan.build checks on the JIT path (no TensorDescriptor is built here).
        tensor = tensors[d.tensor]
        shape, strides = d.view_of(tensor)
        values[i] = TmaArg(tensor, shape, strides)
    index = slots.index
    for name, value in args.items():
        values[index[name]] = value
    g0, g1, g2 = launch.grid_rule.launch_grid(rows, num_seqs)
    kernel.run(g0, g1, g2, runtime.stream(device), kernel.function, kernel.packed_metadata, None, None, None,
               *values)


def _jit_launch(fn, launch: LaunchPlan, tensors: dict, args: dict, grid: tuple):
    """``fn[grid](...)`` with freshly built descriptors; returns Triton's compiled kernel."""
    descs = {d.arg: d.build(tensors[d.tensor]) for d in launch.descriptors}
    return fn[grid](**descs, **args, **launch.constexprs, num_warps=launch.num_warps, maxnreg=launch.maxnreg)
