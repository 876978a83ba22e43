"""The buffers a Gluon call's launches write, allocated in one call per call class and form
(:func:`gdn_dispatch.native.allocator`): shared by the forward's Python path and its call
programs (:mod:`.call_program`)."""

from __future__ import annotations

import torch

from gdn_dispatch import native
from gdn_dispatch.native import INTERMEDIATES
from gdn_dispatch.context_parallel import CPPlan
from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem, StateLayout, state_dims

from gdn_dispatch.backends.gluon_common.plan import ForwardPlan
from gdn_dispatch.backends.triton_generic.segment_map import maps_dtype


def call_buffers(problem: GDNProblem, launches: ForwardPlan, cp: CPPlan,
                 t_rows: int = 0) -> tuple[torch.Tensor, ...]:
    """Every tensor the call's launches write, allocated in one call by the call class's
    allocator (:func:`gdn_dispatch.native.allocator`, made at the class's first call of
    each form: head counts and dims, dtype, layout and the final-state flag are in the class
    key, the offsets' and maps' dtypes in the allocator's).

    Returns
    -------
    On the warp-specialized path (``launches.fused``): o ``[B, T, HV, V]`` (q's dtype),
    g_cum float32 ``[B, T, HV]``, t_tiles ``[t_rows, 64]`` (q's dtype; ``t_rows`` from
    :func:`.wy_t.planned_t_tile_rows`), then the final state as below. Else:
    w ``[B, T, HV, K]``, u ``[B, T, HV, V]`` (q's dtype), g_cum float32 ``[B, T, HV]``,
    o ``[B, T, HV, V]`` (q's dtype); with context parallelism then pass 1's seg_cu
    ``[NSEG + 1]`` (cu_seqlens's dtype), M_hi ``[NSEG, HV, K, K]``
    (:func:`~gdn_dispatch.backends.triton_generic.segment_map.maps_dtype`), M_lo (bf16) and
    N ``[NSEG, HV, K, V]`` (float32), and the scan's seg_h0 ``[NSEG, HV, K, V]`` (float32);
    with chained segments (``cp.chained``) seg_cu, the forgetting starts (int32 ``[NSEG,
    HV]``), the hand-over counts and ticket (int32 ``[NSEG + 1, HV]``) and N; last the
    float32 final state (``[N, HV, K, V]``, or ``[N, HV, V, K]`` for "vk"), None
    unless ``output_final_state``.
    """
    if launches.fused:
        form = ("fused",)
    elif cp.chained:
        form = ("chained", problem.chunks.cu_seqlens.dtype)
    elif cp.enabled:
        form = ("segmented", problem.chunks.cu_seqlens.dtype, maps_dtype(problem.q.dtype))
    else:
        form = ("pipeline",)
    alloc = launches.cls.allocators.get(form)
    if alloc is None:
        alloc = launches.cls.allocators[form] = native.allocator(buffer_specs(problem, form))
    nseg = cp.num_segments
    out = alloc(problem.q, problem.B, problem.T, problem.N, t_rows or nseg, nseg + 1)
    return out if problem.output_final_state else (*out, None)


def buffer_specs(problem: GDNProblem, form: tuple) -> list[tuple[tuple[int, ...], torch.dtype | None]]:
    """The :func:`gdn_dispatch.native.allocator` specs of :func:`call_buffers` for the
    call's ``form``: ("fused",), ("pipeline",), ("segmented", offsets' dtype, maps'
    dtype) or ("chained", offsets' dtype). Sizes: -1 B, -2 T, -3 N, -4 NSEG (or the T
    tiles' rows), -5 NSEG + 1. The intermediates (everything but o and the final state) are
    :data:`INTERMEDIATES`: one allocation where the native layer carves them."""
    HV, K, V = problem.HV, problem.K, problem.V
    f32, mid = torch.float32, INTERMEDIATES
    if form[0] == "fused":
        specs = [((-1, -2, HV, V), None), ((-1, -2, HV), f32, mid), ((-4, CHUNK_SIZE), None, mid)]
    else:
        specs = [((-1, -2, HV, K), None, mid), ((-1, -2, HV, V), None, mid), ((-1, -2, HV), f32, mid),
                 ((-1, -2, HV, V), None)]
    if form[0] == "segmented":
        specs += [((-5,), form[1], mid), ((-4, HV, K, K), form[2], mid), ((-4, HV, K, K), torch.bfloat16, mid),
                  ((-4, HV, K, V), f32, mid), ((-4, HV, K, V), f32, mid)]
    elif form[0] == "chained":
        specs += [((-5,), form[1], mid), ((-4, HV), torch.int32, mid), ((-5, HV), torch.int32, mid),
                  ((-4, HV, K, V), f32, mid)]
    if problem.output_final_state:
        specs.append((state_dims(-3, HV, K, V, problem.state_layout is StateLayout.VK), torch.float32))
    return specs
