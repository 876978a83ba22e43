"""The buffers triton_generic's stages write, allocated in one call per call form
(:func:`gdn_dispatch.native.allocator`): shared by the forward's Python path and its call
programs (:mod:`.call_program`)."""

from __future__ import annotations

import torch

from gdn_dispatch import native
from gdn_dispatch.native import INTERMEDIATES
from gdn_dispatch.context_parallel import CPPlan
from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem, StateLayout, state_dims
from gdn_dispatch.varlen import num_slots

from gdn_dispatch.backends.triton_generic.segment_map import maps_dtype


#: One allocator per (HV, K, V, dtype, l2 norm, state layout, final state, form).
_ALLOCATORS: dict[tuple, object] = {}


def call_buffers(problem: GDNProblem, cp: CPPlan) -> tuple[torch.Tensor, ...]:
    """What the stages write, allocated in one call (:func:`gdn_dispatch.native.allocator`).

    Returns
    -------
    g_cum float32 ``[B, T, HV]``; k_rnorm float32 ``[B, T, HV]`` (None without the qk l2
    norm); w ``[B, T, HV, K]`` and u ``[B, T, HV, V]`` in k's dtype; then, unsegmented
    (``cp`` off: stages 4 and 5 over the sequences), h ``[NS, HV, K, V]`` (k's dtype, NS
    chunk slots), v_new ``[B, T, HV, V]`` (k's dtype), o ``[B, T, HV, V]`` (q's dtype) and
    the float32 final state (``[N, HV, K, V]``, "vk": ``[N, HV, V, K]``; None unless
    ``output_final_state``). Segmented (``cp`` on, ``NSEG`` segment slots), after w and u:
    pass 1's seg_cu ``[NSEG + 1]`` (cu_seqlens's dtype), M_hi ``[NSEG, HV, K, K]``
    (:func:`.segment_map.maps_dtype`), M_lo (bf16) and N ``[NSEG, HV, K, V]`` (float32),
    the scan's seg_h0 ``[NSEG, HV, K, V]`` (float32), then pass 2's h (over the segments'
    chunk slots), v_new and o, and the final state (the scan writes it). Chained (``cp.chained``),
    after w and u: seg_cu, the forgetting starts (int32 ``[NSEG, HV]``), the hand-over
    counts and ticket (int32 ``[NSEG + 1, HV]``, the ticket first in the last row) and N
    ``[NSEG, HV, K, V]`` (float32), then h, v_new, o and the final state as segmented.
    """
    HV, K, V, l2 = problem.HV, problem.K, problem.V, problem.use_qk_l2norm
    form = buffer_form(problem, cp)
    key = (HV, K, V, problem.q.dtype, l2, problem.state_layout, problem.output_final_state, form)
    alloc = _ALLOCATORS.get(key)
    if alloc is None:
        alloc = _ALLOCATORS[key] = native.allocator(buffer_specs(problem, form))
    rows, nseg = problem.B * problem.T, cp.num_segments
    if cp.enabled:
        out = alloc(problem.q, problem.B, problem.T, problem.N, num_slots(rows, nseg, CHUNK_SIZE), nseg + 1, nseg)
    else:
        out = alloc(problem.q, problem.B, problem.T, problem.N, problem.chunks.num_slots)
    if not l2:
        out = (out[0], None, *out[1:])
    return out if problem.output_final_state else (*out, None)


def buffer_form(problem: GDNProblem, cp: CPPlan) -> tuple:
    """The call's form of buffers: ("unsegmented",), ("segmented", offsets' dtype, maps'
    dtype) or ("chained", offsets' dtype)."""
    if not cp.enabled:
        return ("unsegmented",)
    if cp.chained:
        return ("chained", problem.chunks.cu_seqlens.dtype)
    return ("segmented", problem.chunks.cu_seqlens.dtype, maps_dtype(problem.q.dtype))


def buffer_specs(problem: GDNProblem, form: tuple) -> list[tuple[tuple[int, ...], torch.dtype | None]]:
    """The :func:`gdn_dispatch.native.allocator` specs of :func:`call_buffers` for the
    call's ``form`` (:func:`buffer_form`), in its order (k_rnorm only with the qk l2 norm,
    the final state only when asked). Sizes: -1 B, -2 T, -3 N, -4 chunk slots (a segmented
    call's: of its segments), -5 NSEG + 1, -6 NSEG. Everything but o and the final state is
    an intermediate (:data:`INTERMEDIATES`: one allocation where the native layer carves
    them)."""
    HV, K, V, l2 = problem.HV, problem.K, problem.V, problem.use_qk_l2norm
    f32, mid = torch.float32, INTERMEDIATES
    specs = [((-1, -2, HV), f32, mid)] + ([((-1, -2, HV), f32, mid)] if l2 else [])
    specs += [((-1, -2, HV, K), None, mid), ((-1, -2, HV, V), None, mid)]
    if form[0] == "segmented":
        specs += [((-5,), form[1], mid), ((-6, HV, K, K), form[2], mid), ((-6, HV, K, K), torch.bfloat16, mid),
                  ((-6, HV, K, V), f32, mid), ((-6, HV, K, V), f32, mid)]
    elif form[0] == "chained":
        specs += [((-5,), form[1], mid), ((-6, HV), torch.int32, mid), ((-5, HV), torch.int32, mid),
                  ((-6, HV, K, V), f32, mid)]
    specs += [((-4, HV, K, V), None, mid), ((-1, -2, HV, V), None, mid), ((-1, -2, HV, V), None)]
    if problem.output_final_state:
        specs.append((state_dims(-3, HV, K, V, problem.state_layout is StateLayout.VK), f32))
    return specs
