"""The orchestrator both Gluon backends share: the five stages in order, for one call.

    g_cum        = chunk_cumsum_fwd(g)                  # stage 1, triton_generic (log2 units)
    A_inv        = kkt_solve_fwd(k, g_cum, beta)        # stage 2, triton_generic
    w, u         = wu_fwd(k, v, g_cum, beta, A_inv)     # stage 3, Gluon (engine)
    h, v_new, S  = state_fwd(k, w, u, g_cum, S0)        # stage 4, Gluon (engine)
    o            = output_fwd(q, k, v_new, h, g_cum)    # stage 5, Gluon (engine)

The matrix engine (tcgen05 + TMEM on sm_100a, wgmma on sm_90a) follows the device's compute
capability; everything else is one code path. qk l2 norm: stage 2 normalizes k inside
kkt_solve, stages 3-5 fold the row norms of the raw q/k tiles into row scales in registers
(no normalized copy of q or k is written). Nothing here reads a device value back to the host.
"""

from __future__ import annotations

import math

import torch

from gdn_dispatch.contract import GDNProblem
from gdn_dispatch.device import DeviceInfo

from backends.gluon_common.output import output_fwd
from backends.gluon_common.plan import index_limits_reason, plan, resolve_device
from backends.gluon_common.state import state_fwd
from backends.gluon_common.wu import wu_fwd
from backends.triton_generic import chunk_cumsum_fwd, kkt_solve_fwd

LOG2E = math.log2(math.e)
#: Head dims the Gluon kernels are written for (whole-K / whole-V tiles, TMA boxes).
HEAD_DIMS = (64, 128)


def forward(problem: GDNProblem, *, device: DeviceInfo | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run ``chunk_gated_delta_rule`` for ``problem`` on the Gluon kernels.

    Parameters
    ----------
    problem : a validated call on a CUDA device of capability 9.0 or 10.x (see
        :func:`unsupported_reason`).
    device : DeviceInfo of the tensors' device; probed when None.

    Returns
    -------
    o : Tensor ``[B, T, HV, V]`` in q's dtype.
    final_state : float32 Tensor ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk"), or
        None unless ``problem.output_final_state``.
    """
    info = resolve_device(problem, None, device)
    launches = plan(problem, device=info)
    chunks, l2 = problem.chunks, problem.use_qk_l2norm
    g_cum = chunk_cumsum_fwd(problem.g, chunks, scale=LOG2E)
    A_inv = kkt_solve_fwd(problem.k, g_cum, problem.beta, chunks, use_qk_l2norm=l2)
    w, u = wu_fwd(problem.k, problem.v, g_cum, problem.beta, A_inv, chunks, launches.stage("wu_fwd"))
    h, v_new, final_state = state_fwd(
        problem.k, w, u, g_cum, chunks, launches.stage("state_fwd"),
        initial_state=problem.initial_state, output_final_state=problem.output_final_state,
    )
    o = output_fwd(problem.q, problem.k, v_new, h, g_cum, chunks, launches.stage("output_fwd"),
                   scale=problem.scale)
    return o, final_state


def unsupported_reason(problem: GDNProblem) -> str | None:
    """Why the Gluon kernels cannot run ``problem``, or None.

    registry.toml states dtypes, head dims and compute capabilities; this adds what it
    cannot express: CUDA tensors, 16-byte-aligned TMA bases, int32 TMA coordinates.
    """
    if problem.device.type != "cuda":
        return f"needs CUDA tensors, got device {problem.device}"
    if problem.dtype not in (torch.bfloat16, torch.float16):
        return f"needs bfloat16 or float16 q/k/v, got {problem.dtype}"
    for dim, size in (("K", problem.K), ("V", problem.V)):
        if size not in HEAD_DIMS:
            return f"needs {dim} in {set(HEAD_DIMS)}, got {size}"
    for name in ("q", "k", "v"):
        if getattr(problem, name).data_ptr() % 16:
            return f"TMA needs 16-byte-aligned tensors: {name}.data_ptr() % 16 != 0"
    return index_limits_reason(problem)
