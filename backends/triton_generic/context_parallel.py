"""Context parallelism for this backend: the call's long sequences cut into segments.

    seg_cu, M_hi, M_lo, N = segment_map_fwd(k, w, u, g_cum, cu_seqlens, L, beta)  # pass 1: offsets, maps
                                                          # (a launch first finds what each
                                                          # segment forgets)
    seg_h0, S    = segment_scan_fwd(M_hi, M_lo, N, cu_seqlens, L, S0)   # serial over segments
    h, v_new     = state_fwd(k, w, u, g_cum, segments, seg_h0) # pass 2: the normal stages 4 + 5,
    o            = output_fwd(q, k, v_new, h, g_cum, segments) #   segments as the sequences

Chained segments (``plan.chained``, :func:`chained_fwd`) form no M and run no scan: pass 1
maps only what the segments forget, and pass 2 (:mod:`.segment_chain`) hands each
segment's end state to the next.

Segments are cut at multiples of ``L`` (a multiple of the chunk) inside each sequence, so
the per-chunk stages 1-3 (gate cumsum, w, u) are the call's own and run before. The plan
(:func:`gdn_dispatch.context_parallel.plan_for_problem`) is made on the host from shapes
and the SM count; nothing here reads a device value back.
"""

from __future__ import annotations

import torch

from gdn_dispatch.context_parallel import CPPlan
from gdn_dispatch.contract import GDNProblem, StateLayout
from gdn_dispatch.varlen import ChunkTable, new_table, num_slots

from gdn_dispatch.backends.triton_generic.output import output_fwd
from gdn_dispatch.backends.triton_generic.segment_chain import chain_buffers, chained_state_fwd
from gdn_dispatch.backends.triton_generic.segment_map import segment_map_fwd
from gdn_dispatch.backends.triton_generic.segment_scan import segment_scan_fwd
from gdn_dispatch.backends.triton_generic.state import state_fwd


def segment_table(chunks: ChunkTable, total_tokens: int, plan: CPPlan, seg_cu: torch.Tensor,
                  seg_cu_host: torch.Tensor | None = None, *, longest: int | None = None,
                  aligned: bool | None = None, nonempty: int | None = None) -> ChunkTable:
    """The segments of ``plan`` as a chunk table whose "sequences" are the segment slots
    (empty segments are zero-length sequences).

    ``seg_cu``: the segment offsets (pass 1 writes them: :func:`.segment_map.segment_map_fwd`;
    a ``meta`` tensor in a dry run). ``seg_cu_host``: their host copy, when the caller
    computed one (kernels that specialize on tails read it); ``longest``, ``aligned``,
    ``nonempty``: what the caller read of that copy (:class:`~gdn_dispatch.varlen.ChunkTable`),
    or None for the table to read it when asked.
    """
    return new_table(num_seqs=plan.num_segments, chunk_size=chunks.chunk_size, cu_seqlens=seg_cu,
                     num_slots=num_slots(total_tokens, plan.num_segments, chunks.chunk_size),
                     cu_seqlens_host=seg_cu_host, uniform=False, longest=longest, aligned=aligned, nonempty=nonempty)


