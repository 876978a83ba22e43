"""The native host layer: a small torch C++ extension the launch paths use where it is built.

What it holds (``host_layer.cpp``): ``GuardedLauncher``, the straight-line
launcher of a kept kernel that the generated Python launchers
(:func:`gdn_dispatch.backends.gluon_common.launch.fast_launcher`,
:func:`gdn_dispatch.backends.direct_launch.fast_launcher`) otherwise are: the same
argument checks and the same C launch, with the tensors read on ``at::Tensor`` instead of
through torch's Python attributes (on the H200's host one tensor's metadata costs about
1 µs from Python, 0.1 µs from C++: ``benchmarks/native_host_probe.py``).

It is compiled once per machine, never on a call: ``python -m gdn_dispatch warmup`` on a
CUDA device (or :func:`build`, on any machine) compiles it into the cache directory
(``$GDN_SELFTEST_CACHE`` or ``~/.cache/gdn_dispatch``, under ``native/``), with torch's C++
extension builder (a C++ compiler and ninja; about 20 s on a 16-core host, a few minutes on
2 cores). A process loads it at its first launch when it is there for this torch, Python
and source; otherwise the launch paths use their Python launchers, with the same results. ``GDN_DISPATCH_NATIVE=0``
turns it off, ``=1`` requires it (a launch raises where it is not built); read where a
launcher or allocator is made (a kernel's first direct launch, a call class's first
call). ``python -m gdn_dispatch info`` says which it is.

And ``Allocator`` (:func:`allocator`): the tensors a call's launches write, allocated in one
call (``at::empty`` in C++: on the H200's host five allocations took 24.8 µs from Python,
10.7 from C++); ``admit`` (:func:`admission`): the contract's tensor checks of the
common call (contiguous inputs, a state pool or not), which returns the call's sizes or None
(then the Python contract checks it, and raises where a rule is broken); and
``tma_rows_ok``: whether contiguous inputs are what the TMA unit reads in place;
``CallProgram`` (the backends' call programs); and ``stats`` / ``reset_stats(timing)``:
counters the host benchmarks read (descriptors reused, found or encoded; the programs'
phases timed while timing is on).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import sys
import threading
from pathlib import Path

import torch

from gdn_dispatch.envvars import getenv
from gdn_dispatch.gate import cache_dir

#: "0" turns the native host layer off, "1" requires it.
NATIVE_ENV = "GDN_DISPATCH_NATIVE"
SOURCE = Path(__file__).with_name("host_layer.cpp")
#: How to build it, for the messages: warmup builds it only where it has a CUDA device to
#: warm (it returns early on the CPU); :func:`build` needs no GPU.
BUILD_HINT = ("python -m gdn_dispatch warmup builds it on a CUDA device; "
              "python -c 'from gdn_dispatch import native; native.build()' on any machine")
#: Release flags: without NDEBUG, pybind11 asks whether the GIL is held at every reference
#: count change (a third of a call program's host time on a CPU stub).
CFLAGS = ("-O2", "-DNDEBUG")

_LOCK = threading.Lock()
_LOADED: dict[str, object] = {}  # build directory -> the loaded module, or the reason it is not
_UNSET = object()


@functools.cache  # read at each launcher or allocator made: the source is hashed once
def build_tag() -> str:
    """What the built module is valid for: its source, torch's version, the Python ABI and
    the compiler flags."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(sys.implementation.cache_tag.encode())
    digest.update(" ".join(CFLAGS).encode())
    return digest.hexdigest()[:16]


def module_name() -> str:
    return f"gdn_dispatch_native_{build_tag()}"


def build_dir() -> Path:
    return cache_dir() / "native" / module_name()


def built_path() -> Path | None:
    """The compiled module for this torch, Python and source, or None if it is not built."""
    directory = build_dir()
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = directory / f"{module_name()}{suffix}"
        if path.exists():
            return path
    return None


def load():
    """The native module, or None: turned off (``GDN_DISPATCH_NATIVE=0``), not built, or
    not loadable (:func:`status` says which). Loads at most once per process. With
    ``GDN_DISPATCH_NATIVE=1`` a module that is not there raises RuntimeError instead (a
    server that wants to know it runs on it)."""
    setting = getenv(NATIVE_ENV)
    if setting == "0":
        return None
    module = _load_once()
    if module is None and setting == "1":
        raise RuntimeError(f"{NATIVE_ENV}=1 but the native host layer is {status()}")
    return module


def _load_once():
    where = str(build_dir())
    found = _LOADED.get(where, _UNSET)
    if found is not _UNSET:
        return found if not isinstance(found, str) else None
    with _LOCK:
        found = _LOADED.get(where, _UNSET)
        if found is _UNSET:
            found = _LOADED[where] = _load_built()
    return found if not isinstance(found, str) else None


