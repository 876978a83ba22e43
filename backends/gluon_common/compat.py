"""Gluon names that changed after triton 3.6, resolved once against the installed triton.

Kernels import the names below instead of the triton spellings, so one source compiles
under 3.6.0 (the runtime we ship on) and under the newest release (checked in CI).
Each name is chosen by what the installed triton offers, not by its version number.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma as _hopper_tma

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

thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


def _tmem_reg_layout_impl(dtype, shape, tmem_layout, num_warps):
    from triton.experimental.gluon.language.nvidia import blackwell

    if hasattr(blackwell, "get_tmem_reg_layout"):
        return blackwell.get_tmem_reg_layout(dtype, shape, tmem_layout, num_warps)
    desc_type = blackwell.tensor_memory_descriptor_type(dtype, shape, tmem_layout, shape)
    return desc_type.get_reg_layout(num_warps=num_warps)


@gluon.constexpr_function
def tmem_reg_layout(dtype, shape, tmem_layout, num_warps):
    """The register layout that one tcgen05.ld of a ``shape`` TMEM tile lands in."""
    return _tmem_reg_layout_impl(dtype, list(shape), tmem_layout, num_warps)


# Re-bound (append-only): the definition above calls a plain Python helper, which triton's
# dependency walker rejects as soon as a @gluon.jit function references tmem_reg_layout
# ("Unsupported function referenced: <function _tmem_reg_layout_impl>"). A constexpr
# function may only reference modules, classes, builtins and other jit/constexpr functions,
# so the feature test moves out of its body into the choice of body.
from triton.experimental.gluon.language.nvidia import blackwell as _blackwell  # noqa: E402

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
