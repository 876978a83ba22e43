"""triton_generic's call programs: a common call's allocations and its three or four
launches in one native call (:mod:`gdn_dispatch.backends.call_program` says how a program
is made).

Taken for the call forms servers send: contiguous inputs, an initial state (if any) in
float32 or bfloat16 or a state pool read (and maybe written back) in place through
``state_indices``, with kept kernels launched directly
(:mod:`gdn_dispatch.backends.direct_launch`). The launches::

    g_cum, T     = kkt_solve(k, g, beta)                 grid (slots * HV)   (sm_100, sm_120 only)
    [g_cum,] w, u[, r_k] = wu(k, v, g | g_cum, beta[, T])  grid (slots * HV)
    h, v_new, S  = state(k, w, u, g_cum, S0)             grid (N * HV * V blocks)
    o            = output(q, k, v_new, h, g_cum)         grid (slots * HV, V blocks)

(the w/u kernel forms T itself, and the gate cumsum with it, where
:func:`.configs.fuse_solve_into_wu` says so: sm_80 to sm_90), each with the stage's own
argument list (``kkt_solve_launch_args``, ``wu_launch_args``, ``state_launch_args``,
``output_launch_args``) and launch options, through its call site's GuardedLauncher; every
check passes before the first launch, else the program launches nothing and the Python
path runs the call. A segmented call (context parallelism, :mod:`.context_parallel`) runs
pass 1 and the scan after the w/u kernel, then the state and output kernels over the
segment slots from their start states, the segment count and length among its counts. A
program is kept per call form, device capability and the state kernel's configuration
(which follows ``N * HV``, or ``NSEG * HV``, and then the scan's, which follows ``N *
HV``, and the offsets' dtype); ``tests/test_call_program.py`` holds both paths to the same
launches.
"""

from __future__ import annotations

import torch

from gdn_dispatch import native, routes
from gdn_dispatch.context_parallel import CPPlan
from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem, StateLayout
from gdn_dispatch.device import DeviceInfo
from gdn_dispatch.native import INTERMEDIATES
from gdn_dispatch.varlen import num_slots

from gdn_dispatch.backends import direct_launch
from gdn_dispatch.backends.call_program import (
    BETA, COUNT_L, COUNT_N, COUNT_NSEG, COUNT_POOL, COUNT_ROWS, COUNT_SLOTS, CU, G, H0, INDICES, K, Q, SCALE, V,
    add_step, buffer_ref, call_counts, call_inputs, count_ref, counted, input_ref, pool_rows, route_decisions,
    segmented_counts)
from gdn_dispatch.backends.triton_generic._jit import interpreting
from gdn_dispatch.backends.triton_generic.buffers import buffer_specs
from gdn_dispatch.backends.triton_generic.configs import (
    device_facts, fuse_solve_into_wu, intra_config, output_config, state_config)
from gdn_dispatch.backends.triton_generic.kkt_solve import _kkt_solve_fwd_kernel, kkt_solve_launch_args
from gdn_dispatch.backends.triton_generic.output import _output_fwd_kernel, output_launch_args
from gdn_dispatch.backends.triton_generic.segment_map import (
    FORGETTING_CONFIG, _forgetting_start_kernel, _segment_map_fwd_kernel, forgetting_start_launch_args, maps_dtype,
    segment_map_blocks, segment_map_config, segment_map_launch_args)
from gdn_dispatch.backends.triton_generic.segment_scan import (
    _segment_scan_fwd_kernel, segment_scan_config, segment_scan_launch_args)
from gdn_dispatch.backends.triton_generic.state import _state_fwd_kernel, state_launch_args
from gdn_dispatch.backends.triton_generic.wu import _wu_fwd_kernel, wu_launch_args

#: Programs by call form and state configuration; emptied when full.
_PROGRAMS: dict[tuple, tuple] = {}
PROGRAMS_KEPT = 256


#: Why a picked plan (``CPPlan.picked``) runs "off" here: this backend has no warm chain.
UNPICKED = "the one-kernel build's warm chain (gluon_sm90)"