def _load_built():
    path = built_path()
    if path is None:
        return f"not built ({BUILD_HINT})"
    if module_name() in sys.modules:  # loaded by the builder in this process
        return sys.modules[module_name()]
    try:
        spec = importlib.util.spec_from_file_location(module_name(), path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as exc:  # an incompatible or broken build: the Python launchers serve
        return f"built at {path} but not loadable: {exc}"
    return module


def status() -> str:
    """One line: on (and where from), off, or why not."""
    if getenv(NATIVE_ENV) == "0":
        return f"off ({NATIVE_ENV}=0)"
    if _load_once() is not None:
        return f"on ({built_path()})"
    return str(_LOADED.get(str(build_dir())))


def build(log=print):
    """Compile the native module for this torch and Python into :func:`build_dir` (if it
    is not there yet) and load it; returns the module. Raises RuntimeError with the
    compiler's reason where it cannot be built (no C++ compiler, no ninja)."""
    if built_path() is None:
        from torch.utils import cpp_extension

        directory = build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        log(f"building the native host layer in {directory} (once per torch and Python; 20 s to a few minutes)")
        try:
            cpp_extension.load(name=module_name(), sources=[str(SOURCE)], build_directory=str(directory),
                               extra_cflags=list(CFLAGS), verbose=False)
        except Exception as exc:
            raise RuntimeError(f"the native host layer did not build: {exc}") from exc
    global _ON_CALLS
    with _LOCK:
        _LOADED.pop(str(build_dir()), None)
        _ON_CALLS = _UNSET
    module = load()
    if module is None:
        raise RuntimeError(f"the native host layer built but is not in use: {status()}")
    return module


_ON_CALLS = _UNSET  # the module the call path uses, or None where it is not built; build() resets it


def for_calls():
    """The native module for a call's host path (the contract's admission, the TMA check
    of the inputs), or None where the layer is off or not built. Read at every call:
    ``GDN_DISPATCH_NATIVE=0`` takes effect at the next call; whether the module is there is
    looked up once per process (a call cannot afford the cache directory's path
    arithmetic), and again after :func:`build`. Never raises: without the layer the Python
    path does the same work."""
    global _ON_CALLS
    if getenv(NATIVE_ENV) == "0":
        return None
    if _ON_CALLS is _UNSET:
        _ON_CALLS = _load_once()
    return _ON_CALLS


def admission():
    """The native layer's ``admit`` (the contract's checks of the common call, on
    ``at::Tensor``; :func:`gdn_dispatch.contract.make_problem` asks it first), or None
    (:func:`for_calls`)."""
    module = for_calls()
    return None if module is None else module.admit


#: The allocator group the backends put a call's intermediates in (every buffer but o and
#: the final state: they live exactly as long as the call).
INTERMEDIATES = 0


def allocator(specs: list[tuple]):
    """``alloc(like, a, b=0, c=0, d=0, e=0, f=0) -> tuple of tensors``: one contiguous
    tensor per spec on ``like``'s device, in one call. A spec is ``(dims, dtype)`` or
    ``(dims, dtype, group)``: each dim a size, or -1 ... -6 for the call's ``a`` ... ``f``;
    dtype None for ``like``'s; specs of one group (0 to 7) are carved from one allocation
    where the native module is loaded (views at 256-byte boundaries: for intermediates that
    live exactly as long as the call). The native module's Allocator where it is loaded
    (C++'s ``at::empty``), else one ``torch.empty`` per spec in Python."""
    if any(d < -6 for spec in specs for d in spec[0]):
        raise ValueError("allocator: a dim below -6 (six call sizes at most)")
    if any(len(spec) > 2 and spec[2] is not None and not 0 <= spec[2] <= 7 for spec in specs):
        raise ValueError("allocator: groups 0 to 7")
    module = load()
    if module is not None:
        return module.Allocator(list(specs))
    return _python_allocator(specs)


def _python_allocator(specs):
    # One straight-line function of torch.empty calls (a loop over the specs costs about
    # a fifth more per call); groups are not carved here (views cost Python what the
    # allocations they save cost).
    names = {"empty": torch.empty}
    items = []
    for i, (dims, dtype, *_) in enumerate(specs):
        shape = ", ".join(str(d) if d >= 0 else "abcdef"[-d - 1] for d in dims)
        names[f"D{i}"] = dtype
        items.append(f"empty({shape}, dtype={'like_dtype' if dtype is None else f'D{i}'}, device=device)")
    source = ("def alloc(like, a, b=0, c=0, d=0, e=0, f=0):\n    device, like_dtype = like.device, like.dtype\n"
              f"    return ({', '.join(items)},)\n")
    exec(compile(source, "<gdn_dispatch allocator>", "exec"), names)
    return names["alloc"]
