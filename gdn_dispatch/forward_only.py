"""Gradients: the reference backend has them, the kernel backends and the custom ops do not.

The reference backend is made of differentiable torch ops, so an eager call on it
backpropagates. The kernel backends compute the forward pass only. A call whose inputs
require grad under grad mode still runs on them, and its outputs carry a grad_fn whose
backward raises :func:`forward_only_message`; without it they would come back with no
history and cut the caller's graph without a word. The custom ops
(:mod:`gdn_dispatch.op`) refuse backward the same way.

The refusal is itself a custom op, :func:`refuse_backward`, whose fake implementation
returns the gradient's shape: a traced backward graph holds it and raises only when that
backward runs, so a compiled forward-only program whose parameters require grad compiles
and runs.

This module has no ``from __future__ import annotations``: ``torch.library.custom_op``
reads the schema from the annotations.
"""

import torch

#: Backends made of differentiable torch ops; every other backend is forward-only.
DIFFERENTIABLE_BACKENDS = frozenset({"reference"})
REFUSE_OP_NAME = "gdn_dispatch::refuse_backward"


def forward_only_message(what: str) -> str:
    """Why backward cannot run through ``what`` ("triton_generic backend", ...), and the fix."""
    return (f"gdn_dispatch's {what} is forward-only: chunk_gated_delta_rule computes no gradients there. "
            f"Run the forward under torch.no_grad() or torch.inference_mode(), or, for gradients, call "
            f"chunk_gated_delta_rule eagerly on the reference backend (backend='reference' or "
            f"GDN_BACKEND=reference)")


@torch.library.custom_op(REFUSE_OP_NAME, mutates_args=())
def refuse_backward(grad: torch.Tensor, shape: list[int], dtype: torch.dtype, message: str) -> torch.Tensor:
    """The gradient ``[*shape]`` of an input of a forward-only computation: raises
    RuntimeError(``message``) when it runs."""
    raise RuntimeError(message)


@refuse_backward.register_fake
def _refuse_backward_fake(grad, shape, dtype, message):
    return grad.new_empty(shape, dtype=dtype)


def refused_grads(grad: torch.Tensor, specs, message: str) -> tuple:
    """One :func:`refuse_backward` per ``(shape, dtype)`` of ``specs`` (None where no
    gradient is wanted): what a forward-only backward returns for its inputs."""
    return tuple(None if spec is None else refuse_backward(grad, list(spec[0]), spec[1], message) for spec in specs)


class _ForwardOnly(torch.autograd.Function):
    """Runs ``run()`` (a kernel backend's forward) as a node of the autograd graph whose
    inputs are the call's tensors that require grad; its backward refuses."""

    @staticmethod
    def forward(ctx, message, run, *inputs):
        ctx.message = message
        ctx.specs = tuple((t.shape, t.dtype) for t in inputs)
        o, final_state = run()
        return o, final_state

    @staticmethod
    def backward(ctx, grad_o, grad_final_state):
        return None, None, *refused_grads(grad_o, ctx.specs, ctx.message)


def run_forward_only(what: str, run, grad_inputs: tuple) -> tuple:
    """``run()``'s ``(o, final_state)`` as outputs of a node whose inputs are
    ``grad_inputs`` (the call's tensors that require grad, under grad mode) and whose
    backward raises :func:`forward_only_message` for ``what``."""
    return _ForwardOnly.apply(forward_only_message(what), run, *grad_inputs)
