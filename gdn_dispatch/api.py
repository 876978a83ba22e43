"""The public op: validate, select a backend, run it.

Eager calls validate (:func:`~gdn_dispatch.contract.make_problem`) and run
(:func:`~gdn_dispatch.op.run_problem`) directly, with no dispatcher in between; a recurring
call of the common form goes from the native checks straight to its call program
(:mod:`gdn_dispatch.routes`), which launches what that path would. Traced
calls (``torch.compile``, ``torch.export``, or any tensor subclass such as fake tensors)
go through the custom op ``torch.ops.gdn_dispatch.chunk_gated_delta_rule``
(:mod:`gdn_dispatch.op`), which runs the same two steps when the compiled program runs.
"""

from __future__ import annotations

import torch

from gdn_dispatch.contract import GDNInputError, StateLayout, checked_flag, checked_scale, make_problem
from gdn_dispatch.context_parallel import context_parallel_reason
from gdn_dispatch.forward_only import run_forward_only
from gdn_dispatch.op import (INPLACE_OP_NAME, chunk_gated_delta_rule_inplace_op, chunk_gated_delta_rule_op,
                             context_parallel_str, run_problem)
from gdn_dispatch.routes import routed_call

#: Keyword arguments that model code passes along to every ``chunk_gated_delta_rule`` it
#: calls (transformers' Qwen3.5 forwards ``use_cache`` and its ``TransformersKwargs``, as
#: it does to fla): accepted and ignored. Any other unknown keyword is an error.
CLIENT_PASSTHROUGH_KWARGS = frozenset({
    "use_cache", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids", "seq_idx",
    "is_causal", "num_items_in_batch", "output_attentions", "output_hidden_states", "output_router_logits",
})

_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
#: The state layout names, as plain strings: dynamo (torch 2.11) cannot iterate an Enum class.
_LAYOUT_NAMES = tuple(m.value for m in StateLayout)


def _check_client_kwargs(client_kwargs: dict) -> None:
    unknown = sorted(set(client_kwargs) - CLIENT_PASSTHROUGH_KWARGS)
    if unknown:
        raise GDNInputError(
            f"{unknown[0]}: not an argument of chunk_gated_delta_rule (accepted and ignored: "
            f"{sorted(CLIENT_PASSTHROUGH_KWARGS)})"
        )


def _is_traced(q) -> bool:
    """True under torch.compile / export, for a tensor subclass (fake, functional,
    proxied) or a meta tensor: those calls must be the custom op, whose fake
    implementation gives the output shapes without reading a value."""
    if torch.compiler.is_compiling():
        return True
    return isinstance(q, torch.Tensor) and (type(q) not in _PLAIN_TENSORS or q.is_meta)


