"""The orchestrator both Gluon backends share: two launches per call (three with the qk l2 norm).

    w, u, g_cum = wy_fwd(k, v, g, beta)                   # gate cumsum, k k^T, T = (I + A)^-1, w/u
    rnorm       = qk_rnorm_fwd(q, k)                      # qk l2 norm only: 1/||q||, 1/||k|| per row
    o, S        = state_output_fwd(q, k, w, u, g_cum, S0) # recurrence + output

With context parallelism planned for the call (:func:`gdn_dispatch.context_parallel.plan_for_problem`
on the registry's SM count: few sequences x heads, long sequences), the fused kernel runs
over segments of the sequences instead, each from its exact start state::

    seg_cu, M_hi, M_lo, N = segment_map_fwd(k, w, u, g_cum, cu_seqlens, L)  # pass 1: offsets, maps
    seg_h0, S = segment_scan_fwd(M_hi, M_lo, N, cu_seqlens, L, S0)  # fp32 scan; final state / pool rows
    o, _      = state_output_fwd(q, k, w, u, g_cum, segments, seg_h0)   # pass 2

Pass 1 is this package's :mod:`.segment_map` (the maps triton_generic's pass 1 writes, on
the matrix engine); the scan is triton_generic's plain-Triton kernel, read at its public
host function. w, u and g_cum are per chunk and segments start on chunk boundaries of their
sequence, so one wy launch serves both passes. Chained segments (``cp.chained``,
:func:`chained_fwd`) form no M and run no scan::

    seg_cu, N = segment_map_fwd(..., chain=(f_start, flags))  # pass 1: N where a segment forgets
    o, S      = state_output_fwd(..., chain=(N, f_start, flags, L, NSEG))  # each slot from the one before

or, where the class has the one-kernel build (:func:`warm_chained_fwd`, :mod:`.warm_chain`),
in one launch with no pass 1::

    o, S = engine.fused.fused_fwd(..., chain=(hand, flags, L, NSEG))  # each slot warmed up or handed over

A picked plan (``cp.picked``, :func:`picked_fwd`, :mod:`.pick`) runs both, each launch
leaving at once unless the census's count names its plan::

    pick = warm_census_fwd(g, beta, k, cu_seqlens, ...)   # segments that cannot warm up
    o, S = engine.fused.fused_fwd(..., chain=...)         # PICK: runs where the count is 0
    w, u, g_cum = wy_fwd(..., pick=pick)                  # PICK: the unsegmented pipeline,
    o, S = state_output_fwd(..., pick=pick)               #   where the count is not 0

Where the engine offers a warp-specialized path (gluon_sm90: ``engine.fused``, see
:mod:`gdn_dispatch.backends.gluon_sm90.fused`) and the plan takes it (head dims 128, no
context parallelism, enough (sequence, v-head) programs to fill the SMs), the call is
instead::

    q, k           = qk_l2norm_fwd(q, k)                  # qk l2 norm only: normalized copies
    o, S           = engine.fused.fused_fwd(problem, t_tiles, g_cum, q, k)   # everything

its fused kernel forming the chunk inverses itself (``t_tiles`` and ``g_cum`` unread), or,
where it does not (gluon_sm90's ``fused.AUX_T`` off), with the T kernel first::

    t_tiles, g_cum = wy_t_fwd(k, g, beta)                 # the chunk inverses only

The launching backend hands down the device the registry chose and its matrix engine
(tcgen05 + TMEM for gluon_sm100, wgmma for gluon_sm90); everything else is one code path.
Neither T, the per-chunk state h nor v_new reaches global memory. qk l2 norm on the
pipeline: wy reduces k's rows itself; the fused kernel reads q's and k's reciprocal row
norms (8 bytes per token and head) and folds them into row and column scales in registers
(no normalized copy of q or k is written). The warp-specialized path reads normalized
copies instead: there the norms would add to the aux partition, which paces that kernel.
fp16 calls read the copies on every path (:func:`.qk_norm.needs_norm_copies`: products of
raw rows leave fp16's range), a call without the norm from the first stage on.
Nothing here reads a device value back to the host. Every launch goes through
:func:`.launch.launch_planned` (Triton's binder only on a plan's first launch), or, for a
call of the common forms once its kernels are kept (segmented or not), the call's program
runs its allocations and launches in one native call with the same arguments
(:mod:`.call_program`).

Inputs are read where they lie: q, k, v in token rows through TMA descriptors with their
own row stride (views of a fused projection), g and beta through pointers with a token
stride. Only a q, k or v the TMA unit cannot address (a base or token stride off the
16-byte grid: :func:`~.launch_plan.tma_rows_reason`) is copied, once, as the contract
copies other layouts (counted in ``contract.INPUT_COPIES``). A state pool is read, and
written back, in place through ``state_indices``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gdn_dispatch import native
from gdn_dispatch.context_parallel import CPPlan, plan_for_problem
from gdn_dispatch.contract import GDNProblem, StateLayout, _counted_copy, replace_fields
from gdn_dispatch.device import DeviceInfo

from gdn_dispatch.backends.gluon_common.buffers import call_buffers
from gdn_dispatch.backends.gluon_common.call_program import run_call, run_segmented_call
from gdn_dispatch.backends.gluon_common.launch_plan import index_limits_reason, tma_rows_reason
from gdn_dispatch.backends.gluon_common.plan import ForwardPlan, plan
from gdn_dispatch.backends.gluon_common.qk_norm import needs_norm_copies, qk_l2norm_fwd, qk_rnorm_fwd
from gdn_dispatch.backends.gluon_common.segment_map import segment_map_fwd
from gdn_dispatch.backends.gluon_common.segments import SegmentOffsets, segment_facts, segment_host_offsets
from gdn_dispatch.backends.gluon_common.state_output import state_output_fwd
from gdn_dispatch.backends.gluon_common.warm_chain import warm_census_fwd
from gdn_dispatch.backends.gluon_common.wy import wy_fwd
from gdn_dispatch.backends.gluon_common.wy_t import planned_t_tile_rows, wy_t_fwd
from gdn_dispatch.backends.triton_generic.context_parallel import segment_start_states, segment_table
from gdn_dispatch.backends.triton_generic.segment_chain import chain_buffers


def forward(problem: GDNProblem, device: DeviceInfo, *, engine) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``chunk_gated_delta_rule`` for ``problem`` on the Gluon kernels.

    Parameters
    ----------
    problem : a validated call the registry admitted for the backend (dtypes, head dims and
        capability as registry.toml declares them; :func:`unsupported_reason` is None).
    device : DeviceInfo of the tensors' device, as the registry saw it.
    engine : the launching backend's matrix engine (its ``ENGINE``: tcgen05 + TMEM, or
        wgmma), handed to every kernel as its ``ENGINE`` constexpr.

    Returns
    -------
    o : Tensor ``[B, T, HV, V]`` in q's dtype.
    final_state : float32 Tensor ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk"), or
        None unless ``problem.output_final_state``. With a state pool and
        ``inplace_final_state``, the pool rows are written too.
    """
    if problem.device.index != torch.cuda.current_device():
        # Triton launches on the current device: make it the tensors' one for this call.
        with torch.cuda.device(problem.device):
            return forward(problem, device, engine=engine)
    # Plans read shapes, dtypes and flags, never strides: planned before any copy, so that
    # the path's own needs decide what is copied.
    cp, launches, pipeline = call_launches(problem, plan_for_problem(problem, device.sm_count), device, engine)
    if pipeline is not None:
        return picked_fwd(problem, cp, launches, pipeline, engine)
    # The common forms in one native call, where the layer is built (None: not taken).
    pass_two = None
    if cp.chained:
        done = None  # no call program for chained segments: the launches below run them
    elif cp.enabled:
        pass_two = segment_launches(problem, cp, device, engine, launches,
                                    segment_host_offsets(problem.chunks, cp.seg_len))
        done = run_segmented_call(problem, cp, launches, pass_two)
    else:
        done = run_call(problem, launches, engine)
    if done is not None:
        return done
    # On the path the qk l2 norm kernel reads q and k by pointer, at any token stride, and
    # the TMA reads its normalized copies: only v must be TMA-readable.
    norm_copies = launches.norm_copies
    problem = tma_readable(problem, ("v",) if norm_copies else ("q", "k", "v"))
    if norm_copies:
        q, k = qk_l2norm_fwd(problem.q, problem.k, launches.stage("qk_l2norm_fwd"))
        problem = replace_fields(problem, q=q, k=k, use_qk_l2norm=False)
    chunks = problem.chunks
    if launches.fused:
        q, k = problem.q, problem.k
        if cp.chained:
            return warm_chained_fwd(problem, cp, launches, engine, q, k)
        if launches.inverses_on_chip:
            o, g_cum, t_tiles, final_state = call_buffers(problem, launches, cp, 0)
        else:
            wy_t = launches.stage("wy_t_fwd")
            o, g_cum, t_tiles, final_state = call_buffers(
                problem, launches, cp, planned_t_tile_rows(wy_t.shared, problem.B * problem.T, problem.N))
            t_tiles, g_cum = wy_t_fwd(k, problem.g, problem.beta, chunks, wy_t, out=(t_tiles, g_cum))
        return engine.fused.fused_fwd(problem, t_tiles, g_cum, launches.stage("fused_fwd"), q=q, k=k,
                                      out=(o, final_state))
    buffers = call_buffers(problem, launches, cp)
    w, u, g_cum = wy_fwd(problem.k, problem.v, problem.g, problem.beta, chunks, launches.stage("wy_fwd"),
                         out=buffers[:3])
    rnorm = qk_rnorm_fwd(problem.q, problem.k, launches.stage("qk_rnorm_fwd")) if problem.use_qk_l2norm else None
    if cp.chained:
        return chained_fwd(problem, cp, launches, w, u, g_cum, rnorm, out=buffers[3:])
    if cp.enabled:
        return segmented_fwd(problem, cp, device, engine, w, u, g_cum, rnorm, out=buffers[3:], pass_two=pass_two,
                             launches=launches)
    o, final_state = state_output_fwd(
        problem.q, problem.k, w, u, g_cum, chunks, launches.stage("state_output_fwd"), scale=problem.scale,
        initial_state=problem.initial_state, output_final_state=problem.output_final_state, rnorm=rnorm,
        state_indices=problem.state_indices, out=buffers[3:],
    )
    return o, final_state


