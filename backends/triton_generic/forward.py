"""The orchestrator: the five stages in order, for one validated call.

    g_cum, w, u  = wu_fwd(k, v, g, beta)                  # stages 1 + 2 + 3 fused: the gate
                                                          # cumsum and T in registers
                                                          # (or kkt_solve_fwd forms g_cum and T,
                                                          # then wu_fwd)
    h, v_new, S  = state_fwd(k, w, u, g_cum, S0)          # stage 4
    o            = output_fwd(q, k, v_new, h, g_cum)      # stage 5

Tensors ``[B, T, ...]`` lie as the packed ``[B * T, ...]`` token axis whose chunk slots
(:mod:`gdn_dispatch.varlen`) the per-chunk kernels launch over; a uniform batch and a varlen
batch take the same path. Nothing here reads a device value back to the host. A
call of the common forms (segmented or not), once its kernels are kept, runs its
allocations and launches as one native call program with the same arguments
(:mod:`.call_program`).
"""

from __future__ import annotations

import torch

from gdn_dispatch.context_parallel import plan_for_problem
from gdn_dispatch.contract import GDNProblem, StateLayout

from gdn_dispatch.backends.triton_generic._jit import interpreting
from gdn_dispatch.backends.triton_generic.buffers import call_buffers
from gdn_dispatch.backends.triton_generic.call_program import route_runner as _route_runner
from gdn_dispatch.backends.triton_generic.call_program import UNPICKED, run_call, run_segmented_call
from gdn_dispatch.backends.triton_generic.configs import device_facts, fuse_solve_into_wu
from gdn_dispatch.backends.triton_generic.context_parallel import chained_fwd, segmented_fwd
from gdn_dispatch.backends.triton_generic.kkt_solve import kkt_solve_fwd
from gdn_dispatch.backends.triton_generic.output import output_fwd
from gdn_dispatch.backends.triton_generic.state import state_fwd
from gdn_dispatch.backends.triton_generic.wu import wu_fwd


def forward(problem: GDNProblem, selection=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``chunk_gated_delta_rule`` for ``problem``.

    ``selection`` (the registry's :class:`~gdn_dispatch.registry.Selection`) gives the SM
    count that ``context_parallel="auto"`` and the state kernel's tile choice decide from
    (without one: the tensors' device's); the kernels run on the tensors' device. With context parallelism planned,
    stages 4 and 5 run over segments (:mod:`.context_parallel`).

    Returns
    -------
    o : Tensor ``[B, T, HV, V]`` in q's dtype.
    final_state : float32 Tensor ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk"), or
        None unless ``problem.output_final_state``.
    """
    if problem.device.type == "cuda" and problem.device.index != torch.cuda.current_device():
        # Triton launches on the current device: make it the tensors' one for this call
        # (restored on exit, so the caller's current device is left as it was).
        with torch.cuda.device(problem.device):
            return _forward(problem, selection)
    return _forward(problem, selection)


def _forward(problem: GDNProblem, selection) -> tuple[torch.Tensor, torch.Tensor | None]:
    chunks, l2 = problem.chunks, problem.use_qk_l2norm
    sm_count = selection.device.sm_count if selection is not None else device_facts(problem.device)[1]
    plan = plan_for_problem(problem, sm_count).unpicked(UNPICKED)
    # The common forms in one native call, where the layer is built (None: not taken).
    # (Chained segments have no call program yet: the launches below run them.)
    if plan.chained:
        done = None
    else:
        done = run_segmented_call(problem, plan, sm_count) if plan.enabled else run_call(problem, sm_count)
    if done is not None:
        return done
    # g_cum, 1/||k|| per token (formed once by the w/u kernel and read by the later stages,
    # with the qk l2 norm), w, u, [pass 1's and the scan's buffers,] h, v_new, o and the
    # final state.
    g_cum, k_rnorm, w, u, *stages = call_buffers(problem, plan)
    # The kernel that forms T forms the gate cumsum into g_cum too (stage 1, no launch of its own).
    A_inv = None
    if not fuse_solve_into_wu(device_facts(problem.device)[0]):
        A_inv = kkt_solve_fwd(problem.k, g_cum, problem.beta, chunks, g=problem.g, use_qk_l2norm=l2)
    w, u = wu_fwd(problem.k, problem.v, g_cum, problem.beta, chunks, A_inv=A_inv,
                  g=problem.g if A_inv is None else None, use_qk_l2norm=l2, k_rnorm=k_rnorm, out=(w, u))
    if plan.enabled:
        stitched = chained_fwd if plan.chained else segmented_fwd
        return stitched(problem, plan, g_cum, w, u, k_rnorm, sm_count, out=stages)
    h, v_new, o, final_state = stages
    h, v_new, final_state = state_fwd(
        problem.k, w, u, g_cum, chunks,
        initial_state=problem.initial_state,
        output_final_state=problem.output_final_state,
        state_vk=problem.state_layout is StateLayout.VK,
        use_qk_l2norm=l2,
        k_rnorm=k_rnorm,
        state_indices=problem.state_indices,
        inplace_final_state=problem.inplace_final_state,
        sm_count=sm_count,
        out=(h, v_new, final_state),
    )
    o = output_fwd(problem.q, problem.k, v_new, h, g_cum, chunks, scale=problem.scale, use_qk_l2norm=l2,
                   k_rnorm=k_rnorm, out=o)
    return o, final_state


def route_runner(problem: GDNProblem, selection):
    """The runner :mod:`gdn_dispatch.routes` keeps for calls of ``problem``'s form, or None
    (:func:`.call_program.route_runner`)."""
    return _route_runner(problem, selection.device)


def unsupported_reason(problem: GDNProblem) -> str | None:
    """What registry.toml cannot express: CPU tensors run only under the interpreter."""
    if problem.device.type == "cpu" and not interpreting():
        return "CPU tensors need TRITON_INTERPRET=1 (triton's interpreter)"
    if problem.device.type not in ("cpu", "cuda"):
        return f"needs CUDA tensors, got device {problem.device}"
    return None
