"""The buffers triton_generic's stages write, allocated in one call per call form
(:func:`gdn_dispatch.native.allocator`): shared by the forward's Python path and its call
programs (:mod:`.call_program`)."""

from __future__ import annotations

import torch

from gdn_dispatch import native
from gdn_dispatch.native import INTERMEDIATES
from gdn_dispatch.contract import GDNProblem, StateLayout, state_dims


#: One allocator per (HV, K, V, dtype, l2 norm, state layout, final state, unsegmented).
_ALLOCATORS: dict[tuple, object] = {}


def call_buffers(problem: GDNProblem, unsegmented: bool) -> tuple[torch.Tensor, ...]:
    """What the stages write, allocated in one call (:func:`gdn_dispatch.native.allocator`):
    g_cum float32 ``[B, T, HV]``; k_rnorm float32 ``[B, T, HV]`` (None without the qk l2
    norm); w ``[B, T, HV, K]`` and u ``[B, T, HV, V]`` in k's dtype; and ``unsegmented``
    (stages 4 and 5 over the sequences) h ``[NS, HV, K, V]`` (k's dtype, NS chunk slots),
    v_new ``[B, T, HV, V]`` (k's dtype), o ``[B, T, HV, V]`` (q's dtype) and the float32
    final state (``[N, HV, K, V]``, "vk": ``[N, HV, V, K]``; None unless
    ``output_final_state``)."""
    HV, K, V, l2 = problem.HV, problem.K, problem.V, problem.use_qk_l2norm
    final = problem.output_final_state and unsegmented
    vk = problem.state_layout is StateLayout.VK
    key = (HV, K, V, problem.q.dtype, l2, vk, final, unsegmented)
    alloc = _ALLOCATORS.get(key)
    if alloc is None:
        alloc = _ALLOCATORS[key] = native.allocator(buffer_specs(problem, unsegmented))
    out = alloc(problem.q, problem.B, problem.T, problem.N, problem.chunks.num_slots)
    if not l2:
        out = (out[0], None, *out[1:])
    return out if final or not unsegmented else (*out, None)


def buffer_specs(problem: GDNProblem, unsegmented: bool) -> list[tuple[tuple[int, ...], torch.dtype | None]]:
    """The :func:`gdn_dispatch.native.allocator` specs of :func:`call_buffers`, in its
    order (k_rnorm only with the qk l2 norm, the final state only when asked and
    unsegmented). Sizes: -1 B, -2 T, -3 N, -4 chunk slots. Everything but o and the final
    state is an intermediate (:data:`INTERMEDIATES`: one allocation where the native layer
    carves them)."""
    HV, K, V, l2 = problem.HV, problem.K, problem.V, problem.use_qk_l2norm
    f32, mid = torch.float32, INTERMEDIATES
    specs = [((-1, -2, HV), f32, mid)] + ([((-1, -2, HV), f32, mid)] if l2 else [])
    specs += [((-1, -2, HV, K), None, mid), ((-1, -2, HV, V), None, mid)]
    if unsegmented:
        specs += [((-4, HV, K, V), None, mid), ((-1, -2, HV, V), None, mid), ((-1, -2, HV, V), None)]
        if problem.output_final_state:
            specs.append((state_dims(-3, HV, K, V, problem.state_layout is StateLayout.VK), f32))
    return specs