def call_launches(problem: GDNProblem, cp: CPPlan, device: DeviceInfo, engine
                  ) -> tuple[CPPlan, ForwardPlan, ForwardPlan | None]:
    """The launches of ``problem`` under its context-parallel plan ``cp``: ``(cp, launches,
    None)`` with the call's own launches (the pipeline's front and fused kernel where ``cp``
    segments it), or, for chained segments on a class with the one-kernel build, that build
    over the segment slots (:meth:`~.plan.ClassPlan.warm_chain`). A picked plan
    (``cp.picked``) gives ``(cp, warm, pipeline)``, both ``PICK``
    (:meth:`~.plan.ClassPlan.picked`), where the class can pick, else runs "off"
    (:meth:`~gdn_dispatch.context_parallel.CPPlan.unpicked`)."""
    if cp.picked:
        off = plan(problem, device=device, engine=engine)
        both = off.cls.picked(off.rows, off.num_seqs, cp.num_segments)
        if both is not None:
            return cp, both[0], both[1]
        return cp.unpicked("the one-kernel build's warm chain and an unsegmented pipeline"), off, None
    launches = plan(problem, device=device, engine=engine, fused=not cp.enabled)
    if cp.chained:
        warm = launches.cls.warm_chain(launches.rows, cp.num_segments)
        if warm is not None:
            return cp, warm, None
    return cp, launches, None


