"""The orchestrator both Gluon backends share: two launches per call (three with the qk l2 norm).

    w, u, g_cum = wy_fwd(k, v, g, beta)                   # gate cumsum, k k^T, T = (I + A)^-1, w/u
    rnorm       = qk_rnorm_fwd(q, k)                      # qk l2 norm only: 1/||q||, 1/||k|| per row
    o, S        = state_output_fwd(q, k, w, u, g_cum, S0) # recurrence + output

The matrix engine (tcgen05 + TMEM on sm_100a, wgmma on sm_90a) follows the device's compute
capability; everything else is one code path. Neither T, the per-chunk state h nor v_new
reaches global memory. qk l2 norm: wy reduces k's rows itself; the fused kernel reads q's
and k's reciprocal row norms (8 bytes per token and head) and folds them into row and column
scales in registers (no normalized copy of q or k is written). Nothing here reads a device
value back to the host.

The split kernels these replaced (triton_generic's cumsum and stored-inverse
``kkt_solve_fwd`` with :mod:`.wu`, :mod:`.state` and :mod:`.output`) stay importable for the H200 scripts and
GPU tests that compare against them. On the H200 this pipeline takes 0.31-0.65x fla-core
0.6.0's time at the 10 bench shapes (``benchmarks/RESULTS.md``). Both launches go through
:func:`.launch.launch_planned` (Triton's binder only on a plan's first launch).
"""

from __future__ import annotations

import torch

from gdn_dispatch.contract import GDNProblem
from gdn_dispatch.device import DeviceInfo

from gdn_dispatch.backends.gluon_common.plan import index_limits_reason, plan, resolve_device
from gdn_dispatch.backends.gluon_common.qk_norm import qk_rnorm_fwd
from gdn_dispatch.backends.gluon_common.state_output import state_output_fwd
from gdn_dispatch.backends.gluon_common.wy import wy_fwd

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
    if problem.device.index != torch.cuda.current_device():
        # Triton launches on the current device: make it the tensors' one for this call.
        with torch.cuda.device(problem.device):
            return forward(problem, device=device)
    info = resolve_device(problem, None, device)
    launches = plan(problem, device=info)
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