def _flags(output_final_state, use_qk_l2norm_in_kernel, inplace_final_state) -> tuple[bool, bool, bool]:
    """The call's three boolean arguments, checked (:func:`gdn_dispatch.contract.checked_flag`)."""
    return (checked_flag("output_final_state", output_final_state),
            checked_flag("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
            checked_flag("inplace_final_state", inplace_final_state))


def _grad_inputs(*tensors) -> tuple:
    """The tensors among ``tensors`` that require grad (anything else is left to the contract)."""
    return tuple(t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | list[int] | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    state_layout: str | StateLayout | None = None,
    backend: str | None = None,
    *,
    state_v_first: bool | None = None,
    head_first: bool | None = None,
    state_indices: torch.Tensor | None = None,
    inplace_final_state: bool = False,
    context_parallel: str | int = "auto",
    **client_kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked prefill of a Gated Delta Network layer (chunk C = 64).

    Per sequence and v-head, in float32::

        S = S * exp(g_t);  u_t = beta_t * (v_t - S^T k_t);  S = S + k_t u_t^T;  o_t = scale * S^T q_t

    with S the ``K x V`` state, and q, k l2-normalized first when asked.

    Parameters
    ----------
    q, k : Tensor ``[B, T, H, K]``, bfloat16 or float16 (float32 where the backend allows).
    v : Tensor ``[B, T, HV, V]``, q's dtype. ``HV`` is a multiple of ``H``; v-head ``j``
        reads q/k head ``j // (HV // H)``.
    g : Tensor ``[B, T, HV]``, any float dtype: the log-space decay of each token.
    beta : Tensor ``[B, T, HV]``, any float dtype.
    scale : float, default ``K ** -0.5``.
    initial_state : Tensor ``[N, HV, K, V]`` (state_layout "kv") or ``[N, HV, V, K]``
        ("vk"), any float dtype, contiguous; None means zeros. With ``state_indices``: the
        state pool ``[P, HV, K, V]`` / ``[P, HV, V, K]``, float32 or bfloat16.
    output_final_state : bool, also return the state after the last token.
    cu_seqlens : int32/int64 Tensor ``[N + 1]`` on q's device, or a list of ints (the host
        copy): packed sequence offsets, starting at 0, non-decreasing, ending at ``T``;
        requires ``B == 1``. Without it, ``N = B`` sequences of ``T`` tokens.
    cu_seqlens_cpu : the same values as a CPU tensor, optional: with it the offsets are
        checked on the host; without it they are not read at all (the kernels map their
        chunks from ``cu_seqlens`` on the device), so the call never waits for the device
        either way.
    use_qk_l2norm_in_kernel : bool, l2-normalize q and k over ``K`` (eps 1e-6).
    state_layout : "kv" (default) or "vk"; fla's ``state_v_first=True`` means "vk".
    backend : str, force one backend for this call (see ``python -m gdn_dispatch info``);
        wins over ``GDN_BACKEND``. A forced backend that cannot run the call raises.
    head_first : not supported; passing True raises with the fix.
    state_indices : int32/int64 Tensor ``[N]``: sequence ``n`` starts from
        ``initial_state[state_indices[n]]``; -1 starts from zeros.
    inplace_final_state : bool, with ``state_indices``: final states are written back into
        the pool rows.
    context_parallel : "auto" (default), "off", or int ``n >= 1``: cut long sequences into
        segments processed in parallel, stitched by an exact float32 scan of each segment's
        affine map of the state (:mod:`gdn_dispatch.context_parallel`). "auto" decides from
        the sequences, heads and the device's SM count; ``n`` forces segments sized so
        that the longest sequence spans ``n`` (``T`` stands for it when ``cu_seqlens`` has
        no host copy). Results agree with "off" to float32 rounding.
    **client_kwargs : only the names in ``CLIENT_PASSTHROUGH_KWARGS`` (what transformers
        passes along, e.g. ``use_cache``), ignored; any other name raises.

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

    Notes
    -----
    Under ``torch.compile`` (fullgraph, dynamic ``T``) the call is the custom op
    ``torch.ops.gdn_dispatch.chunk_gated_delta_rule`` (``..._inplace`` with
    ``inplace_final_state``); tensor checks then run when the compiled program runs. So
    is a call on meta tensors: it returns the outputs' shapes and dtypes.

    Gradients: only the reference backend, called eagerly, has a backward. The kernel
    backends and the custom op are forward-only: when grad mode is on and an input
    requires grad, their outputs carry a grad_fn whose backward raises RuntimeError
    saying so (run under ``torch.no_grad()`` / ``torch.inference_mode()``, or pass
    ``backend="reference"`` / ``GDN_BACKEND=reference`` for gradients).
    """
    if client_kwargs:
        _check_client_kwargs(client_kwargs)
    if _is_traced(q):
        return _traced_call(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                            cu_seqlens_cpu, use_qk_l2norm_in_kernel, state_layout, backend,
                            state_v_first, head_first, state_indices, inplace_final_state, context_parallel)
    if not (type(output_final_state) is bool and type(use_qk_l2norm_in_kernel) is bool
            and type(inplace_final_state) is bool):
        output_final_state, use_qk_l2norm_in_kernel, inplace_final_state = _flags(
            output_final_state, use_qk_l2norm_in_kernel, inplace_final_state)
    grad_inputs = _grad_inputs(q, k, v, g, beta, initial_state) if torch.is_grad_enabled() else ()
    if not grad_inputs and not head_first and state_v_first is None:
        # A recurring common form goes from the native checks to its call program (routes).
        done = routed_call(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                           use_qk_l2norm_in_kernel, state_layout, backend, context_parallel, state_indices,
                           inplace_final_state)
        if done is not None:
            return done
    problem = make_problem(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_layout=state_layout, backend=backend,
        state_v_first=state_v_first, head_first=head_first,
        state_indices=state_indices, inplace_final_state=inplace_final_state,
        context_parallel=context_parallel,
    )
    return run_problem(problem, grad_inputs)


def _layout_name(state_layout, state_v_first) -> str:
    """contract's layout rules in plain string comparisons (dynamo cannot trace an enum
    lookup that fails), with its messages."""
    if state_layout is None:
        return "vk" if state_v_first else "kv"
    name = state_layout.value if isinstance(state_layout, StateLayout) else str(state_layout).lower()
    choices = list(_LAYOUT_NAMES)
    if name not in choices:
        raise GDNInputError(f"state_layout: expected one of {choices}, got {state_layout!r}")
    if state_v_first is not None and bool(state_v_first) != (name == "vk"):
        raise GDNInputError(f"state_v_first: {state_v_first} contradicts state_layout={name!r}; pass one of them")
    return name


def _traced_call(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                 use_qk_l2norm_in_kernel, state_layout, backend, state_v_first, head_first, state_indices,
                 inplace_final_state, context_parallel):
    """The call as the custom op: the arguments the op schema cannot carry (layout aliases,
    ``head_first``, a host list of offsets) are resolved here, with the eager messages."""
    if head_first:
        make_problem(q, k, v, g, beta, head_first=head_first)  # raises the contract's message
    output_final_state, use_qk_l2norm_in_kernel, inplace_final_state = _flags(
        output_final_state, use_qk_l2norm_in_kernel, inplace_final_state)
    layout = _layout_name(state_layout, state_v_first)
    if scale is not None:
        scale = checked_scale(scale)
    cp_reason = context_parallel_reason(context_parallel)
    if cp_reason is not None:
        raise GDNInputError(f"context_parallel: {cp_reason}")
    if inplace_final_state and state_indices is None:  # the op's pool argument is required
        raise GDNInputError("inplace_final_state: needs state_indices (the pool rows to write back)")
    if state_indices is not None and initial_state is None:
        dims = "[P, HV, K, V]" if layout == "kv" else "[P, HV, V, K]"
        raise GDNInputError(f"state_indices: needs initial_state to be the state pool {dims}")
    if isinstance(cu_seqlens, (list, tuple)):
        if cu_seqlens_cpu is not None:
            raise GDNInputError("cu_seqlens_cpu: not needed when cu_seqlens is a list (the list is the host copy); "
                                "pass one of them")
        # int32, as the eager contract makes a list of offsets that fit it (the kernels warm-up
        # compiles); a traced call's T never reaches 2^31 tokens.
        cu_seqlens_cpu = torch.tensor(list(cu_seqlens), dtype=torch.int32)
        cu_seqlens = cu_seqlens_cpu.to(q.device)
    args = (q, k, v, g, beta, scale, initial_state, output_final_state,
            cu_seqlens, cu_seqlens_cpu, use_qk_l2norm_in_kernel, layout, backend, state_indices,
            context_parallel_str(context_parallel))
    grad_inputs = _grad_inputs(q, k, v, g, beta, initial_state) if torch.is_grad_enabled() else ()
    if inplace_final_state and grad_inputs:
        # torch.library registers no backward for an op that mutates an argument: the call
        # becomes a node of its own whose backward refuses, as the functional op's does.
        o, final_state = run_forward_only(f"custom op {INPLACE_OP_NAME} (the torch.compile path)",
                                          lambda: chunk_gated_delta_rule_inplace_op(*args), grad_inputs)
    else:
        op = chunk_gated_delta_rule_inplace_op if inplace_final_state else chunk_gated_delta_rule_op
        o, final_state = op(*args)
    return o, (final_state if output_final_state else None)
