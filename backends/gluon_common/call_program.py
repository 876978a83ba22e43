"""A common call's allocations and launches in one C++ call: the native layer's CallProgram.

The forward's Python host path, past the contract and the plan, spends most of its time in
the stage wrappers (shapes, stand-in pointers, the argument dicts), in
:func:`.launch.launch_planned`'s checks and in one tensor allocation per buffer. A call
program does the same for the call forms servers send on every layer of every step: no
state pool, no context parallelism, contiguous inputs the TMA unit reads in place, an
initial state (if any) in float32 or bfloat16:

    program = cls.programs[launch sequence, initial state given]     # built at first use
    buffers = program(inputs, sizes, counts, scale, device, stream)  # or None

Each launch's argument lists are the stage's own (``wy_launch_args``,
``state_output_launch_args``, ...: the functions the Python wrappers launch with), called
once with :class:`Ref` placeholders where the call's values go; the program binds them to
the call's inputs, its buffers (allocated in the same C++ call), its counts and its scale.
Every launch goes through the GuardedLauncher of the kernel its plan launched last, and
every launch's checks pass before the first one is made: a call any of them refuses (a
new specialization, a plan's first call) launches nothing, and the Python path runs it.
``tests/test_call_program.py`` checks that both paths hand the launcher the same
arguments over a fuzz of call forms.

Nothing here is used where the native layer is not built or is off
(``GDN_DISPATCH_NATIVE=0``), where the launches go through Triton's binder (a launch hook,
``GDN_DISPATCH_JIT_LAUNCH=1``), or for any other call form.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gdn_dispatch import native
from gdn_dispatch.contract import GDNProblem
from gdn_dispatch.envvars import getenv

from gdn_dispatch.backends.gluon_common import launch as L
from gdn_dispatch.backends.gluon_common.buffers import buffer_specs
from gdn_dispatch.backends.gluon_common.plan import NORM_KERNELS, ForwardPlan
from gdn_dispatch.backends.gluon_common.qk_norm import norm_launch_args
from gdn_dispatch.backends.gluon_common.state_output import state_output_launch_args
from gdn_dispatch.backends.gluon_common.wy import wy_launch_args
from gdn_dispatch.backends.gluon_common.wy_t import planned_t_tile_rows, wy_t_launch_args

#: The call's inputs as a program indexes them.
INPUTS = ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state")
_Q, _K, _V, _G, _BETA, _CU, _H0 = range(len(INPUTS))
#: The call's counts: N, token rows B * T, (token, head) rows B * T * H.
COUNT_N, COUNT_ROWS, COUNT_HEAD_ROWS = range(3)


class Ref(NamedTuple):
    """Where a launch argument's value comes from in a call (a native ``SOURCE_*`` kind):
    input ``index`` (:data:`INPUTS`), buffer ``index``, count ``index``, the scale, or
    entry ``item`` of buffer ``index``'s first dim."""

    source: str
    index: int = 0
    item: int = -1