def picked_fwd(problem: GDNProblem, cp: CPPlan, warm: ForwardPlan, pipeline: ForwardPlan, engine
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``problem`` under a picked plan (``cp.picked``, :mod:`.pick`): the census counts the
    chained segments that cannot warm up, then the warm chain's launch and the unsegmented
    pipeline's run, each leaving at once unless the count names its plan (0: the chain).
    Both write the same o and final state; no value comes back to the host.

    ``warm``, ``pipeline``: :meth:`~.plan.ClassPlan.picked`'s launches. Returns o and the
    final state as :func:`forward` does."""
    if warm.norm_copies:
        q, k = qk_l2norm_fwd(problem.q, problem.k, warm.stage("qk_l2norm_fwd"))
        problem = replace_fields(problem, q=q, k=k, use_qk_l2norm=False)
    # The pipeline's rnorm kernel reads q and k by pointer: both plans read the TMA's rows.
    problem = tma_readable(problem)
    HV, NSEG, chunks = problem.HV, cp.num_segments, problem.chunks
    hand = torch.empty(NSEG * HV, problem.K, problem.V, dtype=torch.float32, device=problem.k.device)
    flags = torch.zeros(NSEG * HV + 2, dtype=torch.int32, device=problem.k.device)
    pick = warm_census_fwd(problem.g, problem.beta, problem.k, chunks.cu_seqlens, chunks.num_seqs, cp.seg_len, NSEG,
                           flags, warm.stage("warm_census"))
    w, u, g_cum, o, final_state = call_buffers(problem, pipeline, OFF)
    # The one-kernel build reads no T tiles and no g_cum: the hand-over buffer stands in.
    engine.fused.fused_fwd(problem, hand, hand, warm.stage("fused_fwd"), out=(o, final_state),
                           chain=(hand, flags, cp.seg_len, NSEG))
    wy_fwd(problem.k, problem.v, problem.g, problem.beta, chunks, pipeline.stage("wy_fwd"), out=(w, u, g_cum),
           pick=pick)
    rnorm = None
    if problem.use_qk_l2norm:
        rnorm = qk_rnorm_fwd(problem.q, problem.k, pipeline.stage("qk_rnorm_fwd"), pick)
    return state_output_fwd(
        problem.q, problem.k, w, u, g_cum, chunks, pipeline.stage("state_output_fwd"), scale=problem.scale,
        initial_state=problem.initial_state, output_final_state=problem.output_final_state, rnorm=rnorm,
        state_indices=problem.state_indices, out=(o, final_state), pick=pick)


#: The plan a picked call's pipeline allocates its buffers under (its unsegmented form).
OFF = CPPlan(enabled=False, seg_len=0, num_segments=0, reason="picked pipeline")


def warm_chained_fwd(problem: GDNProblem, cp: CPPlan, launches: ForwardPlan, engine, q: torch.Tensor,
                     k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence and output of ``problem`` over the chained segments of ``cp`` in one
    launch of the one-kernel build (:mod:`.warm_chain`): each segment's program walks the
    forgetting suffix before it again from zeros, or waits for the segment before it to
    hand its end state over; no pass 1, no scan.

    ``launches``: the call's :meth:`~.plan.ClassPlan.warm_chain`; ``q``, ``k``: the
    (TMA-readable; with the qk l2 norm off chip, normalized) q and k the kernel reads.
    Returns o and the final state as :func:`forward` does (pool rows written back with
    ``inplace_final_state``)."""
    HV, NSEG = problem.HV, cp.num_segments
    hand = torch.empty(NSEG * HV, problem.K, problem.V, dtype=torch.float32, device=k.device)
    flags = torch.empty(NSEG * HV + 1, dtype=torch.int32, device=k.device)
    # The one-kernel build reads no T tiles and no g_cum: the hand-over buffer stands in.
    return engine.fused.fused_fwd(problem, hand, hand, launches.stage("fused_fwd"), q=q, k=k,
                                  chain=(hand, flags, cp.seg_len, NSEG))


def tma_readable(problem: GDNProblem, names: tuple[str, ...] = ("q", "k", "v")) -> GDNProblem:
    """``problem`` with the inputs ``names`` (of q, k, v) as the TMA unit reads them: each
    one that it cannot read in place (:func:`~.launch_plan.tma_rows_reason`) replaced by
    one contiguous copy, counted in ``contract.INPUT_COPIES`` and logged like the
    contract's own copies."""
    module = native.for_calls()
    if module is not None and module.tma_rows_ok(tuple(getattr(problem, name) for name in names)):
        return problem  # contiguous and aligned: the common call, checked in one C++ call
    moved = {name: _counted_copy(name, getattr(problem, name))
             for name in names if tma_rows_reason(name, getattr(problem, name)) is not None}
    return replace_fields(problem, **moved) if moved else problem


def unsupported_reason(problem: GDNProblem) -> str | None:
    """Why the Gluon kernels cannot run ``problem``, or None.

    registry.toml states dtypes, head dims and compute capabilities (the registry checks
    them before it asks here); this adds what it cannot express: CUDA tensors and int32
    TMA coordinates. (Inputs TMA cannot address in place are copied once by
    :func:`tma_readable`, not refused.)
    """
    if problem.device.type != "cuda":
        return f"needs CUDA tensors, got device {problem.device}"
    return index_limits_reason(problem)


# ----------------------------------------------------------------------------------------
# Context parallelism


def segmented_fwd(problem: GDNProblem, cp: CPPlan, device: DeviceInfo, engine, w: torch.Tensor, u: torch.Tensor,
                  g_cum: torch.Tensor, rnorm: torch.Tensor | None,
                  out: tuple | None = None, pass_two: ForwardPlan | None = None,
                  launches: ForwardPlan | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence and output of ``problem`` over the segments of ``cp`` (``cp.enabled``).

    Parameters
    ----------
    problem : the validated call, q / k / v TMA-readable (:func:`tma_readable`).
    cp : its context-parallel plan: segments of ``L = cp.seg_len`` tokens, ``NSEG =
        cp.num_segments`` segment slots.
    device, engine : as :func:`forward` got them.
    w : Tensor ``[B, T, HV, K]``, u : Tensor ``[B, T, HV, V]``, k's dtype; g_cum : float32
        Tensor ``[B, T, HV]``, chunk-local in log2 units: the call's :func:`.wy.wy_fwd`.
    rnorm : float32 Tensor ``[B * T, H, 2]`` (the call's :func:`.qk_norm.qk_rnorm_fwd`) with
        the qk l2 norm, else None.
    out : (o, seg_cu, M_hi, M_lo, N, seg_h0, final state or None) as :func:`call_buffers`
        allocates them, or None to allocate them in the launching functions.
    pass_two : the call's :func:`segment_launches`, or None to plan them here.
    launches : the call's plan (``fused=False``: its class holds pass 1's), or None to plan
        it here.

    Returns
    -------
    o : Tensor ``[B, T, HV, V]`` in q's dtype.
    final_state : float32 Tensor ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk"), or
        None unless ``problem.output_final_state``; with ``inplace_final_state`` the scan
        writes the pool rows.
    """
    o_out, starts = (None, None) if out is None else ((out[0], None), out[1:])
    if launches is None:
        launches = plan(problem, device=device, engine=engine, fused=False)
    maps = segment_map_fwd(problem.k, w, u, g_cum, problem.beta, problem.chunks.cu_seqlens, cp.seg_len,
                           launches.cls.segment_map, rnorm=rnorm, out=None if starts is None else starts[:4])
    seg_cu, seg_h0, final_state = segment_start_states(problem, cp, g_cum, w, u, out=starts, maps=maps)
    host = segment_host_offsets(problem.chunks, cp.seg_len)
    segments = segment_problem(problem, cp, seg_cu, seg_h0, host)
    if pass_two is None:
        pass_two = segment_launches(problem, cp, device, engine, launches, host)
    launch = pass_two.stage("state_output_fwd")
    o, _ = state_output_fwd(problem.q, problem.k, w, u, g_cum, segments.chunks, launch, scale=problem.scale,
                            initial_state=seg_h0, rnorm=rnorm, out=o_out)
    return o, final_state


def chained_fwd(problem: GDNProblem, cp: CPPlan, launches: ForwardPlan, w: torch.Tensor, u: torch.Tensor,
                g_cum: torch.Tensor, rnorm: torch.Tensor | None,
                out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The recurrence and output of ``problem`` over the chained segments of ``cp``
    (``cp.chained``, :mod:`.segment_chain`): pass 1 with N's blocks alone (the forgetting
    starts, N where a segment forgets, the hand-over counts zeroed), then the fused kernel
    of the call's own configuration over the segment slots, each segment started from the
    one before it; no scan.

    Parameters
    ----------
    problem, w, u, g_cum, rnorm : as :func:`segmented_fwd` takes them.
    cp : its context-parallel plan (``cp.chained``).
    launches : the call's plan (``fused=False``): its fused kernel's configuration is pass
        2's, its class holds pass 1's plan.
    out : (o, seg_cu, f_start, chain_flags, N, final state or None) as :func:`call_buffers`
        allocates them for a chained plan, or None to allocate them here.

    Returns
    -------
    o, final_state : as :func:`segmented_fwd` returns them; with ``inplace_final_state``
        pass 2 writes the pool rows.
    """
    HV, NSEG = problem.HV, cp.num_segments
    pass_one, pass_two = launches.cls.chained(launches.stage("state_output_fwd").shared)
    if out is None:
        o_out, seg_cu, hand = None, None, None
        f_start, flags = chain_buffers(NSEG, HV, problem.k.device)
    else:
        o, seg_cu, f_start, flags, hand, final_state = out
        o_out, f_start, flags = (o, final_state), f_start.view(-1), flags.view(-1)
    _, _, _, hand = segment_map_fwd(problem.k, w, u, g_cum, problem.beta, problem.chunks.cu_seqlens, cp.seg_len,
                                    pass_one, rnorm=rnorm, chain=(f_start, flags),
                                    out=None if out is None else (seg_cu, None, None, hand))
    return state_output_fwd(problem.q, problem.k, w, u, g_cum, problem.chunks, pass_two, scale=problem.scale,
                            initial_state=problem.initial_state, output_final_state=problem.output_final_state,
                            rnorm=rnorm, state_indices=problem.state_indices,
                            chain=(hand, f_start, flags, cp.seg_len, NSEG), out=o_out)


def segment_launches(problem: GDNProblem, cp: CPPlan, device: DeviceInfo, engine, launches: ForwardPlan,
                     host: SegmentOffsets | None) -> ForwardPlan:
    """Pass 2's launches: the plan of ``problem`` over its segments (:func:`segment_problem`),
    its V-block chosen on the segment slots that hold tokens.

    The segments' call class follows from the call's (``launches.cls``) and whether some
    segment ends inside a chunk, so the call's class keeps it per that flag
    (``ClassPlan.segment_classes``): a call then reads it from its counts and the host
    offsets' facts alone (:func:`segment_facts`), as a route does.

    Parameters
    ----------
    problem : the validated call; cp : its context-parallel plan (``cp.enabled``).
    device, engine : as :func:`forward` got them.
    launches : the call's own ForwardPlan (``plan(problem, ..., fused=False)``).
    host : :func:`segment_host_offsets` of the call (None without a host copy).
    """
    tails, busy = segment_facts(host)
    cls = launches.cls.segment_classes.get(tails)
    if cls is None:
        seg_cu = torch.empty(cp.num_segments + 1, dtype=problem.chunks.cu_seqlens.dtype, device="meta")
        seg_h0 = torch.empty(cp.num_segments, problem.HV, problem.K, problem.V, dtype=torch.float32, device="meta")
        segments = segment_problem(problem, cp, seg_cu, seg_h0, host)
        cls = launches.cls.segment_classes[tails] = plan(segments, device=device, engine=engine, fused=False).cls
    return cls.for_call(launches.rows, cp.num_segments, False, busy)


def segment_problem(problem: GDNProblem, cp: CPPlan, seg_cu: torch.Tensor, seg_h0: torch.Tensor,
                    host: SegmentOffsets | None = None) -> GDNProblem:
    """``problem`` with its segments as the sequences, as pass 2 runs it.

    Segment slot ``s`` is sequence ``s`` (empty slots are zero-length sequences); its start
    state is ``seg_h0[s]``, float32 in the "kv" layout as the scan writes it, read in
    place. Pass 2 keeps no final state (the scan has it) and no pool. Its table's host
    offsets (when the call has them) show which slots hold tokens: pass 2's V-block is
    chosen on those (``plan(..., busy_seqs=)``): 16 segments of a 32768-token sequence fill
    17 slots, and counting the empty one took a wider V-block than the 128 programs with
    tokens fit in one wave at (HV 4 on the H200: 0.297 ms against 0.266 forced,
    ``benchmarks/RESULTS.md``).

    Parameters
    ----------
    problem : the validated call.
    cp : its context-parallel plan (``cp.enabled``).
    seg_cu : int Tensor ``[NSEG + 1]``, cu_seqlens's dtype: the segment offsets
        (pass 1 writes them; a ``meta`` tensor in a dry run).
    seg_h0 : float32 Tensor ``[NSEG, HV, K, V]``: the segment start states.
    host : :func:`segment_host_offsets` of the call, where the caller has them (None: read
        here).
    """
    if host is None:
        host = segment_host_offsets(problem.chunks, cp.seg_len)
    if host is None:
        table = segment_table(problem.chunks, problem.B * problem.T, cp, seg_cu)
    else:
        table = segment_table(problem.chunks, problem.B * problem.T, cp, seg_cu, host.offsets, longest=host.longest,
                              aligned=host.aligned, nonempty=host.nonempty)
    return replace_fields(problem, chunks=table, cu_seqlens=seg_cu, initial_state=seg_h0,
                          output_final_state=False, state_layout=StateLayout.KV, state_indices=None,
                          inplace_final_state=False, context_parallel="off")


@dataclass(frozen=True)
class CallPlan:
    """What :func:`forward` launches for one call (a dry run: :func:`plan_call`).

    Attributes
    ----------
    context_parallel : CPPlan, the planner's decision on the device's SM count.
    launches : ForwardPlan of the call ([qk_l2norm_fwd,] wy_fwd, [qk_rnorm_fwd,] state_output_fwd;
        or the path's, [qk_l2norm_fwd,] fused_fwd, with chained segments over the slots on
        the one-kernel build: :func:`call_launches`).
    segments : ForwardPlan of the call over its segments (its state_output_fwd stage is
        pass 2), or None when the call runs unsegmented.
    pipeline : with a picked plan (``context_parallel.picked``), the unsegmented pipeline's
        launches (``launches`` are then the warm chain's, census first; :func:`picked_fwd`),
        else None.
    """

    context_parallel: CPPlan
    launches: ForwardPlan
    segments: ForwardPlan | None
    pipeline: ForwardPlan | None = None

    @property
    def kernels(self) -> tuple[str, ...]:
        """The launches, in order: Gluon stages by their plan's kernel name (pass 1,
        ``segment_map_fwd``, writes the segment table too), the plain-Triton scan as
        ``segment_scan`` (none with chained segments); a picked call's warm chain, then its
        pipeline (the normalized copies, which both read, once)."""
        if self.pipeline is not None:
            ours = tuple(s.kernel for s in self.launches.stages)
            return ours + tuple(s.kernel for s in self.pipeline.stages if s.kernel not in ours)
        if self.launches.fused:
            return tuple(s.kernel for s in self.launches.stages)
        front = tuple(s.kernel for s in self.launches.stages if s.kernel != "state_output_fwd")
        if self.context_parallel.chained:
            return front + ("segment_map_fwd", "state_output_fwd")
        if self.segments is None:
            return front + ("state_output_fwd",)
        return front + ("segment_map_fwd", "segment_scan", "state_output_fwd")

    @property
    def segment_map(self):
        """Pass 1's launch seen with the call's segment slots (None unsegmented, and on the
        warm chain, which has none)."""
        cp, rows = self.context_parallel, self.launches.rows
        if cp.chained and self.launches.fused:
            return None  # the warm chain has no pass 1
        if cp.chained:
            return self._chained()[0].bind(rows, cp.num_segments)
        if self.segments is None:
            return None
        return self.launches.cls.segment_map.bind(rows, cp.num_segments)

    @property
    def state_output(self):
        """The LaunchPlan of the kernel that runs the recurrence (pass 2's when
        segmented; the warp-specialized kernel's on that path)."""
        if self.context_parallel.chained and not self.launches.fused:
            return self._chained()[1].bind(self.launches.rows, self.context_parallel.num_segments)
        launches = self.segments or self.launches
        return launches.stage("fused_fwd" if launches.fused else "state_output_fwd")

    def _chained(self):
        return self.launches.cls.chained(self.launches.stage("state_output_fwd").shared)


def describe_call(problem: GDNProblem, device: DeviceInfo, *, engine) -> str:
    """The launches :func:`forward` makes for ``problem`` on ``device``, in one line, with
    why it takes the warp-specialized path or the pipeline (what ``explain`` shows)."""
    call = plan_call(problem, device, engine=engine)
    text = ", ".join(call.kernels)
    norm = ""
    if call.launches.norm_copies:
        why = "fp16" if needs_norm_copies(problem) else f"{problem.HV // problem.H} v-heads per q/k head"
        norm = f"; the qk l2 norm on normalized copies ({why})"
    elif problem.use_qk_l2norm:
        norm = "; the qk l2 norm reduced in its kernels"
    if call.pipeline is not None:
        cp = call.context_parallel
        return f"{text} (picked on the device: the one-kernel build over {cp.num_segments} chained segment slots " \
               f"where every segment warms up, else the unsegmented pipeline{norm})"
    if call.launches.fused:
        return f"{text} (warp-specialized: {problem.N * problem.HV} (sequence, v-head) programs on " \
               f"{device.sm_count} SMs{norm})"
    so = call.state_output
    # The pipeline's launches name its reciprocal norms; normalized copies say why.
    norm = norm if call.launches.norm_copies else ""
    config = f"state kernel V-blocks of {so.blocks['BV']} on {so.num_warps} warps{norm}"
    fused_path = getattr(engine, "fused", None)
    if fused_path is None:
        return f"{text} ({config})"
    reason = fused_path.fused_reason(problem)
    if reason is None:
        if call.context_parallel.enabled:
            reason = "segmented calls run the pipeline"
        else:
            need = call.launches.cls.fused_min_programs
            reason = f"{problem.N * problem.HV} (sequence, v-head) programs, it needs {need}"
    return f"{text} ({config}; not the warp-specialized path: {reason})"


def plan_call(problem: GDNProblem, device: DeviceInfo, *, engine=None) -> CallPlan:
    """Dry run of :func:`forward`: the context-parallel decision and every Gluon launch,
    with no GPU and no tensor read (CPU tensors do; the segment offsets and start states
    are ``meta`` tensors of their real shapes).

    Parameters
    ----------
    problem : a validated call.
    device : DeviceInfo the launches are sized for (its SM count decides "auto").
    engine : the launching backend's matrix engine; None: the one registry.toml admits.
    """
    cp, launches, pipeline = call_launches(problem, plan_for_problem(problem, device.sm_count), device, engine)
    if not cp.enabled or cp.chained:
        return CallPlan(context_parallel=cp, launches=launches, segments=None, pipeline=pipeline)
    segments = segment_launches(problem, cp, device, engine, launches,
                                segment_host_offsets(problem.chunks, cp.seg_len))
    return CallPlan(context_parallel=cp, launches=launches, segments=segments)
