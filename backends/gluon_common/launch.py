"""Launching a planned Gluon kernel without re-running Triton's argument binder.

``fn[grid](**kwargs)`` makes Triton, on every call, bind and specialize each argument
(types, 16-byte pointer alignment, integer divisibility), hash a cache key, look the
compiled kernel up, and rebuild each TMA descriptor's host object before it encodes it.
That is the largest host cost of a forward's launches (about 100 us a launch on the
H200's host), and at small prefills the host, not the GPU, sets the time of a call.

A :class:`~.launch_plan.LaunchPlan` already fixes everything the binder derives except the
pointer arguments' dtypes and alignments and the device. So the first launch of a plan per
*launch specialization* (device, and dtype + ``data_ptr() % 16 == 0`` of every tensor
argument; the value classes Triton specializes integers on, except for arguments the kernel
declares ``do_not_specialize``, which Triton keys by type alone) goes through Triton's JIT
as usual, and the compiled kernel it returns is kept on the plan (``LaunchPlan.compiled``).
Later launches with the same specialization call Triton's C launch function of that kernel
directly (:func:`.compat.raw_launch`), with the arguments in the kernel's order, pointers
as addresses and each descriptor expanded as Triton's Python launcher expands it (the
``CUtensorMap`` encoded by Triton's own ``fill_tma_descriptor``, kept per descriptor
argument by address, rows and row stride, then rows, cols and strides); from the second
such launch on, through one generated function per plan that checks each argument's value
class against the kept kernel's and launches (:func:`fast_launcher`), falling back to the
key lookup at the first difference. The kernel, the C launcher and the descriptor
encoding are Triton's own; only the binder, the cache lookup
and the Python launcher's per-launch wrapping are skipped (on the H200's host a launch
through Triton's Python launcher took 16-20 us, the C launch with addresses about 6 us, and
an encoding 0.7 us). Where the C launch is not at hand (a launcher shape other than Triton
3.6's), the compiled kernel's launcher is called with each descriptor as the four fields it
reads (:class:`TmaArg`).

A plan is shared by every call of its class, whatever the call's token count ``B * T``
and sequence count ``N``: the grid (the plan's :class:`~.launch_plan.GridRule`) and each
descriptor's row count are computed here per launch from those two numbers and the
tensors. Neither is part of what Triton specializes on (a descriptor's signature is its
block and layout; the kernels' sequence and row counts are ``do_not_specialize``), so a
new length compiles nothing and binds nothing.

The direct path uses Triton's CompiledKernel launch interface (``run``, ``function``,
``packed_metadata``), its launcher's internals and its reading of descriptor arguments, so
it is taken only on the Triton releases it was verified with
(:data:`.compat.DIRECT_LAUNCH_TRITON`). Another release, a compiled kernel without that
interface, a registered launch hook (profilers such as proton read launch metadata), or
``GDN_DISPATCH_JIT_LAUNCH=1`` (read at call time) send every launch through ``fn[grid]``.
Results are the same either way.
"""

from __future__ import annotations

import torch

from gdn_dispatch.envvars import getenv

from gdn_dispatch.backends.direct_launch import compile_launcher, guard_lines, load_native, native_guard
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
    return bind_arguments(device_index, args, unspecialized)[0]