def run_call(problem: GDNProblem, launches: ForwardPlan, engine) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Run ``problem`` (validated, not segmented) through its call program: (o, final
    state or None) as :func:`.forward.forward` returns them, or None (nothing launched)
    where the program does not take the call."""
    module = native.for_calls()
    if module is None or problem.state_indices is not None:
        return None
    runtime = L._runtime()
    if not runtime.direct or getenv(L.JIT_LAUNCH_ENV) == "1" or runtime.hooks_set():
        return None
    B, T, N, HV = problem.B, problem.T, problem.chunks.num_seqs, problem.HV
    rows = B * T
    if rows == 0 or N * HV == 0:
        return None  # the wrappers' own early answers (no launch, or the initial state copied)
    h0 = problem.initial_state
    key = (*map(id, launches.launches), h0 is None)
    program = launches.cls.programs.get(key)
    if program is None:
        program = launches.cls.programs[key] = build(problem, launches, engine, module)
    call, outputs = program
    t_rows = planned_t_tile_rows(launches.stage("wy_t_fwd").shared, rows, N) if launches.fused else 0
    device = runtime.current_device()
    buffers = call((problem.q, problem.k, problem.v, problem.g, problem.beta, problem.chunks.cu_seqlens, h0),
                   (B, T, N, t_rows, 0, rows), (N, rows, rows * problem.H), float(problem.scale), device,
                   runtime.stream(device))
    if buffers is None:
        return None
    o, final_state = outputs
    return buffers[o], None if final_state is None else buffers[final_state]


def build(problem: GDNProblem, launches: ForwardPlan, engine, module):
    """The call program of ``launches`` for calls of ``problem``'s form: (the native
    CallProgram, (index of o, index of the final state or None) in its buffers)."""
    H, K, HV = problem.H, problem.K, problem.HV
    specs = buffer_specs(problem, ("fused",) if launches.fused else ("pipeline",))
    final = len(specs) - 1 if problem.output_final_state else None
    q, k, v, g, beta, cu = (Ref("input", i) for i in (_Q, _K, _V, _G, _BETA, _CU))
    n, head_rows, scale = Ref("count", COUNT_N), Ref("count", COUNT_HEAD_ROWS), Ref("scale")
    row_stride = H * K  # q's and k's token stride: the program takes contiguous inputs only
    steps = []
    if launches.fused:
        o, g_cum, t_tiles = Ref("buffer", 0), Ref("buffer", 1), Ref("buffer", 2)
        if launches.norm_copies:
            specs.append(((2, -1, -2, H, K), None))  # qk_l2norm_fwd's [2, B, T, H, K]
            norm = launches.stage("qk_l2norm_fwd").shared
            steps.append((norm, norm_launch_args(norm, q, k, Ref("buffer", len(specs) - 1), head_rows, H,
                                                 row_stride, row_stride)))
            q, k = Ref("item", len(specs) - 1, 0), Ref("item", len(specs) - 1, 1)
        wy_t = launches.stage("wy_t_fwd").shared
        steps.append((wy_t, wy_t_launch_args(wy_t, k, t_tiles, g, g_cum, beta, cu, n, HV, HV)))
        fused = launches.stage("fused_fwd").shared
        h0 = Ref("input", _H0) if problem.initial_state is not None else g_cum
        ht = g_cum if final is None else Ref("buffer", final)
        steps.append((fused, engine.fused.fused_launch_args(fused, q, k, v, t_tiles, o, g_cum, h0, ht, cu, cu, scale,
                                                            0)))
        outputs = (0, final)
    else:
        w, u, g_cum, o = (Ref("buffer", i) for i in range(4))
        wy = launches.stage("wy_fwd").shared
        steps.append((wy, wy_launch_args(wy, k, v, w, u, g, g_cum, beta, cu, n, HV, HV)))
        rnorm = g_cum  # not read without the qk l2 norm
        if problem.use_qk_l2norm:
            specs.append(((-6, H, 2), torch.float32))  # qk_rnorm_fwd's [B * T, H, 2]
            rnorm = Ref("buffer", len(specs) - 1)
            norm = launches.stage("qk_rnorm_fwd").shared
            steps.append((norm, norm_launch_args(norm, q, k, rnorm, head_rows, H, row_stride, row_stride)))
        so = launches.stage("state_output_fwd").shared
        h0 = Ref("input", _H0) if problem.initial_state is not None else g_cum
        ht = g_cum if final is None else Ref("buffer", final)
        steps.append((so, state_output_launch_args(so, q, k, w, u, o, g_cum, rnorm, h0, ht, cu, cu, scale, 0)))
        outputs = (3, final)
    program = module.CallProgram(specs, [_Q, _K, _V], [_G, _BETA], _H0)
    for launch, (tensors, args) in steps:
        rule = launch.grid_rule
        more = (*rule.more, 1, 1)[:2]
        norm = launch.kernel in NORM_KERNELS
        program.add_step(launch.compiled, _bound(module, args), _bound(module, tensors),
                         (rule.row_block, rule.ceil, rule.per_seq, rule.times, rule.minimum, *more),
                         COUNT_HEAD_ROWS if norm else COUNT_ROWS, -1 if norm else COUNT_N)
    return program, outputs


def _bound(module, values: dict) -> list[tuple]:
    """``values`` (argument name -> Ref or constant) as the native program's bindings."""
    kinds = {"input": module.SOURCE_INPUT, "buffer": module.SOURCE_BUFFER, "count": module.SOURCE_COUNT,
             "scale": module.SOURCE_SCALE, "item": module.SOURCE_ITEM}
    out = []
    for name, value in values.items():
        if isinstance(value, Ref):
            out.append((name, kinds[value.source], value.index, value.item))
        else:
            out.append((name, module.SOURCE_CONSTANT, 0, value))
    return out
