"""Launching a plain Triton kernel again without re-running Triton's argument binder.

``kernel[grid](**kwargs)`` makes Triton bind and specialize every argument (types, 16-byte
pointer alignment, integer divisibility), hash a cache key and look the compiled kernel up
on every launch: tens of microseconds per launch on a serving host, several times the GPU
time of a short prefill's kernels. :func:`launch_kept` goes through Triton's JIT on the
first launch of each *launch specialization* (device, launch options, each constexpr's
value, and each runtime argument's value class: a tensor's dtype and 16-byte alignment, an
integer's ``== 1`` / ``% 16`` / int32 range), keeps the compiled kernel it returns, and
later calls that kernel's C launch function (:func:`.gluon_common.compat.raw_launch`; its
Python launcher where that is not at hand) directly, with the arguments in the kernel's
order and tensors as their addresses. The kernel, the launcher and the stream are Triton's
own; only the binder, the cache lookup and the Python launcher's wrapping are skipped, and
they would have found this kernel.

This is the mechanism :mod:`gdn_dispatch.backends.gluon_common.launch` uses for planned
Gluon launches, for kernels without a plan: the key is computed from the arguments. It
takes the direct path under the same conditions, read from
:mod:`gdn_dispatch.backends.gluon_common.compat` (the Triton releases it was verified on, no
registered launch hook, ``GDN_DISPATCH_JIT_LAUNCH`` unset); otherwise every launch goes
through ``kernel[grid]``, with the same results.
"""

from __future__ import annotations

from typing import Callable

import torch

from gdn_dispatch.envvars import getenv

#: Set to "1" to launch every kernel through Triton's JIT (binder on every call); the
#: variable :mod:`gdn_dispatch.backends.gluon_common.launch` reads too.
JIT_LAUNCH_ENV = "GDN_DISPATCH_JIT_LAUNCH"


def value_class(value):
    """The part of one runtime argument Triton's binder specializes on."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value == 1, value % 16 == 0, -2**31 <= value < 2**31
    return type(value)


class _Runtime:
    """The direct path's conditions and Triton's current-stream query, looked up once
    (first GPU launch: a CPU-only process never imports the Gluon compat layer)."""

    def __init__(self):
        import triton
        from triton import knobs

        from gdn_dispatch.backends.gluon_common import compat

        self.compat = compat
        self.knobs = knobs.runtime
        self.verified = compat.direct_launch_verified(triton.__version__)
        self.stream = compat.current_stream_query()

    def direct(self) -> bool:
        return (self.verified and getenv(JIT_LAUNCH_ENV) != "1"
                and not self.compat.launch_hooks_set(self.knobs))


_RUNTIME: _Runtime | None = None


class _CallSite:
    """One kernel called with one keyword list: which arguments are constexprs (their value
    is part of the key), where each goes in the kernel's order, and the kept kernels."""

    def __init__(self, kernel, names: tuple[str, ...]):
        params = {p.name: p for p in kernel.params}
        self.constexpr = tuple(params[name].is_constexpr for name in names)
        position = {name: i for i, name in enumerate(names)}
        # Every parameter given by name, none left to a default: else launch through the JIT.
        self.order = [position[p.name] for p in kernel.params] if set(names) == set(params) else None
        self.kept: dict[tuple, object] = {}


_CALL_SITES: dict[tuple, _CallSite] = {}
_MISSING = object()


def launch_kept(kernel, grid: tuple, options: tuple, kwargs: dict, jit_launch: Callable[[], object]) -> None:
    """Launch ``kernel`` over ``grid`` with ``kwargs`` on the current device and stream.

    Parameters
    ----------
    kernel : a ``triton.jit`` kernel (a JITFunction).
    grid : up to three ints.
    options : the launch options ``jit_launch`` passes (e.g. ``(num_warps, num_stages)``),
        part of the key.
    kwargs : every parameter of ``kernel`` by name, in the same order at every call site.
    jit_launch : launches through Triton's JIT (``kernel[grid](**kwargs, ...)``) and returns
        the compiled kernel: run on the first launch of a specialization, and on every
        launch when the direct path is off.
    """
    runtime = _RUNTIME or _init_runtime()
    if not runtime.direct():
        jit_launch()
        return
    names = tuple(kwargs)
    site = _CALL_SITES.get((kernel, names))
    if site is None:
        site = _CALL_SITES[(kernel, names)] = _CallSite(kernel, names)
    if site.order is None:
        jit_launch()
        return
    device = torch.cuda.current_device()
    key = [device, options]
    values = []
    for constexpr, value in zip(site.constexpr, kwargs.values()):
        if constexpr:
            key.append(value)
        elif isinstance(value, torch.Tensor):  # as an address: the C launcher skips its pointer query
            ptr = value.data_ptr()
            key.append((value.dtype, ptr % 16 == 0))
            value = ptr
        else:
            key.append(value_class(value))
        values.append(value)
    key = tuple(key)
    kept = site.kept.get(key, _MISSING)
    if kept is _MISSING:
        compiled = jit_launch()
        usable = all(hasattr(compiled, name) for name in runtime.compat.COMPILED_KERNEL_API)
        site.kept[key] = (compiled, runtime.compat.raw_launch(compiled)) if usable else None
        return
    if kept is None:  # a Triton whose compiled kernels lack the launch interface
        jit_launch()
        return
    compiled, raw = kept
    g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
    ordered = [values[i] for i in site.order]
    if raw is not None and not raw.descriptor_meta:
        raw.c_launch(g0, g1, g2, runtime.stream(device), *raw.prefix, *ordered)
        return
    compiled.run(g0, g1, g2, runtime.stream(device), compiled.function, compiled.packed_metadata, None, None,
                 None, *ordered)


def _init_runtime() -> _Runtime:
    global _RUNTIME
    _RUNTIME = _Runtime()
    return _RUNTIME
