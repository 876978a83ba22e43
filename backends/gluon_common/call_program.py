"""A common call's allocations and launches in one C++ call: the native layer's CallProgram.

The forward's Python host path, past the contract and the plan, spends most of its time in
the stage wrappers (shapes, stand-in pointers, the argument dicts), in
:func:`.launch.launch_planned`'s checks and in one tensor allocation per buffer. A call
program does the same for the call forms servers send on every layer of every step:
contiguous inputs the TMA unit reads in place, an initial state (if any) in float32 or
bfloat16, or a state pool (float32 or bfloat16) read and maybe written back in place
through ``state_indices``:

    program = cls.programs[launch sequence, initial state given]     # built at first use
    buffers = program(inputs, sizes, counts, scale, device, stream)  # or None

A segmented call (context parallelism) has its own program (:func:`run_segmented_call`):
wy, [qk rnorm,] pass 1 (:mod:`.segment_map`), the scan (triton_generic's plain-Triton
kernel, launched through its own launch site's GuardedLauncher), and pass 2 over the
segment slots, with the segment count and length among its counts; it is kept by pass 2's
launch, whose plan reads the segment offsets' facts (:mod:`.segments`).

Each launch's argument lists are the stage's own (``wy_launch_args``,
``state_output_launch_args``, ...: the functions the Python wrappers launch with), called
once with :class:`Ref` placeholders where the call's values go; the program binds them to
the call's inputs, its buffers (allocated in the same C++ call), its counts and its scale.
Every launch goes through the GuardedLauncher of the kernel its plan launched last, and
every launch's checks pass before the first one is made: a call any of them refuses (a
new specialization, a plan's first call) launches nothing, and the Python path runs it.
``tests/test_call_program.py`` checks that both paths hand the launcher the same
arguments over a fuzz of call forms. (:mod:`gdn_dispatch.backends.call_program` holds what
this shares with triton_generic's programs.)

Nothing here is used where the native layer is not built or is off
(``GDN_DISPATCH_NATIVE=0``), where the launches go through Triton's binder (a launch hook,
``GDN_DISPATCH_JIT_LAUNCH=1``), or for any other call form.
"""

from __future__ import annotations

import torch

from gdn_dispatch import native
from gdn_dispatch.context_parallel import CPPlan
from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem, StateLayout
from gdn_dispatch.device import DeviceInfo
from gdn_dispatch.native import INTERMEDIATES
from gdn_dispatch.varlen import num_slots

from gdn_dispatch.backends import direct_launch
from gdn_dispatch.backends.call_program import (
    BETA, COUNT_HEAD_ROWS, COUNT_L, COUNT_N, COUNT_NSEG, COUNT_POOL, COUNT_ROWS, CU, G, H0, INDICES, K, Q, SCALE, V,
    Ref, add_step, buffer_ref, call_counts, call_inputs, count_ref, counted, input_ref, pool_rows, route_decisions,
    segmented_counts)
from gdn_dispatch.backends.gluon_common import launch as L
from gdn_dispatch.backends.gluon_common.buffers import buffer_specs
from gdn_dispatch.backends.gluon_common.launch_plan import counts_limits_reason
from gdn_dispatch.backends.gluon_common.plan import NORM_KERNELS, ForwardPlan, plan
from gdn_dispatch.backends.gluon_common.qk_norm import norm_launch_args
from gdn_dispatch.backends.gluon_common.segment_map import segment_map_launch_args
from gdn_dispatch.backends.gluon_common.segments import (
    ragged_segment_facts, segment_facts, uniform_segment_facts)
from gdn_dispatch.backends.gluon_common.state_output import state_output_launch_args
from gdn_dispatch.backends.gluon_common.wy import wy_launch_args
from gdn_dispatch.backends.gluon_common.wy_t import planned_t_tile_rows, wy_t_launch_args
from gdn_dispatch.backends.triton_generic.configs import device_facts
from gdn_dispatch.backends.triton_generic.segment_map import maps_dtype
from gdn_dispatch.backends.triton_generic.segment_scan import (
    _segment_scan_fwd_kernel, segment_scan_config, segment_scan_launch_args)