def segment_start_states(problem: GDNProblem, plan: CPPlan, g_cum: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
                         k_rnorm: torch.Tensor | None = None, out: tuple | None = None, maps: tuple | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Pass 1 and the scan: the segment offsets, every segment's start state, and the
    call's final state.

    Parameters
    ----------
    problem : the validated call; plan : its context-parallel plan (``plan.enabled``).
    g_cum, w, u : stages 1-3 of the call (see :func:`segmented_fwd`).
    k_rnorm : float32 ``[B, T, HV]`` with the qk l2 norm, or None (pass 1 then reduces k's
        rows itself).
    out : (seg_cu, M_hi, M_lo, N, seg_h0, final_state) allocated by the caller (pass 1's
        and the scan's ``out``), or None to allocate them in those functions.
    maps : pass 1's (seg_cu, M_hi, M_lo, N) where the caller ran its own pass 1 (the Gluon
        backends' :mod:`gdn_dispatch.backends.gluon_common.segment_map`), or None to run
        this backend's here.

    Returns
    -------
    seg_cu : int Tensor ``[NSEG + 1]``, cu_seqlens's dtype: the segment offsets.
    seg_h0 : float32 Tensor ``[NSEG, HV, K, V]``, "kv": the start state of every segment.
    final_state : as :func:`segmented_fwd` returns it; with ``inplace_final_state`` the
        pool rows are written too.
    """
    if maps is None:
        # The scan's start states lend pass 1 their room for the forgetting starts: the scan
        # writes them only after pass 1 has read those.
        maps = segment_map_fwd(problem.k, w, u, g_cum, problem.chunks.cu_seqlens, plan.seg_len,
                               use_qk_l2norm=problem.use_qk_l2norm, k_rnorm=k_rnorm, beta=problem.beta,
                               f_start=None if out is None else out[4].view(-1),
                               out=None if out is None else out[:4])
    seg_cu, m_hi, m_lo, n_in = maps
    seg_h0, final_state = segment_scan_fwd(
        m_hi, m_lo, n_in, problem.chunks.cu_seqlens, plan.seg_len,
        initial_state=problem.initial_state,
        output_final_state=problem.output_final_state,
        state_vk=problem.state_layout is StateLayout.VK,
        state_indices=problem.state_indices,
        inplace_final_state=problem.inplace_final_state,
        out=None if out is None else out[4:],
    )
    return seg_cu, seg_h0, final_state


def segmented_fwd(problem: GDNProblem, plan: CPPlan, g_cum: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
                  k_rnorm: torch.Tensor | None, sm_count: int | None = None,
                  out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stages 4 and 5 of ``problem`` over the segments of ``plan`` (``plan.enabled``).

    Parameters
    ----------
    problem : the validated call.
    plan : its context-parallel plan (segment length ``L``, ``NSEG`` slots).
    g_cum : float32 Tensor ``[B, T, HV]``; w ``[B, T, HV, K]``, u ``[B, T, HV, V]`` in k's
        dtype; k_rnorm float32 ``[B, T, HV]`` or None: stages 1-3 of the call.
    sm_count : int or None, the SMs the state kernel's config fills (see :func:`state_fwd`).
    out : (seg_cu, M_hi, M_lo, N, seg_h0, h, v_new, o, final state or None) as
        :func:`.buffers.call_buffers` allocates them, or None to allocate them in the
        launching functions.

    Returns
    -------
    o : Tensor ``[B, T, HV, V]`` in q's dtype.
    final_state : float32 Tensor ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk"), or
        None unless ``problem.output_final_state``; with ``inplace_final_state`` the pool
        rows are written too.
    """
    l2 = problem.use_qk_l2norm
    starts = None if out is None else (*out[:5], out[8])
    seg_cu, seg_h0, final_state = segment_start_states(problem, plan, g_cum, w, u, k_rnorm, out=starts)
    segments = segment_table(problem.chunks, problem.B * problem.T, plan, seg_cu)
    h, v_new, _ = state_fwd(problem.k, w, u, g_cum, segments, initial_state=seg_h0, use_qk_l2norm=l2,
                            k_rnorm=k_rnorm, sm_count=sm_count, out=None if out is None else (*out[5:7], None))
    o = output_fwd(problem.q, problem.k, v_new, h, g_cum, segments, scale=problem.scale, use_qk_l2norm=l2,
                   k_rnorm=k_rnorm, out=None if out is None else out[7])
    return o, final_state


def chained_fwd(problem: GDNProblem, plan: CPPlan, g_cum: torch.Tensor, w: torch.Tensor, u: torch.Tensor,
                k_rnorm: torch.Tensor | None, sm_count: int | None = None,
                out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stages 4 and 5 of ``problem`` over the chained segments of ``plan``
    (``plan.chained``): the forgetting starts, pass 1's N where a segment forgets, then
    pass 2 chained (:mod:`.segment_chain`) and the output over the segments.

    Parameters
    ----------
    problem, plan, g_cum, w, u, k_rnorm, sm_count : as :func:`segmented_fwd` takes them.
    out : (seg_cu, f_start, chain_flags, N, h, v_new, o, final state or None) as
        :func:`.buffers.call_buffers` allocates them for a chained plan, or None to
        allocate them in the launching functions.

    Returns
    -------
    o, final_state : as :func:`segmented_fwd` returns them.
    """
    l2, chunks, NSEG, HV = problem.use_qk_l2norm, problem.chunks, plan.num_segments, problem.HV
    if out is None:
        seg_cu, hand, stages = None, None, None
        f_start, flags = chain_buffers(NSEG, HV, problem.k.device)
    else:
        seg_cu, f_start, flags, hand, *stages = out
        f_start, flags = f_start.view(-1), flags.view(-1)
    seg_cu, _, _, hand = segment_map_fwd(
        problem.k, w, u, g_cum, chunks.cu_seqlens, plan.seg_len, use_qk_l2norm=l2, k_rnorm=k_rnorm,
        beta=problem.beta, f_start=f_start, chain_flags=flags, out=None if out is None else (seg_cu, None, None, hand))
    segments = segment_table(chunks, problem.B * problem.T, plan, seg_cu)
    h, v_new, final_state = chained_state_fwd(
        problem.k, w, u, g_cum, chunks.cu_seqlens, segments, plan.seg_len, f_start, hand, flags,
        initial_state=problem.initial_state, output_final_state=problem.output_final_state,
        state_vk=problem.state_layout is StateLayout.VK, use_qk_l2norm=l2, k_rnorm=k_rnorm,
        state_indices=problem.state_indices, inplace_final_state=problem.inplace_final_state, sm_count=sm_count,
        out=None if stages is None else (stages[0], stages[1], stages[3]))
    o = output_fwd(problem.q, problem.k, v_new, h, g_cum, segments, scale=problem.scale, use_qk_l2norm=l2,
                   k_rnorm=k_rnorm, out=None if stages is None else stages[2])
    return o, final_state