def bind_arguments(device_index: int, args: dict, unspecialized: frozenset = frozenset()) -> tuple[tuple, list]:
    """``(launch_specialization(...), values)``: the key, and the arguments as the launcher
    takes them, in ``args``' order (a tensor as its address: the C launcher then skips the
    per-pointer ``data_ptr()`` call and driver query; the contract already placed every
    tensor on the call's device)."""
    key = [device_index, tuple(args)]
    values = []
    append_key, append_value = key.append, values.append
    for name, value in args.items():
        # The value classes of _value_class, inline: this runs for every argument of every launch.
        cls = value.__class__
        if cls is int:
            if name in unspecialized:
                append_key(-2**31 <= value < 2**31)
            else:
                append_key((value == 1, value % 16 == 0, -2**31 <= value < 2**31))
        elif isinstance(value, torch.Tensor):
            ptr = value.data_ptr()
            append_key(value.dtype)
            append_key(ptr % 16 == 0)
            value = ptr
        else:
            append_key(_value_class(value, name not in unspecialized))
        append_value(value)
    return tuple(key), values


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

    def launches_directly(self) -> bool:
        """Whether launches skip Triton's binder now: a Triton release verified for direct
        launches, ``GDN_DISPATCH_JIT_LAUNCH`` not 1, no launch hook (read at every call)."""
        return self.direct and getenv(JIT_LAUNCH_ENV) != "1" and not self.hooks_set()

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
#: LaunchPlan.compiled holds the plan's _Slots under this key, beside the kernels (keyed by
#: tuples), and under _FAST the straight-line launcher of the kernel it launched last.
_SLOTS = "slots"
_FAST = "fast"


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
    if not runtime.launches_directly():
        _jit_launch(fn, launch, tensors, args, launch.grid_rule(rows, num_seqs))
        return
    device = runtime.current_device()
    fast = launch.compiled.get(_FAST)
    if fast is not None:
        g0, g1, g2 = launch.grid_rule.launch_grid(rows, num_seqs)
        if fast(device, args, tensors, g0, g1, g2, runtime.stream(device)):
            return
    slots = launch.compiled.get(_SLOTS)
    if slots is None:
        slots = launch.compiled[_SLOTS] = _Slots(fn, launch)
    key, values = bind_arguments(device, args, slots.unspecialized)
    kept = launch.compiled.get(key, _MISSING)
    if kept is _MISSING:
        kernel = _jit_launch(fn, launch, tensors, args, launch.grid_rule(rows, num_seqs))
        usable = all(hasattr(kernel, name) for name in compat.COMPILED_KERNEL_API)
        launch.compiled[key] = _Kept(kernel, slots, tuple(args)) if usable else None
        return
    if kept is None:  # a Triton whose compiled kernels lack the launch interface
        _jit_launch(fn, launch, tensors, args, launch.grid_rule(rows, num_seqs))
        return
    g0, g1, g2 = launch.grid_rule.launch_grid(rows, num_seqs)
    kept.launch(g0, g1, g2, runtime.stream(device), tensors, values)
    # The next launch of this plan tries this kernel's straight-line launcher first.
    if kept.fast is _MISSING:
        kept.fast = fast_launcher(kept, device, args, slots.unspecialized)
    launch.compiled[_FAST] = kept.fast


#: Encoded TMA descriptors kept per descriptor argument of a kept kernel, by (address, rows,
#: row stride); the map is cleared when full. Calls that recur with the same buffers (a
#: server's steady shapes, a benchmark loop) then encode nothing.
TMA_MAPS_KEPT = 64