def run_call(problem: GDNProblem, launches: ForwardPlan, engine) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Run ``problem`` (validated, not segmented) through its call program: (o, final
    state or None) as :func:`.forward.forward` returns them, or None (nothing launched)
    where the program does not take the call."""
    module = native.for_calls()
    if module is None:
        return None
    counts = call_counts(problem)
    if counts[COUNT_ROWS] == 0 or counts[COUNT_N] * problem.HV == 0:
        return None  # the wrappers' own early answers (no launch, or the initial state copied)
    key = (*map(id, launches.launches), problem.initial_state is None)
    program = launches.cls.programs.get(key)
    if program is None:
        program = launches.cls.programs[key] = build(problem, launches, engine, module)
    return run_program(program, launches, call_inputs(problem), problem.B, problem.T, counts, float(problem.scale))


def run_segmented_call(problem: GDNProblem, cp: CPPlan, launches: ForwardPlan,
                       pass_two: ForwardPlan) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Run ``problem`` (validated, segmented by ``cp``) through its call program: wy, [qk
    rnorm,] pass 1, the scan and pass 2 (``pass_two``: :func:`.forward.segment_launches`)
    in one native call; (o, final state or None), or None (nothing launched) where the
    program does not take the call."""
    module = native.for_calls()
    if module is None:
        return None
    counts = segmented_counts(call_counts(problem), cp)
    if counts[COUNT_ROWS] == 0 or counts[COUNT_N] * problem.HV == 0:
        return None
    scan = _scan_config(problem.device, problem.q.dtype, problem.K, problem.V, counts[COUNT_N] * problem.HV)
    key = _segmented_key(pass_two, problem.initial_state is None, problem.chunks.cu_seqlens.dtype, scan)
    program = launches.cls.programs.get(key)
    if program is None:
        program = launches.cls.programs[key] = build_segmented(problem, launches, pass_two, scan, module)
    return run_program(program, launches, call_inputs(problem), problem.B, problem.T, counts, float(problem.scale))


def _scan_config(device: torch.device, dtype: torch.dtype, K: int, V: int, pairs: int):
    """The scan's launch configuration, as :func:`segment_scan_fwd` picks it."""
    capability, sm_count = device_facts(device)
    return segment_scan_config(K, V, capability, pairs, sm_count, maps_dtype(dtype) == torch.bfloat16)


def _segmented_key(pass_two: ForwardPlan, no_h0: bool, cu_dtype: torch.dtype, scan) -> tuple:
    """What a segmented call's program is kept by in its call class: pass 2's launch, the
    initial state's presence, the offsets' dtype (the segment offsets' buffer has it) and
    the scan's configuration (which follows ``N * HV``)."""
    return ("segmented", id(pass_two.launches[-1]), no_h0, cu_dtype, scan)


