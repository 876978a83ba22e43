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
order and tensors as their addresses (from the second such launch on through one generated
function per call site, :func:`fast_launcher`). The kernel, the launcher and the stream
are Triton's own; only the binder, the cache lookup and the Python launcher's wrapping
are skipped, and they would have found this kernel.

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
        self.kernel = kernel  # keeps id(kernel), the site's key, from being reused
        params = {p.name: p for p in kernel.params}
        self.constexpr = tuple(params[name].is_constexpr for name in names)
        position = {name: i for i, name in enumerate(names)}
        # Every parameter given by name, none left to a default: else launch through the JIT.
        self.order = [position[p.name] for p in kernel.params] if set(names) == set(params) else None
        self.kept: dict[tuple, object] = {}
        # The straight-line launcher of the kernel launched last (fast_launcher), and each
        # kept kernel's, made once.
        self.fast = None
        self.fast_by_key: dict[tuple, object] = {}


#: Call sites by (id(kernel), names): a JITFunction hashes its cache key under a lock
#: (~0.3 µs per launch on the CPU here).
_CALL_SITES: dict[tuple, _CallSite] = {}
_MISSING = object()


def call_site(kernel, names: tuple[str, ...]) -> _CallSite:
    """The launch site of ``kernel`` called with keyword list ``names`` (made at first use)."""
    site = _CALL_SITES.get((id(kernel), names))
    if site is None:
        site = _CALL_SITES[(id(kernel), names)] = _CallSite(kernel, names)
    return site


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
    site = call_site(kernel, tuple(kwargs))
    if site.order is None:
        jit_launch()
        return
    device = torch.cuda.current_device()
    fast = site.fast
    if fast is not None:
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        if fast(device, kwargs, None, g0, g1, g2, runtime.stream(device), options):
            return
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
        fast = site.fast_by_key.get(key, _MISSING)
        if fast is _MISSING:
            fast = site.fast_by_key[key] = fast_launcher(site, raw, device, options, kwargs)
        site.fast = fast
        return
    compiled.run(g0, g1, g2, runtime.stream(device), compiled.function, compiled.packed_metadata, None, None,
                 None, *ordered)


_INT32_MIN, _INT32_END = -2 ** 31, 2 ** 31
#: Names every generated launcher's guards read (:func:`guard_lines`).
GUARD_NAMES = {"Tensor": torch.Tensor, "INT32_MIN": _INT32_MIN, "INT32_END": _INT32_END}


def guard_lines(i: int, value, specialized: bool, ns: dict) -> tuple[list[str], str] | None:
    """Source lines of a generated launcher that return False unless ``v{i}`` has the value
    class of ``value`` (as Triton's binder specializes on it: a tensor's dtype and 16-byte
    alignment, an integer's ``== 1`` / ``% 16`` classes when ``specialized`` and its int32
    range, a bool's or None's value, any other float or str its type), and the expression
    the launcher passes for it (a tensor's address ``a{i}``); None for another kind. Names
    the lines read are put into ``ns`` (and :data:`GUARD_NAMES`)."""
    v = f"v{i}"
    if isinstance(value, torch.Tensor):
        ns[f"D{i}"] = value.dtype
        return [f"    if not isinstance({v}, Tensor) or {v}.dtype is not D{i}:",
                "        return False",
                f"    a{i} = {v}.data_ptr()",
                f"    if (a{i} % 16 == 0) is not {value.data_ptr() % 16 == 0}:",
                "        return False"], f"a{i}"
    if value.__class__ is int:
        checks = [f"({v} == 1) is {value == 1}", f"({v} % 16 == 0) is {value % 16 == 0}"] if specialized else []
        checks.append(f"(INT32_MIN <= {v} < INT32_END) is {_INT32_MIN <= value < _INT32_END}")
        test = f"{v}.__class__ is not int or not ({' and '.join(checks)})"
    elif isinstance(value, bool) or value is None:
        test = f"{v} is not {value!r}"
    elif value.__class__ in (float, str):
        test = f"{v}.__class__ is not {value.__class__.__name__}"
    else:
        return None
    return [f"    if {test}:", "        return False"], v


