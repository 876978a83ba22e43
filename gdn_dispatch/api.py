"""The public op: validate, select a backend, run it."""

from __future__ import annotations

import torch

from gdn_dispatch.contract import StateLayout, make_problem
from gdn_dispatch.device import default_probe
from gdn_dispatch.registry import select


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_layout: str | StateLayout | None = None,
    backend: str | None = None,
    *,
    state_v_first: bool | None = None,
    head_first: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked prefill of a Gated Delta Network layer (chunk C = 64).

    Per sequence and v-head, in float32::

        S = S * exp(g_t);  u_t = beta_t * (v_t - S^T k_t);  S = S + k_t u_t^T;  o_t = scale * S^T q_t

    with S the ``K x V`` state, and q, k l2-normalized first when asked.

    Parameters
    ----------
    q, k : Tensor ``[B, T, H, K]``, bfloat16 or float16 (float32 where the backend allows),
        contiguous.
    v : Tensor ``[B, T, HV, V]``, q's dtype, contiguous. ``HV`` is a multiple of ``H``;
        v-head ``j`` reads q/k head ``j // (HV // H)``.
    g : Tensor ``[B, T, HV]``, any float dtype: the log-space decay of each token.
    beta : Tensor ``[B, T, HV]``, any float dtype.
    scale : float, default ``K ** -0.5``.
    initial_state : Tensor ``[N, HV, K, V]`` (state_layout "kv") or ``[N, HV, V, K]``
        ("vk"), any float dtype, contiguous; None means zeros.
    output_final_state : bool, also return the state after the last token.
    cu_seqlens : int32/int64 Tensor ``[N + 1]`` on q's device: packed sequence offsets,
        starting at 0, non-decreasing, ending at ``T``; requires ``B == 1``. Without it,
        ``N = B`` sequences of ``T`` tokens.
    cu_seqlens_cpu : the same values as a CPU tensor; with it the call never waits for
        the device (without it, ``cu_seqlens`` is read back once).
    use_qk_l2norm_in_kernel : bool, l2-normalize q and k over ``K`` (eps 1e-6).
    state_layout : "kv" (default) or "vk"; fla's ``state_v_first=True`` means "vk".
    backend : str, force one backend for this call (see ``python -m gdn_dispatch info``);
        wins over ``GDN_BACKEND``. A forced backend that cannot run the call raises.
    head_first : not supported; passing True raises with the fix.

    Returns
    -------
    o : Tensor ``[B, T, HV, V]`` in q's dtype.
    final_state : float32 Tensor ``[N, HV, K, V]`` ("kv") or ``[N, HV, V, K]`` ("vk"), or
        None unless ``output_final_state``. A zero-length sequence's final state is its
        initial state.

    Raises
    ------
    GDNInputError (a ValueError) for input that breaks the contract; GDNDispatchError
    when no backend (or not the forced one) can run the call on this device.
    """
    problem = make_problem(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_layout=state_layout, backend=backend,
        state_v_first=state_v_first, head_first=head_first,
    )
    device = default_probe().for_torch_device(problem.device)
    return (selection := select(device, problem)).module.forward(problem, selection)