def clear_programs() -> None:
    """Forget every program, and the routes that lead to them (tests and benchmarks that
    start from fresh launch sites)."""
    _PROGRAMS.clear()
    routes.clear()


def run_call(problem: GDNProblem, sm_count: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Run ``problem`` (validated, not segmented; ``sm_count`` as the forward sizes the state
    kernel for) through its call program: (o, final state or None), or None (nothing
    launched) where the program does not take the call."""
    module = native.for_calls()
    # (CPU tensors run under the interpreter, which launches through Triton's JIT.)
    if module is None or interpreting() or problem.chunks.chunk_size != CHUNK_SIZE:
        return None
    capability, _ = device_facts(problem.device)
    counts = call_counts(problem)
    N, HV = counts[COUNT_N], problem.HV
    if counts[COUNT_ROWS] == 0 or N * HV == 0:
        return None  # the stages' own early answers
    state_cfg = state_config(problem.K, problem.V, N * HV, problem.q.element_size(), capability, sm_count)
    key = (*_form_key(problem, capability), state_cfg)
    program = _PROGRAMS.get(key)  # the key's capability decides the w/u form (fuse_solve_into_wu)
    if program is None:
        if len(_PROGRAMS) >= PROGRAMS_KEPT:
            _PROGRAMS.clear()
        program = _PROGRAMS[key] = build(problem, capability, state_cfg, module)
    return run_program(program, call_inputs(problem), problem.B, problem.T, counts, float(problem.scale))


def run_segmented_call(problem: GDNProblem, cp: CPPlan,
                       sm_count: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Run ``problem`` (validated, segmented by ``cp``) through its call program: the
    kernel forming T, pass 1, the scan and pass 2 (state, output over the segments) in one
    native call; (o, final state or None), or None (nothing launched) where the program
    does not take the call."""
    module = native.for_calls()
    if module is None or interpreting() or problem.chunks.chunk_size != CHUNK_SIZE:
        return None
    capability, device_sms = device_facts(problem.device)
    counts = segmented_counts(call_counts(problem), cp)
    N, HV = counts[COUNT_N], problem.HV
    if counts[COUNT_ROWS] == 0 or N * HV == 0:
        return None
    key = (*_form_key(problem, capability), *_segmented_configs(problem.K, problem.V, problem.q.dtype,
                                                                problem.q.element_size(), N, HV, cp.num_segments,
                                                                capability, sm_count, device_sms),
           problem.chunks.cu_seqlens.dtype)
    program = _PROGRAMS.get(key)
    if program is None:
        if len(_PROGRAMS) >= PROGRAMS_KEPT:
            _PROGRAMS.clear()
        program = _PROGRAMS[key] = build(problem, capability, key[-3], module, scan=key[-2])
    return run_program(program, call_inputs(problem), problem.B, problem.T, counts, float(problem.scale))


def _segmented_configs(K: int, V: int, dtype: torch.dtype, elem: int, N: int, HV: int, nseg: int, capability,
                       sm_count: int, device_sms: int) -> tuple:
    """``("segmented", pass 2's state kernel configuration, the scan's)``: the state
    kernel's follows the segment slots (``NSEG * HV``) as :func:`.state.state_fwd` picks
    it for ``sm_count``, the scan's the sequences (``N * HV``) as
    :func:`.segment_scan.segment_scan_fwd` picks it for the device's SMs."""
    return ("segmented", state_config(K, V, nseg * HV, elem, capability, sm_count),
            segment_scan_config(K, V, capability, N * HV, device_sms, maps_dtype(dtype) == torch.bfloat16))


def _form_key(problem: GDNProblem, capability) -> tuple:
    """What a program is kept by, but the state kernel's configuration."""
    return (problem.device.index, capability, problem.q.dtype, problem.H, problem.K, problem.HV, problem.V,
            problem.use_qk_l2norm, problem.state_layout, problem.output_final_state, problem.initial_state is None,
            problem.state_indices is not None, problem.inplace_final_state)


def run_program(program, inputs: tuple, B: int, T: int, counts: tuple,
                scale: float) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One call through a built ``program``: ``inputs`` in INPUTS order, ``counts`` in
    COUNT_N ... COUNT_POOL order (a segmented call's through COUNT_L); (o, final state or
    None), or None."""
    runtime = direct_launch._RUNTIME or direct_launch._init_runtime()
    if not runtime.direct():
        return None
    call, has_final = program
    device = torch.cuda.current_device()
    if len(counts) > COUNT_NSEG:  # buffer_specs' sizes: the segments' chunk slots, NSEG + 1, NSEG
        nseg = counts[COUNT_NSEG]
        sizes = (B, T, counts[COUNT_N], num_slots(B * T, nseg, CHUNK_SIZE), nseg + 1, nseg)
    else:
        sizes = (B, T, counts[COUNT_N], counts[COUNT_SLOTS], 0, 0)
    buffers = call(inputs, sizes, counts, scale, device, runtime.stream(device))
    if counted(buffers) is None:
        return None
    return buffers[0], buffers[1] if has_final else None


def route_runner(problem: GDNProblem, device: DeviceInfo):
    """The runner :mod:`gdn_dispatch.routes` keeps for calls of ``problem``'s form on
    ``device`` (the registry's), or None where the form takes no program (the
    interpreter, the layer off). ``run(q, k, v, g, beta, cu_seqlens, initial_state,
    state_indices, B, T, N, longest, scale, cu_host)`` (``cu_host`` not read) makes the forward's per-call decisions from
    the counts (the tensors' device current, context parallelism, the state kernel's and a
    segmented call's scan's configurations) and runs the call's program: (o, final state or
    None), or None (nothing launched: the forward then runs the call) where any of them
    differs or the program is not built yet."""
    if native.for_calls() is None or interpreting() or problem.chunks.chunk_size != CHUNK_SIZE:
        return None
    capability, device_sms = device_facts(problem.device)
    form = _form_key(problem, capability)
    index, request, sm_count = problem.device.index, problem.context_parallel, device.sm_count
    on_cuda = problem.device.type == "cuda"
    H, Kd, HV, Vd, elem = problem.H, problem.K, problem.HV, problem.V, problem.q.element_size()
    dtype = problem.q.dtype

    def run(q, k, v, g, beta, cu, h0, indices, B, T, N, longest, scale, cu_host=None):
        if on_cuda and index != torch.cuda.current_device():
            return None
        decided = route_decisions(q, cu, B, T, N, HV, Vd, request, sm_count, longest)
        if decided is None:
            return None
        offsets, cp = decided
        cp = cp.unpicked(UNPICKED)
        if cp.chained:
            return None  # no program for chained segments: the forward launches them
        rows = B * T
        counts = (N, rows, rows * H, num_slots(rows, N, CHUNK_SIZE), pool_rows(h0, indices))
        if cp.enabled:
            counts = segmented_counts(counts, cp)
            key = (*form, *_segmented_configs(Kd, Vd, dtype, elem, N, HV, cp.num_segments, capability,
                                              sm_count, device_sms), offsets.dtype)
        else:
            key = (*form, state_config(Kd, Vd, N * HV, elem, capability, sm_count))
        program = _PROGRAMS.get(key)
        if program is None:
            return None
        return run_program(program, (q, k, v, g, beta, offsets, h0, indices), B, T, counts, scale)

    return run


def _site(kernel, args: dict) -> dict:
    """The attribute dict of ``kernel``'s launch site for this argument list (made here
    if no launch made it yet): its "fast" entry is the GuardedLauncher of the kernel the
    site launched last."""
    return vars(direct_launch.call_site(kernel, tuple(args)))


def build(problem: GDNProblem, capability, state_cfg, module, scan=None):
    """The call program for calls of ``problem``'s form with the state kernel in
    ``state_cfg``: (the native CallProgram, whether it returns a final state). With
    ``scan`` (the scan's configuration) the program of a segmented call: pass 1 and the
    scan after the kernel forming T, then the state and output kernels over the segment
    slots (count ``COUNT_NSEG``) from their start states. A program returns ``(o,)`` or
    ``(o, final state)``; its other buffers never leave the native layer."""
    H, Kd, HV, Vd, l2 = problem.H, problem.K, problem.HV, problem.V, problem.use_qk_l2norm
    dtype, elem = problem.q.dtype, problem.q.element_size()
    fused_solve = fuse_solve_into_wu(capability)
    segmented = scan is not None
    specs = buffer_specs(problem, ("segmented", problem.chunks.cu_seqlens.dtype, maps_dtype(dtype)) if segmented
                         else ("unsegmented",))
    names = ["g_cum"] + (["k_rnorm"] if l2 else []) + ["w", "u"]
    names += ["seg_cu", "m_hi", "m_lo", "n_map", "seg_h0"] if segmented else []
    names += ["h", "v_new", "o"] + (["final_state"] if problem.output_final_state else [])
    if not fused_solve:  # kkt_solve_fwd's T, [B, T, HV, 64] in k's dtype
        specs.append(((-1, -2, HV, CHUNK_SIZE), None, INTERMEDIATES))
        names.append("A_inv")
    buf = {name: buffer_ref(i) for i, name in enumerate(names)}
    g_cum = buf["g_cum"]
    k_rnorm = buf.get("k_rnorm", g_cum)
    q, k, v, g, beta, cu = (input_ref(i) for i in (Q, K, V, G, BETA, CU))
    h0 = input_ref(H0) if problem.initial_state is not None else g_cum
    # A state pool: read (and written back) through the indices; else cu_seqlens stands in.
    pool = problem.state_indices is not None
    indices, pool_size = (input_ref(INDICES), count_ref(COUNT_POOL)) if pool else (cu, 0)
    n = count_ref(COUNT_N)
    # Token strides of contiguous inputs (the program takes no other): the packed heads.
    s_qk, s_v, s_gb = H * Kd, HV * Vd, HV
    outputs = [names.index("o")] + ([names.index("final_state")] if problem.output_final_state else [])
    program = module.CallProgram(specs, [], [Q, K, V, G, BETA], H0, outputs)

    def step(kernel, cfg, args, grid, rows_count, seqs_count):
        add_step(program, module, _site(kernel, args), args, {}, grid, rows_count, seqs_count,
                 (cfg.num_warps, cfg.num_stages))

    # The kernel forming T forms the gate cumsum into g_cum too (the forward's stage 1).
    if not fused_solve:
        cfg = intra_config(Kd, Kd, elem, capability)
        step(_kkt_solve_fwd_kernel, cfg, kkt_solve_launch_args(
            cfg, dtype, k, g, g_cum, beta, buf["A_inv"], cu, n, s_qk, s_gb, s_gb, H, HV, Kd, CHUNK_SIZE,
            use_qk_l2norm=l2), (1, False, 0, HV, 0), COUNT_SLOTS, -1)
    cfg = intra_config(Kd, Vd, elem, capability)
    step(_wu_fwd_kernel, cfg, wu_launch_args(
        cfg, dtype, k, v, g if fused_solve else None, g_cum, beta, g_cum if fused_solve else buf["A_inv"], buf["w"],
        buf["u"], k_rnorm, cu, n, s_qk, s_v, s_gb, s_gb, H, HV, Kd, Vd, CHUNK_SIZE, fused_solve=fused_solve,
        use_qk_l2norm=l2, store_rnorm=l2), (1, False, 0, HV, 0), COUNT_SLOTS, -1)
    final = buf.get("final_state")
    if segmented:
        _segment_steps(step, problem, capability, buf, k, beta, cu, h0, final, indices, pool_size, scan, s_qk, s_gb)
        # Pass 2: the segment slots as the sequences, from their start states, no final state.
        cu, n, seqs, h0, final, indices, pool_size = buf["seg_cu"], count_ref(COUNT_NSEG), COUNT_NSEG, \
            buf["seg_h0"], None, buf["seg_cu"], 0
    else:
        seqs = COUNT_N
    step(_state_fwd_kernel, state_cfg, state_launch_args(
        state_cfg, dtype, k, buf["w"], buf["u"], g_cum, k_rnorm, buf["h"], buf["v_new"], h0,
        g_cum if final is None else final, cu, indices, s_qk, pool_size, H, HV, Kd, Vd, CHUNK_SIZE,
        use_h0=segmented or problem.initial_state is not None, use_pool=pool and not segmented,
        inplace=pool and not segmented and problem.inplace_final_state, store_ht=final is not None,
        state_vk=problem.state_layout is StateLayout.VK and not segmented, use_qk_l2norm=l2, load_rnorm=l2),
        (0, False, 1, HV * -(-Vd // state_cfg.BV), 0), -1, seqs)
    cfg = output_config(Kd, Vd, elem, capability)
    # One program per (chunk slot, v-head): B * T // 64 + (sequences or segment slots).
    step(_output_fwd_kernel, cfg, output_launch_args(
        cfg, dtype, q, k, buf["v_new"], buf["h"], g_cum, k_rnorm, buf["o"], cu, n, SCALE, s_qk, s_qk, H, HV, Kd,
        Vd, CHUNK_SIZE, use_qk_l2norm=l2, load_rnorm=l2), (CHUNK_SIZE, False, 1, HV, 0, -(-Vd // cfg.BV)),
        COUNT_ROWS, seqs)
    return program, buf.get("final_state") is not None


def _segment_steps(step, problem: GDNProblem, capability, buf: dict, k, beta, cu, h0, final, indices, pool_size,
                   scan, s_k, s_b) -> None:
    """Pass 1 and the scan of a segmented program (:func:`build`): the forgetting starts
    (beta of token stride ``s_b``; written into the scan's start states, which the scan
    fills only after pass 1 has read them), pass 1 over the segment slots, the scan over
    the sequences from the call's initial state (or pool rows) to its final state; unused
    state pointers read the maps' N as the wrappers' stand-in."""
    H, Kd, HV, Vd, l2 = problem.H, problem.K, problem.HV, problem.V, problem.use_qk_l2norm
    n_map, f_start = buf["n_map"], buf["seg_h0"]
    cfg = segment_map_config(Kd, Vd)
    n, nseg, seg_len = count_ref(COUNT_N), count_ref(COUNT_NSEG), count_ref(COUNT_L)
    step(_forgetting_start_kernel, FORGETTING_CONFIG, forgetting_start_launch_args(
        buf["g_cum"], beta, k, cu, f_start, f_start, n, seg_len, s_b, s_k, H, HV, Kd, cfg.BK, use_qk_l2norm=l2),
        (0, False, HV, 1, 0), -1, COUNT_NSEG)
    step(_segment_map_fwd_kernel, cfg, segment_map_launch_args(
        cfg, problem.q.dtype, k, buf["w"], buf["u"], buf["g_cum"], buf.get("k_rnorm", buf["g_cum"]), f_start, cu,
        buf["seg_cu"], n, nseg, seg_len, buf["m_hi"], buf["m_lo"], n_map, s_k, H, HV, Kd, Vd, use_qk_l2norm=l2,
        load_rnorm=l2, capability=capability, forget=True),
        (0, False, HV * segment_map_blocks(Kd, Vd, cfg), 1, 0),
        -1, COUNT_NSEG)
    pool = problem.state_indices is not None
    step(_segment_scan_fwd_kernel, scan, segment_scan_launch_args(
        scan, buf["m_hi"], buf["m_lo"], n_map, cu, n_map if problem.initial_state is None else h0,
        n_map if final is None else final, buf["seg_h0"], indices, pool_size, count_ref(COUNT_L), HV, Kd, Vd,
        use_h0=problem.initial_state is not None, use_pool=pool, inplace=pool and problem.inplace_final_state,
        store_ht=final is not None, state_vk=problem.state_layout is StateLayout.VK),
        (0, False, HV * -(-Vd // scan.BV), 1, 0), -1, COUNT_N)
