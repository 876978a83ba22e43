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

Inputs are read where they lie: q, k, v in token rows through TMA descriptors with their
own row stride (views of a fused projection), g and beta through pointers with a token
stride. Only a q, k or v the TMA unit cannot address (a base or token stride off the
16-byte grid: :func:`~.launch_plan.tma_rows_reason`) is copied, once, as the contract
copies other layouts (counted in ``contract.INPUT_COPIES``). A state pool is read, and
written back, in place through ``state_indices``.
"""

from __future__ import annotations

import torch

import dataclasses

from gdn_dispatch.contract import GDNProblem, _counted_copy
from gdn_dispatch.device import DeviceInfo

from gdn_dispatch.backends.gluon_common.launch_plan import index_limits_reason, tma_rows_reason
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
    problem = tma_readable(problem)
    launches = plan(problem, device=device, engine=engine)
    chunks = problem.chunks
    w, u, g_cum = wy_fwd(problem.k, problem.v, problem.g, problem.beta, chunks, launches.stage("wy_fwd"))
    rnorm = qk_rnorm_fwd(problem.q, problem.k, launches.stage("qk_rnorm_fwd")) if problem.use_qk_l2norm else None
    o, final_state = state_output_fwd(
        problem.q, problem.k, w, u, g_cum, chunks, launches.stage("state_output_fwd"), scale=problem.scale,
        initial_state=problem.initial_state, output_final_state=problem.output_final_state, rnorm=rnorm,
        state_indices=problem.state_indices,
    )
    return o, final_state


def tma_readable(problem: GDNProblem) -> GDNProblem:
    """``problem`` with q, k and v as the TMA unit reads them: each one that it cannot
    read in place (:func:`~.launch_plan.tma_rows_reason`) replaced by one contiguous copy,
    counted in ``contract.INPUT_COPIES`` and logged like the contract's own copies."""
    moved = {name: _counted_copy(name, getattr(problem, name))
             for name in ("q", "k", "v") if tma_rows_reason(name, getattr(problem, name)) is not None}
    return dataclasses.replace(problem, **moved) if moved else problem


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
