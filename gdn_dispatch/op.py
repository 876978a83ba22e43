"""The torch.library custom ops behind ``chunk_gated_delta_rule``.

``torch.compile`` cannot trace into a backend (host-side chunk tables, Triton launches,
values read from ``cu_seqlens_cpu``), so a traced program sees the call as one opaque op
with a fake implementation that states the output shapes and dtypes exactly:

- ``gdn_dispatch::chunk_gated_delta_rule``: reads its inputs, returns ``(o, final_state)``;
- ``gdn_dispatch::chunk_gated_delta_rule_inplace``: the same, and writes the final states
  back into the state pool ``initial_state`` (``state_indices`` with
  ``inplace_final_state=True``); declared as mutating that one argument.

Ops cannot return None in every torch version, so a final state that was not asked for
comes back as an empty float32 tensor ``[0]``; :func:`gdn_dispatch.api.chunk_gated_delta_rule`
turns it back into None. Nothing in a fake implementation depends on tensor values, so a
symbolic ``T`` (and a symbolic number of sequences) traces once.

Both ops are forward-only: a backward through them raises, when it runs
(:mod:`gdn_dispatch.forward_only`), so a compiled forward whose inputs require grad still
compiles.

Every real call validates its arguments with :func:`gdn_dispatch.contract.make_problem`
(GDNInputError, as in eager mode) and runs :func:`run_problem`, the one place that selects
a backend and runs it.

This module has no ``from __future__ import annotations``: ``torch.library.custom_op``
reads the schema from the annotations, and torch 2.4 needs them as real types.
"""

from typing import Optional

import torch

from gdn_dispatch.contract import GDNProblem, make_problem
from gdn_dispatch.device import default_probe
from gdn_dispatch.forward_only import DIFFERENTIABLE_BACKENDS, forward_only_message, refused_grads, run_forward_only
from gdn_dispatch.registry import select

OP_NAME = "gdn_dispatch::chunk_gated_delta_rule"
INPLACE_OP_NAME = "gdn_dispatch::chunk_gated_delta_rule_inplace"


def run_problem(problem: GDNProblem, grad_inputs: tuple = ()) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Select the backend for a validated call and run it (eager path and op body alike).

    ``grad_inputs``: the call's tensors that require grad, under grad mode (eager calls
    only). A forward-only backend's outputs then carry a backward that raises
    (:mod:`gdn_dispatch.forward_only`); the reference backend's keep their gradients."""
    device = default_probe().for_torch_device(problem.device)
    selection = select(device, problem)
    if grad_inputs and selection.spec.name not in DIFFERENTIABLE_BACKENDS:
        return run_forward_only(f"{selection.spec.name} backend",
                                lambda: selection.module.forward(problem, selection), grad_inputs)
    return selection.module.forward(problem, selection)


def no_state(q: torch.Tensor) -> torch.Tensor:
    """The op's stand-in for "no final state": float32 ``[0]`` on q's device."""
    return torch.empty(0, dtype=torch.float32, device=q.device)


def _fresh(out: torch.Tensor, inputs: tuple) -> torch.Tensor:
    # An op's output may not share memory with an input (torch.library's rule); a backend
    # is free to hand an input back (e.g. a state no token touched), so copy it then.
    ptr = out.untyped_storage().data_ptr()
    if out.numel() and any(isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() == ptr
                           for t in inputs):
        return out.clone()
    return out


def context_parallel_arg(value: str) -> "str | int":
    """The op's string ``context_parallel`` ("auto", "off" or a decimal segment count, as
    :func:`context_parallel_str` writes it) as the contract's value."""
    return int(value) if value.isdigit() else value


def context_parallel_str(value) -> str:
    """The contract's ``context_parallel`` ("auto", "off" or an int) as the op's string
    (the schema has no str-or-int type)."""
    return value if isinstance(value, str) else str(int(value))


