"""Every Triton name outside its stable public API that the Gluon backends use, resolved
once against the installed triton.

Kernels and host modules import the names below instead of triton's spellings, so one
source compiles and launches under 3.6.0 (the runtime we ship on) and under the newest
release (CI's second environment, ``.ci/newest_triton``). Each name is chosen by what the
installed triton offers, not by its version number; :data:`CHECKED_ON` lists, per name,
the releases it was checked on.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import blackwell as _blackwell
from triton.experimental.gluon.language.nvidia.hopper import tma as _hopper_tma

#: Triton releases each name (or host interface) below was checked on: compiled for
#: sm_90a and sm_100a (``tests/test_gluon_aot.py``), and the direct launch path run on the
#: H200 (3.6 only, :data:`DIRECT_LAUNCH_TRITON`).
CHECKED_ON = {
    "aggregate (gluon.aggregate | triton.language.core._aggregate)": ("3.6.0", "3.9.0"),
    "tma_load / tma_store (async_load | async_copy_global_to_shared)": ("3.6.0", "3.9.0"),
    "shared/tensor memory .reinterpret | ._reinterpret": ("3.6.0", "3.9.0"),
    "thread_barrier (gl.barrier | gl.thread_barrier)": ("3.6.0", "3.9.0"),
    "tmem_reg_layout (get_tmem_reg_layout | tensor_memory_descriptor_type.get_reg_layout)": ("3.6.0", "3.9.0"),
    "GluonASTSource (triton.experimental.gluon._runtime)": ("3.6.0", "3.9.0"),
    "get_ptxas, sm_arch_from_capability (triton.backends.nvidia.compiler)": ("3.6.0", "3.9.0"),
    "CompiledKernel.run / function / packed_metadata, launcher descriptor args": ("3.6.0",),
    "CudaLauncher.launch (C launch, wrap_handle_tensordesc closure), fill_tma_descriptor": ("3.6.0",),
    "knobs.runtime.launch_enter_hook / launch_exit_hook, driver.active.get_current_stream": ("3.6.0",),
    "JITFunction.arg_names": ("3.6.0", "3.9.0"),
}

# ----------------------------------------------------------------------------------------
# Device side (names kernels call)

try:  # newest: gluon.aggregate; 3.6: only the core spelling (needs an explicit __init__)
    aggregate = gluon.aggregate
except AttributeError:
    from triton.language.core import _aggregate as aggregate

# 3.6 names the TMA copies by direction; later releases call them load/store and turn the
# old names into functions that raise.
if hasattr(_hopper_tma, "async_load"):
    tma_load = _hopper_tma.async_load
    tma_store = _hopper_tma.async_store
else:
    tma_load = _hopper_tma.async_copy_global_to_shared
    tma_store = _hopper_tma.async_copy_shared_to_global

#: True where shared/tensor memory descriptors spell it .reinterpret (newest), else ._reinterpret.
HAS_PUBLIC_REINTERPRET = gl.constexpr(not hasattr(gl.shared_memory_descriptor, "_reinterpret"))


@gluon.jit
def reinterpret(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """A ``shape`` ``dtype`` view (``layout``) of the first bytes of the shared buffer ``smem``."""
    if HAS_PUBLIC_REINTERPRET:
        view = smem.reinterpret(dtype, shape, layout)
    else:
        view = smem._reinterpret(dtype, shape, layout)
    return view

thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

# A constexpr function may only reference modules, classes, builtins and other jit /
# constexpr functions (triton's dependency walker rejects a plain Python helper), so the
# feature test picks one of two bodies instead of branching inside one.
if hasattr(_blackwell, "get_tmem_reg_layout"):

    @gluon.constexpr_function
    def tmem_reg_layout(dtype, shape, tmem_layout, num_warps):
        """The register layout that one tcgen05.ld of a ``shape`` TMEM tile lands in."""
        return _blackwell.get_tmem_reg_layout(dtype, list(shape), tmem_layout, num_warps)

else:

    @gluon.constexpr_function
    def tmem_reg_layout(dtype, shape, tmem_layout, num_warps):
        """The register layout that one tcgen05.ld of a ``shape`` TMEM tile lands in."""
        desc_type = _blackwell.tensor_memory_descriptor_type(dtype, list(shape), tmem_layout, list(shape))
        return desc_type.get_reg_layout(num_warps=num_warps)


# ----------------------------------------------------------------------------------------
# Host side (compiling ahead of time, launching)


def gluon_ast_source(fn, signature: dict, constexprs: dict, attrs: dict | None):
    """The source object ``triton.compile`` takes for a ``@gluon.jit`` kernel."""
    from triton.experimental.gluon._runtime import GluonASTSource

    return GluonASTSource(fn, signature, constexprs, attrs)


def ptxas_command(arch: int) -> tuple[str, str]:
    """(path of triton's bundled ptxas for ``arch`` (e.g. 100), its ``--gpu-name`` value)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    return get_ptxas(arch).path, sm_arch_from_capability(arch)


def arg_names(fn) -> list[str]:
    """The parameter names of a jit function, in order (constexprs included)."""
    return list(fn.arg_names)


#: Triton releases (major, minor) whose launcher internals the direct launch path was
#: checked against (``tests/test_gluon_launch.py`` on the H200): the CompiledKernel's
#: ``run`` / ``function`` / ``packed_metadata`` and the launcher's reading of descriptor
#: arguments. Triton 3.9 decomposes descriptor arguments differently, so other releases
#: launch every kernel through ``fn[grid]``.
DIRECT_LAUNCH_TRITON = ((3, 6),)
#: What a compiled kernel must offer for the direct launch path.
COMPILED_KERNEL_API = ("run", "function", "packed_metadata")


def direct_launch_verified(version: str) -> bool:
    """Whether triton ``version`` ("3.6.0") is one :data:`DIRECT_LAUNCH_TRITON` lists."""
    parts = version.split(".")
    try:
        return (int(parts[0]), int(parts[1])) in DIRECT_LAUNCH_TRITON
    except (IndexError, ValueError):
        return False


def launch_hooks_set(runtime_knobs) -> bool:
    """Whether a launch hook is registered on ``triton.knobs.runtime`` (3.6 keeps them in
    HookChains, empty by default; older releases hold a callable or None)."""
    # Two plain tests, no generator: this runs before every launch.
    enter = runtime_knobs.launch_enter_hook
    if enter is not None and getattr(enter, "calls", True):
        return True
    leave = runtime_knobs.launch_exit_hook
    return leave is not None and bool(getattr(leave, "calls", True))


def current_stream_query():
    """Triton's current-stream query, ``query(device_index) -> stream handle`` (reaches the
    driver: call only when launching)."""
    from triton.runtime.driver import driver

    return driver.active.get_current_stream


class RawLaunch:
    """A compiled kernel's C launch function and what Triton's Python launcher adds around it
    (Triton 3.6: ``CudaLauncher.__call__`` inserts the launch flags and scratch buffers,
    ``wrap_handle_tensordesc`` encodes each descriptor argument per launch).

    Call ``c_launch(g0, g1, g2, stream, *prefix, *args)`` with ``args`` in the kernel's
    order, each descriptor expanded to ``(CUtensorMap, *shape, *strides)`` (``encode``
    makes the map) and pointers as ints or tensors: what the wrapper hands the C function.

    Attributes
    ----------
    c_launch : the compiled launcher module's ``launch``.
    prefix : ``(function, cooperative, pdl, global scratch, profile scratch, packed
        metadata, launch metadata, enter hook, exit hook)``.
    descriptor_meta : per descriptor argument in the kernel's order, Triton's encoding
        metadata (swizzle, element size and type, block size).
    """

    __slots__ = ("c_launch", "prefix", "descriptor_meta")

    def __init__(self, c_launch, prefix: tuple, descriptor_meta: list):
        self.c_launch, self.prefix, self.descriptor_meta = c_launch, prefix, descriptor_meta


#: The closure of Triton 3.6's ``wrap_handle_tensordesc`` wrapper, by variable name.
_TENSORDESC_WRAPPER_CELLS = frozenset({"launcher", "tensordesc_indices", "tensordesc_meta"})


def raw_launch(compiled) -> RawLaunch | None:
    """The C launch of ``compiled`` (a CompiledKernel), or None where its launcher is not
    the shape this was verified on (then launch through ``compiled.run``): a launcher with
    scratch buffers (allocated per launch by Triton), descriptors without encoding metadata
    or not 2-D, or a wrapper other than 3.6's."""
    try:
        launcher = compiled.run
        fn = launcher.launch
        prefix = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None, None,
                  compiled.packed_metadata, None, None, None)
        if launcher.global_scratch_size or launcher.profile_scratch_size:
            return None
    except AttributeError:
        return None
    cells = getattr(fn, "__closure__", None)
    if not cells:
        return RawLaunch(fn, prefix, [])
    free = dict(zip(fn.__code__.co_freevars, (cell.cell_contents for cell in cells)))
    if set(free) != _TENSORDESC_WRAPPER_CELLS:
        return None
    meta = list(free["tensordesc_meta"] or ())
    if len(meta) != len(free["tensordesc_indices"]) or any(
            m is None or m.get("fp4_padded") or len(m["block_size"]) != 2 for m in meta):
        return None
    return RawLaunch(free["launcher"], prefix, meta)


def tma_encoder(meta: dict):
    """``encode(ptr, shape, strides) -> CUtensorMap`` for one descriptor argument of a
    compiled kernel (its ``tensordesc_meta`` entry), as Triton 3.6's launcher encodes it
    (zero padding). Reaches the driver's utilities: call only when launching."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    from triton.runtime.driver import driver

    fill = driver.active.utils.fill_tma_descriptor
    swizzle, elem_size, block = meta["swizzle"], meta["elem_size"], meta["block_size"]
    elem_type = TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]]

    def encode(ptr: int, shape: list, strides: list):
        return fill(ptr, swizzle, elem_size, elem_type, block, shape, strides, 0)

    return encode
