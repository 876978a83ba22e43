"""The orchestrator both Gluon backends share: two launches per call (three with the qk l2 norm).

    w, u, g_cum = wy_fwd(k, v, g, beta)                   # gate cumsum, k k^T, T = (I + A)^-1, w/u
    rnorm       = qk_rnorm_fwd(q, k)                      # qk l2 norm only: 1/||q||, 1/||k|| per row
    o, S        = state_output_fwd(q, k, w, u, g_cum, S0) # recurrence + output

The launching backend hands down the device the registry chose and its matrix engine
(tcgen05 + TMEM for gluon_sm100, wgmma for gluon_sm90); everything else is one code path.
Neither T, the per-chunk state h nor v_new reaches global memory. qk l2 norm: wy reduces
k's rows itself; the fused kernel reads q's and k's reciprocal row norms (8 bytes per token
and head) and folds them into row and column scales in registers (no normalized copy of q
or k is written). Nothing here reads a device value back to the host. Every launch goes
through :func:`.launch.launch_planned` (Triton's binder only on a plan's first launch).
"""

from __future__ import annotations

import torch

from gdn_dispatch.contract import GDNProblem
from gdn_dispatch.device import DeviceInfo

from gdn_dispatch.backends.gluon_common.launch_plan import index_limits_reason
from gdn_dispatch.backends.gluon_common.plan import plan
from gdn_dispatch.backends.gluon_common.qk_norm import qk_rnorm_fwd
from gdn_dispatch.backends.gluon_common.state_output import state_output_fwd
from gdn_dispatch.backends.gluon_common.wy import wy_fwd


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
        None unless ``problem.output_final_state``.
    """
    if problem.device.index != torch.cuda.current_device():
        # Triton launches on the current device: make it the tensors' one for this call.
        with torch.cuda.device(problem.device):
            return forward(problem, device, engine=engine)
    # The kernels read contiguous [B*T, heads, dim] rows: views with a token stride of
    # their own are copied once here (counted in contract.INPUT_COPIES).
    problem = problem.with_contiguous_inputs()
    launches = plan(problem, device=device, engine=engine)
    chunks = problem.chunks
    w, u, g_cum = wy_fwd(problem.k, problem.v, problem.g, problem.beta, chunks, launches.stage("wy_fwd"))
    rnorm = qk_rnorm_fwd(problem.q, problem.k, launches.stage("qk_rnorm_fwd")) if problem.use_qk_l2norm else None
    o, final_state = state_output_fwd(
        problem.q, problem.k, w, u, g_cum, chunks, launches.stage("state_output_fwd"), scale=problem.scale,
        initial_state=problem.initial_state, output_final_state=problem.output_final_state, rnorm=rnorm,
    )
    return o, final_state


def unsupported_reason(problem: GDNProblem) -> str | None:
    """Why the Gluon kernels cannot run ``problem``, or None.

    registry.toml states dtypes, head dims and compute capabilities (the registry checks
    them before it asks here); this adds what it cannot express: CUDA tensors,
    16-byte-aligned TMA bases, int32 TMA coordinates.
    """
    if problem.device.type != "cuda":
        return f"needs CUDA tensors, got device {problem.device}"
    for name in ("q", "k", "v"):
        if getattr(problem, name).data_ptr() % 16:
            return f"TMA needs 16-byte-aligned tensors: {name}.data_ptr() % 16 != 0"
    return index_limits_reason(problem)