def _call(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
          use_qk_l2norm_in_kernel, state_layout, backend, state_indices, inplace_final_state, context_parallel):
    problem = make_problem(
        q, k, v, g, beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_layout=state_layout, backend=backend,
        state_indices=state_indices, inplace_final_state=inplace_final_state,
        context_parallel=context_parallel_arg(context_parallel),
    )
    o, final_state = run_problem(problem)
    inputs = (q, k, v, g, beta, initial_state)
    o = _fresh(o, inputs)
    final_state = no_state(q) if final_state is None else _fresh(final_state, inputs)
    return o, final_state


def _fake(q, v, output_final_state, cu_seqlens, state_layout):
    B, T, _, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    o = q.new_empty((B, T, HV, V))
    if not output_final_state:
        return o, no_state(q)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    per_head = (K, V) if state_layout == "kv" else (V, K)
    return o, q.new_empty((N, HV, *per_head), dtype=torch.float32)


@torch.library.custom_op(OP_NAME, mutates_args=())
def chunk_gated_delta_rule_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float],
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    cu_seqlens: Optional[torch.Tensor],
    cu_seqlens_cpu: Optional[torch.Tensor],
    use_qk_l2norm_in_kernel: bool,
    state_layout: str,
    backend: Optional[str],
    state_indices: Optional[torch.Tensor],
    context_parallel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, final_state)`` of :func:`gdn_dispatch.api.chunk_gated_delta_rule`; final_state
    is float32 ``[0]`` unless ``output_final_state``. ``state_layout``: "kv" or "vk";
    ``context_parallel``: "auto", "off" or a decimal segment count."""
    return _call(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                 use_qk_l2norm_in_kernel, state_layout, backend, state_indices, False, context_parallel)


@chunk_gated_delta_rule_op.register_fake
def _chunk_gated_delta_rule_fake(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                 cu_seqlens_cpu, use_qk_l2norm_in_kernel, state_layout, backend, state_indices,
                                 context_parallel="auto"):
    return _fake(q, v, output_final_state, cu_seqlens, state_layout)


#: Positions of the op's floating-point tensor arguments (q, k, v, g, beta, initial_state).
_DIFFERENTIABLE_ARGS = (0, 1, 2, 3, 4, 6)


def _setup_context(ctx, inputs, output):
    ctx.specs = tuple((t.shape, t.dtype) if i in _DIFFERENTIABLE_ARGS and isinstance(t, torch.Tensor) else None
                      for i, t in enumerate(inputs))


def _backward(ctx, grad_o, grad_final_state):
    specs = tuple(spec if wanted else None for spec, wanted in zip(ctx.specs, ctx.needs_input_grad))
    return refused_grads(grad_o, specs, forward_only_message(f"custom op {OP_NAME} (the torch.compile path)"))


# The op's body runs below autograd, where no backend records a graph (the reference
# included), so its backward refuses; it raises when it runs, not when AOTAutograd traces it.
chunk_gated_delta_rule_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op(INPLACE_OP_NAME, mutates_args=("initial_state",))
def chunk_gated_delta_rule_inplace_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float],
    initial_state: torch.Tensor,
    output_final_state: bool,
    cu_seqlens: Optional[torch.Tensor],
    cu_seqlens_cpu: Optional[torch.Tensor],
    use_qk_l2norm_in_kernel: bool,
    state_layout: str,
    backend: Optional[str],
    state_indices: torch.Tensor,
    context_parallel: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``chunk_gated_delta_rule``, with ``initial_state`` the state pool ``[P, HV, K, V]``
    / ``[P, HV, V, K]``: sequence ``n``'s final state is written to ``pool[state_indices[n]]``."""
    return _call(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                 use_qk_l2norm_in_kernel, state_layout, backend, state_indices, True, context_parallel)


@chunk_gated_delta_rule_inplace_op.register_fake
def _chunk_gated_delta_rule_inplace_fake(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                         cu_seqlens_cpu, use_qk_l2norm_in_kernel, state_layout, backend,
                                         state_indices, context_parallel="auto"):
    return _fake(q, v, output_final_state, cu_seqlens, state_layout)