def native_guard(launcher, native, key: str, value, specialized: bool, slot: int) -> bool:
    """Add to the native ``launcher`` (a :class:`gdn_dispatch.native` GuardedLauncher) the
    guard :func:`guard_lines` writes for ``value``, its argument ``key`` going to ``slot``
    of the C launch's list; False for a kind neither guards."""
    if isinstance(value, torch.Tensor):
        launcher.add_tensor(key, slot, value.dtype, value.data_ptr() % 16 == 0)
    elif value.__class__ is int:
        launcher.add_int(key, slot, specialized, value == 1, value % 16 == 0, _INT32_MIN <= value < _INT32_END)
    elif isinstance(value, bool) or value is None:
        launcher.add_object(key, slot, native.KIND_IDENTITY, value)
    elif value.__class__ in (float, str):
        launcher.add_object(key, slot, native.KIND_TYPE, value.__class__)
    else:
        return False
    return True


def compile_launcher(body: list[str], ns: dict):
    """The function ``launch`` that the source lines ``body`` define, over the names of
    ``ns`` (and :data:`GUARD_NAMES`)."""
    scope = {**GUARD_NAMES, **ns}
    exec(compile("\n".join(body), "<gdn_dispatch fast launcher>", "exec"), scope)
    return scope["launch"]


def fast_launcher(site: _CallSite, raw, device, options: tuple, kwargs: dict):
    """A straight-line launcher of the kept kernel ``raw`` (its C launch) for the keyword
    list ``kwargs`` of one launch that found it, or None (an argument kind it does not
    guard).

    The function returned, ``(device, options, kwargs, g0, g1, g2, stream) -> bool``, is
    :func:`launch_kept`'s key and argument loop unrolled for this call site with the
    kept kernel's key bound in: each constexpr compared with its value, each runtime
    argument's value class checked (:func:`guard_lines`), then the C launch. It returns
    False, having launched nothing, at the first difference (or another device or launch
    options), and :func:`launch_kept` then looks the key up as usual. One generated
    function instead of a loop, a key tuple and a dict lookup per launch: the
    plain-Triton forward launches five kernels a call. Where the native host layer is
    built (:mod:`gdn_dispatch.native`) the launcher is its C++ GuardedLauncher with the
    same checks, called the same way."""
    native = load_native()
    if native is not None:
        return _native_fast_launcher(native, site, raw, device, options, kwargs)
    ns = {"c_launch": raw.c_launch, "PREFIX": tuple(raw.prefix), "DEVICE": device, "OPTIONS": options}
    body = ["def launch(device, kwargs, _tensors, g0, g1, g2, stream, options):",
            "    if device != DEVICE or options != OPTIONS:",
            "        return False"]
    exprs = []
    for i, (name, constexpr, value) in enumerate(zip(kwargs, site.constexpr, kwargs.values())):
        body.append(f"    v{i} = kwargs[{name!r}]")
        if constexpr:
            # The key holds the value itself: a dict finds it by ==, and so does this.
            ns[f"C{i}"] = value
            body += [f"    if v{i} != C{i}:", "        return False"]
            exprs.append(f"v{i}")
            continue
        guard = guard_lines(i, value, True, ns)
        if guard is None:
            return None
        body += guard[0]
        exprs.append(guard[1])
    ordered = ", ".join(exprs[i] for i in site.order)
    body += [f"    c_launch(g0, g1, g2, stream, *PREFIX, {ordered})", "    return True"]
    return compile_launcher(body, ns)


def _native_fast_launcher(native, site: _CallSite, raw, device, options: tuple, kwargs: dict):
    """:func:`fast_launcher`'s checks and launch as a native GuardedLauncher, or None."""
    slot_of = {arg: slot for slot, arg in enumerate(site.order)}
    launcher = native.GuardedLauncher(raw.c_launch, tuple(raw.prefix), [None] * len(site.order), device, options,
                                      None, len(kwargs))
    for i, (name, constexpr, value) in enumerate(zip(kwargs, site.constexpr, kwargs.values())):
        if constexpr:
            launcher.add_object(name, slot_of[i], native.KIND_EQUAL, value)
        elif not native_guard(launcher, native, name, value, True, slot_of[i]):
            return None
    return launcher


def load_native():
    """The native host layer's module where it is built and on, else None (imported here
    on a kernel's first direct launch: CPU-only processes never reach it)."""
    from gdn_dispatch import native

    return native.load()


def _init_runtime() -> _Runtime:
    global _RUNTIME
    _RUNTIME = _Runtime()
    return _RUNTIME