class _Kept:
    """A kernel compiled for one plan and launch specialization, with its launcher
    arguments laid out once.

    With Triton's C launch at hand (:func:`.compat.raw_launch`), a launch fills a copy of
    the expanded argument list (each descriptor as ``CUtensorMap, rows, cols, row stride,
    1``) and calls it; the descriptor maps are encoded as Triton's launcher encodes them
    and kept by address, rows and row stride. Otherwise it calls the compiled kernel's
    launcher with each descriptor as a :class:`TmaArg`, which Triton encodes."""

    __slots__ = ("kernel", "raw", "template", "arg_pos", "descs", "fast")

    def __init__(self, kernel, slots: _Slots, names: tuple):
        self.kernel = kernel
        self.fast = _MISSING  # its fast_launcher, made at its first direct launch
        self.raw = compat.raw_launch(kernel)
        if self.raw is not None and len(self.raw.descriptor_meta) != len(slots.descs):
            self.raw = None  # not the kernel the plan describes: let Triton's launcher expand it
        by_index = {i: d for i, d in slots.descs}
        if self.raw is None:
            self.template = list(slots.template)
            self.arg_pos = [slots.index[name] for name in names]
            self.descs = [(i, d) for i, d in slots.descs]
            return
        # The expanded layout: a descriptor takes five slots (map, rows, cols, stride, 1).
        template, position, descs = [], {}, []
        meta = iter(self.raw.descriptor_meta)
        for i, value in enumerate(slots.template):
            d = by_index.get(i)
            if d is None:
                position[i] = len(template)
                template.append(value)
                continue
            cols = d.shape[1]
            descs.append((len(template), d, cols, {}, compat.tma_encoder(next(meta))))
            template.extend((None, None, cols, None, 1))
        self.template = template
        self.arg_pos = [position[slots.index[name]] for name in names]
        self.descs = descs

    def launch(self, g0: int, g1: int, g2: int, stream: int, tensors: dict, values: list) -> None:
        """One launch over the grid ``(g0, g1, g2)`` on ``stream``: ``values`` are the
        runtime arguments (:func:`bind_arguments`), ``tensors`` what the descriptors view."""
        args = self.template.copy()
        for pos, value in zip(self.arg_pos, values):
            args[pos] = value
        raw = self.raw
        if raw is None:
            for pos, d in self.descs:
                tensor = tensors[d.tensor]
                shape, strides = d.view_of(tensor)  # what DescPlan.build checks on the JIT path
                args[pos] = TmaArg(tensor, shape, strides)
            kernel = self.kernel
            kernel.run(g0, g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)
            return
        for pos, d, cols, maps, encode in self.descs:
            tensor = tensors[d.tensor]
            numel = tensor.numel()
            rows = numel // cols
            if tensor.dtype is d.dtype and rows * cols == numel and d.shape[0] is None and tensor.is_contiguous():
                stride = cols  # DescPlan.view_of of a contiguous tensor of whole rows, inline
            else:
                (rows, _), (stride, _) = d.view_of(tensor)  # other layouts, and every error
            ptr = tensor.data_ptr()
            tma_map = maps.get((ptr, rows, stride))
            if tma_map is None:
                tma_map = _encode_kept(maps, encode, ptr, rows, cols, stride)
            args[pos] = tma_map
            args[pos + 1] = rows
            args[pos + 3] = stride
        raw.c_launch(g0, g1, g2, stream, *raw.prefix, *args)


def _encode_kept(maps: dict, encode, ptr: int, rows: int, cols: int, stride: int):
    """Encode the TMA map of a ``[rows, cols]`` view at ``ptr`` (row stride ``stride``) and
    keep it in ``maps`` (emptied first when full)."""
    if len(maps) >= TMA_MAPS_KEPT:
        maps.clear()
    tma_map = maps[(ptr, rows, stride)] = encode(ptr, [rows, cols], [stride, 1])
    return tma_map