def run_program(program, launches: ForwardPlan, inputs: tuple, B: int, T: int, counts: tuple,
                scale: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One call through a built ``program`` of ``launches``: ``inputs`` in INPUTS order,
    ``counts`` in COUNT_N ... COUNT_POOL order (a segmented call's through COUNT_L);
    (o, final state or None), or None."""
    runtime = L._runtime()
    if not runtime.launches_directly():
        return None
    call, has_final = program
    N, rows = counts[COUNT_N], counts[COUNT_ROWS]
    # The allocator's fourth and fifth sizes: the T tiles' rows, or NSEG and NSEG + 1.
    if launches.inverses_on_chip:
        sized = (0, 0)
    elif launches.fused:
        sized = (planned_t_tile_rows(launches.stage("wy_t_fwd").shared, rows, N), 0)
    elif len(counts) > COUNT_NSEG:
        sized = (counts[COUNT_NSEG], counts[COUNT_NSEG] + 1)
    else:
        sized = (0, 0)
    device = runtime.current_device()
    buffers = call(inputs, (B, T, N, *sized, rows), counts, scale, device, runtime.stream(device))
    if counted(buffers) is None:
        return None
    return buffers[0], buffers[1] if has_final else None


def route_runner(problem: GDNProblem, device: DeviceInfo, engine):
    """The runner :mod:`gdn_dispatch.routes` keeps for calls of ``problem``'s form on
    ``device`` (the registry's), or None where the form takes no program (the layer
    off). ``run(q, k, v, g, beta, cu_seqlens, initial_state, state_indices, B, T, N,
    longest, scale, cu_host)`` makes the forward's per-call decisions from the counts (the
    tensors' device current, the index limits, context parallelism, the launch plan for
    ``B * T`` and ``N``, or a segmented call's pass 2 for its segment slots: the segment
    offsets' facts from the counts, or from ``cu_host``, the host copy of a ragged batch's
    offsets) and runs the call's program: (o, final state or None), or None (nothing
    launched: the forward then runs the call) where any of them differs or the program is
    not built yet."""
    if native.for_calls() is None or problem.chunks.chunk_size != CHUNK_SIZE:
        return None
    cls = plan(problem, device=device, engine=engine, fused=True).cls
    index, request, sm_count = problem.device.index, problem.context_parallel, device.sm_count
    H, Kd, HV, V, no_h0 = problem.H, problem.K, problem.HV, problem.V, problem.initial_state is None
    uniform, device_index, dtype = problem.chunks.uniform, problem.device, problem.q.dtype

    def run(q, k, v, g, beta, cu, h0, indices, B, T, N, longest, scale, cu_host=None):
        if index != torch.cuda.current_device():
            return None
        decided = route_decisions(q, cu, B, T, N, HV, V, request, sm_count, longest)
        if decided is None:
            return None
        offsets, cp = decided
        if cp.chained:
            return None  # no program for chained segments: the forward launches them
        rows = B * T
        slots = num_slots(rows, N, CHUNK_SIZE)
        if counts_limits_reason(rows, slots, HV) is not None:
            return None
        counts = (N, rows, rows * H, slots, pool_rows(h0, indices))
        if cp.enabled:
            return run_segmented(offsets, q, k, v, g, beta, h0, indices, B, T, N, longest, scale, cp, counts,
                                 cu_host)
        launches = cls.for_call(rows, N, True)
        program = cls.programs.get((*map(id, launches.launches), no_h0))
        if program is None:
            return None
        return run_program(program, launches, (q, k, v, g, beta, offsets, h0, indices), B, T, counts, scale)

    def run_segmented(cu, q, k, v, g, beta, h0, indices, B, T, N, longest, scale, cp, counts, cu_host):
        # Pass 2's plan reads the segment offsets' facts: from the counts where the batch is
        # uniform or one sequence, from the host copy of a ragged batch's offsets, assumed
        # without one.
        if uniform or N == 1 and longest is not None:
            tails, busy = uniform_segment_facts(B, T, cp.seg_len) if uniform else \
                uniform_segment_facts(1, longest, cp.seg_len)
        elif longest is None or cu_host is None:
            tails, busy = segment_facts(None)
        else:
            tails, busy = ragged_segment_facts(cu_host.tolist(), cp.seg_len)
        seg_cls = cls.segment_classes.get(tails)
        if seg_cls is None:
            return None
        launches = cls.for_call(B * T, N, False)
        pass_two = seg_cls.for_call(B * T, cp.num_segments, False, busy)
        key = _segmented_key(pass_two, no_h0, cu.dtype, _scan_config(device_index, dtype, Kd, V, N * HV))
        program = cls.programs.get(key)
        if program is None:
            return None
        return run_program(program, launches, (q, k, v, g, beta, cu, h0, indices), B, T,
                           segmented_counts(counts, cp), scale)

    return run


def build(problem: GDNProblem, launches: ForwardPlan, engine, module):
    """The call program of ``launches`` for calls of ``problem``'s form: (the native
    CallProgram, whether it returns a final state). A program returns ``(o,)`` or ``(o,
    final state)``; its other buffers never leave the native layer."""
    H, HK, HV = problem.H, problem.H * problem.K, problem.HV
    specs = buffer_specs(problem, ("fused",) if launches.fused else ("pipeline",))
    final = len(specs) - 1 if problem.output_final_state else None
    q, k, v, g, beta, cu = (input_ref(i) for i in (Q, K, V, G, BETA, CU))
    n, head_rows = count_ref(COUNT_N), count_ref(COUNT_HEAD_ROWS)
    # Buffers (buffer_specs): fused o, g_cum, T tiles; pipeline w, u, g_cum, o; then the
    # final state. An unused state pointer reads g_cum as the wrappers' stand-in.
    g_cum = buffer_ref(1 if launches.fused else 2)
    h0 = input_ref(H0) if problem.initial_state is not None else g_cum
    ht = g_cum if final is None else buffer_ref(final)
    # A state pool: read (and written back) through the indices; else cu_seqlens stands in.
    pool = problem.state_indices is not None
    indices, pool_size = (input_ref(INDICES), count_ref(COUNT_POOL)) if pool else (cu, 0)
    # q's and k's token stride is H * K, g's and beta's HV: the program takes contiguous inputs only.
    steps = []
    if launches.norm_copies:
        norm, args, q, k = _norm_copies(problem, launches, specs, q, k, head_rows)
        steps.append((norm, args))
    if launches.fused:
        o, t_tiles = buffer_ref(0), buffer_ref(2)
        if not launches.inverses_on_chip:
            wy_t = launches.stage("wy_t_fwd").shared
            steps.append((wy_t, wy_t_launch_args(wy_t, k, t_tiles, g, g_cum, beta, cu, n, HV, HV)))
        fused = launches.stage("fused_fwd").shared
        # k's token stride 0: read by a chained launch alone, which no call program runs.
        steps.append((fused, engine.fused.fused_launch_args(fused, q, k, v, t_tiles, o, g_cum, h0, ht, indices, cu,
                                                            SCALE, pool_size, g, beta, HV, HV, 0)))
        outputs = [0]
    else:
        w, u, o = buffer_ref(0), buffer_ref(1), buffer_ref(3)
        wy = launches.stage("wy_fwd").shared
        steps.append((wy, wy_launch_args(wy, k, v, w, u, g, g_cum, beta, cu, n, HV, HV)))
        rnorm = g_cum  # not read without the qk l2 norm, nor on the normalized copies
        if problem.use_qk_l2norm and not launches.norm_copies:
            specs.append(((-6, H, 2), torch.float32, INTERMEDIATES))  # qk_rnorm_fwd's [B * T, H, 2]
            rnorm = buffer_ref(len(specs) - 1)
            norm = launches.stage("qk_rnorm_fwd").shared
            steps.append((norm, norm_launch_args(norm, q, k, rnorm, head_rows, H, HK, HK)))
        so = launches.stage("state_output_fwd").shared
        steps.append((so, state_output_launch_args(so, q, k, w, u, o, g_cum, rnorm, h0, ht, indices, cu, SCALE,
                                                   pool_size, g_cum, cu, cu, 0, 0, 0)))
        outputs = [3]
    program = module.CallProgram(specs, [Q, K, V], [G, BETA], H0, outputs + ([] if final is None else [final]))
    for launch, (tensors, args) in steps:
        rule = launch.grid_rule
        norm = launch.kernel in NORM_KERNELS
        add_step(program, module, launch.compiled, args, tensors,
                 (rule.row_block, rule.ceil, rule.per_seq, rule.times, rule.minimum, *rule.more),
                 COUNT_HEAD_ROWS if norm else COUNT_ROWS, -1 if norm else COUNT_N)
    return program, final is not None


def _norm_copies(problem: GDNProblem, launches: ForwardPlan, specs: list, q: Ref, k: Ref, head_rows: Ref):
    """The qk_l2norm_fwd launch of a call on normalized copies (``launches.norm_copies``):
    its ``[2, B, T, H, K]`` buffer appended to ``specs``; (launch plan, its launch
    arguments, the copies of q and of k as later steps read them)."""
    HK = problem.H * problem.K
    specs.append(((2, -1, -2, problem.H, problem.K), None, INTERMEDIATES))
    copies = buffer_ref(len(specs) - 1)
    norm = launches.stage("qk_l2norm_fwd").shared
    args = norm_launch_args(norm, q, k, copies, head_rows, problem.H, HK, HK)
    return norm, args, Ref("item", len(specs) - 1, 0), Ref("item", len(specs) - 1, 1)


def build_segmented(problem: GDNProblem, launches: ForwardPlan, pass_two: ForwardPlan, scan, module):
    """The call program of a segmented call of ``problem``'s form (:func:`.forward.segmented_fwd`'s
    launches: wy, [qk rnorm,] pass 1 (the class's ``segment_map`` plan), the scan
    (triton_generic's plain-Triton kernel, through its launch site's GuardedLauncher), pass
    2 as ``pass_two`` plans it; the scan in configuration ``scan``): (the native
    CallProgram, whether it returns a final state). Pass 1 and pass 2 run over the segment
    slots (count ``COUNT_NSEG``), the scan over the sequences."""
    H, HK, HV, Kd, Vd = problem.H, problem.H * problem.K, problem.HV, problem.K, problem.V
    # On normalized copies the stages after the norm see a call without it.
    l2 = problem.use_qk_l2norm and not launches.norm_copies
    specs = buffer_specs(problem, ("segmented", problem.chunks.cu_seqlens.dtype, maps_dtype(problem.q.dtype)))
    final = len(specs) - 1 if problem.output_final_state else None
    w, u, g_cum, o, seg_cu, m_hi, m_lo, n_map, seg_h0 = (buffer_ref(i) for i in range(9))
    q, k, v, g, beta, cu = (input_ref(i) for i in (Q, K, V, G, BETA, CU))
    n, nseg, seg_len = count_ref(COUNT_N), count_ref(COUNT_NSEG), count_ref(COUNT_L)
    pool = problem.state_indices is not None
    indices, pool_size = (input_ref(INDICES), count_ref(COUNT_POOL)) if pool else (cu, 0)
    # (site dict, runtime arguments, descriptor tensors, grid rule, rows count, sequences count, options)
    steps = []

    def gluon_step(launch, tensors, args, rows_count, seqs_count):
        rule = launch.grid_rule
        steps.append((launch.compiled, args, tensors, (rule.row_block, rule.ceil, rule.per_seq, rule.times,
                                                       rule.minimum, *rule.more), rows_count, seqs_count, None))

    def triton_step(kernel, cfg, args, per_seq, seqs_count):
        site = vars(direct_launch.call_site(kernel, tuple(args)))
        steps.append((site, args, {}, (0, False, per_seq, 1, 0), -1, seqs_count, (cfg.num_warps, cfg.num_stages)))

    if launches.norm_copies:
        norm, (tensors, args), q, k = _norm_copies(problem, launches, specs, q, k, count_ref(COUNT_HEAD_ROWS))
        gluon_step(norm, tensors, args, COUNT_HEAD_ROWS, -1)
    wy = launches.stage("wy_fwd").shared
    gluon_step(wy, *wy_launch_args(wy, k, v, w, u, g, g_cum, beta, cu, n, HV, HV), COUNT_ROWS, COUNT_N)
    rnorm = g_cum  # not read without the qk l2 norm
    if l2:
        specs.append(((-6, H, 2), torch.float32, INTERMEDIATES))  # qk_rnorm_fwd's [B * T, H, 2]
        rnorm = buffer_ref(len(specs) - 1)
        norm = launches.stage("qk_rnorm_fwd").shared
        gluon_step(norm, *norm_launch_args(norm, q, k, rnorm, count_ref(COUNT_HEAD_ROWS), H, HK, HK),
                   COUNT_HEAD_ROWS, -1)
    # Pass 1 over the segment slots; k's row norms from the qk rnorm launch (g_cum stands in
    # without); beta's token stride is HV (contiguous inputs).
    pass_one = launches.cls.segment_map
    gluon_step(pass_one, *segment_map_launch_args(pass_one, k, w, u, g_cum, rnorm, beta, cu, seg_cu, n, nseg,
                                                  seg_len, m_hi, m_lo, n_map, HV), COUNT_ROWS, COUNT_NSEG)
    # The scan: unused state pointers read the maps' N as the wrapper's stand-in.
    triton_step(_segment_scan_fwd_kernel, scan, segment_scan_launch_args(
        scan, m_hi, m_lo, n_map, cu, input_ref(H0) if problem.initial_state is not None else n_map,
        n_map if final is None else buffer_ref(final), seg_h0, indices, pool_size, seg_len, HV, Kd, Vd,
        use_h0=problem.initial_state is not None, use_pool=pool, inplace=pool and problem.inplace_final_state,
        store_ht=final is not None, state_vk=problem.state_layout is StateLayout.VK), HV * -(-Vd // scan.BV), COUNT_N)
    # Pass 2: the segments as the sequences, from their start states; no final state, no pool.
    so = pass_two.stage("state_output_fwd").shared
    gluon_step(so, *state_output_launch_args(so, q, k, w, u, o, g_cum, rnorm, seg_h0, g_cum, seg_cu, seg_cu, SCALE,
                                             0, g_cum, seg_cu, seg_cu, 0, 0, 0), COUNT_ROWS, COUNT_NSEG)
    program = module.CallProgram(specs, [Q, K, V], [G, BETA], H0, [3] + ([] if final is None else [final]))
    for site, args, tensors, grid, rows_count, seqs_count, options in steps:
        add_step(program, module, site, args, tensors, grid, rows_count, seqs_count, options)
    return program, final is not None