def fast_launcher(kept: _Kept, device, args: dict, unspecialized: frozenset):
    """A straight-line launcher of ``kept`` for the argument list ``args`` of one launch
    that bound to it, or None (no C launch at hand, or an argument kind it does not
    guard).

    The function returned, ``(device, args, tensors, g0, g1, g2, stream) -> bool``, does
    what :func:`bind_arguments` and :meth:`_Kept.launch` do for a launch with the same
    argument names and launch specialization, unrolled into one function with the kept
    kernel's constants bound in: each argument's value class checked against ``kept``'s
    (:func:`gdn_dispatch.backends.direct_launch.guard_lines`), then the descriptors' maps
    and the C launch. It returns False, having launched nothing, at the first argument
    whose class differs (or another device, or another argument count), and the caller
    then binds as usual: the generic path, with a loop and a dict per launch, costs about
    a fifth more of a call's host time (``tests/test_gluon_host_path.py``'s stub). Where
    the native host layer is built (:mod:`gdn_dispatch.native`) the launcher is its C++
    GuardedLauncher with the same checks, called the same way."""
    raw = kept.raw
    if raw is None:
        return None
    native = load_native()
    if native is not None:
        return _native_fast_launcher(native, kept, device, args, unspecialized)
    names = tuple(args)
    ns = {"c_launch": raw.c_launch, "PREFIX": tuple(raw.prefix), "T": kept.template, "DEVICE": device,
          "encode_kept": _encode_kept}
    body = ["def launch(device, args, tensors, g0, g1, g2, stream):",
            f"    if device != DEVICE or len(args) != {len(names)}:",
            "        return False"]
    slot_expr = {}
    for i, name in enumerate(names):
        body.append(f"    v{i} = args[{name!r}]")
        guard = guard_lines(i, args[name], name not in unspecialized, ns)
        if guard is None:
            return None
        body += guard[0]
        slot_expr[kept.arg_pos[i]] = guard[1]
    for j, (pos, d, cols, maps, encode) in enumerate(kept.descs):
        ns[f"VIEW{j}"], ns[f"MAPS{j}"], ns[f"ENC{j}"], ns[f"DD{j}"] = d.view_of, maps, encode, d.dtype
        t = f"t{j}"
        body.append(f"    {t} = tensors[{d.tensor!r}]")
        if d.shape[0] is None:  # whole rows of a contiguous tensor, as _Kept.launch reads them inline
            body += [f"    n{j} = {t}.numel()",
                     f"    r{j} = n{j} // {cols}",
                     f"    if {t}.dtype is DD{j} and r{j} * {cols} == n{j} and {t}.is_contiguous():",
                     f"        s{j} = {cols}",
                     "    else:",
                     f"        (r{j}, _), (s{j}, _) = VIEW{j}({t})"]
        else:
            body.append(f"    (r{j}, _), (s{j}, _) = VIEW{j}({t})")
        body += [f"    p{j} = {t}.data_ptr()",
                 f"    m{j} = MAPS{j}.get((p{j}, r{j}, s{j}))",
                 f"    if m{j} is None:",
                 f"        m{j} = encode_kept(MAPS{j}, ENC{j}, p{j}, r{j}, {cols}, s{j})"]
        slot_expr.update({pos: f"m{j}", pos + 1: f"r{j}", pos + 2: str(cols), pos + 3: f"s{j}", pos + 4: "1"})
    launch_args = ", ".join(slot_expr.get(k, f"T[{k}]") for k in range(len(kept.template)))
    body += [f"    c_launch(g0, g1, g2, stream, *PREFIX, {launch_args})", "    return True"]
    return compile_launcher(body, ns)


def _native_fast_launcher(native, kept: _Kept, device, args: dict, unspecialized: frozenset):
    """:func:`fast_launcher`'s checks and launch as a native GuardedLauncher, or None."""
    raw = kept.raw
    launcher = native.GuardedLauncher(raw.c_launch, tuple(raw.prefix), list(kept.template), device, None,
                                      _encode_kept, len(args))
    for i, (name, value) in enumerate(args.items()):
        if not native_guard(launcher, native, name, value, name not in unspecialized, kept.arg_pos[i]):
            return None
    for pos, d, cols, maps, encode in kept.descs:
        launcher.add_descriptor(d.tensor, pos, cols, d.dtype, d.shape[0] is None, d.view_of, maps, encode)
    return launcher


def _jit_launch(fn, launch: LaunchPlan, tensors: dict, args: dict, grid: tuple):
    """``fn[grid](...)`` with freshly built descriptors; returns Triton's compiled kernel."""
    descs = {d.arg: d.build(tensors[d.tensor]) for d in launch.descriptors}
    return fn[grid](**descs, **args, **launch.constexprs, num_warps=launch.num_warps, maxnreg=launch.maxnreg)
