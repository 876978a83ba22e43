"""Routes: the decisions of a recurring call form, kept, so that its next calls go from the
contract's native checks straight to the backend's call program.

A server sends the same few call forms on every layer of every step: the same dtypes,
heads, flags and forced backend, only the token and sequence counts change. The public
call's Python path (the contract's :class:`~gdn_dispatch.contract.GDNProblem`, the
registry's choice, the forward's plans) decides the same things for each of them; a route
keeps what it decided per form and makes the rest of the decisions, those that follow the
counts, from the counts alone::

    facts = native.admit(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, vk, state_indices)
    run = routes[form]            # made on the form's first call: contract, registry, backend
    run(q, k, v, g, beta, cu_seqlens, initial_state, state_indices, B, T, N, longest, scale, cu_seqlens_cpu)

The form (:func:`form_key`) holds everything the registry's choice and the backend's plans
read of a call but its counts: the device the probe reports, the dtypes, head counts and
dims, whether the batch is uniform, whether some sequence ends inside a chunk (the host
copy of the offsets tells; without one, assumed), the flags (a state pool and its
write-back among them), the forced backend, the
context-parallel request, and the environment the registry reads (``GDN_BACKEND``,
``TRITON_INTERPRET``, ``GDN_SELFTEST``). The runner is the chosen backend's
(``route_runner(problem, selection)``, where the module has one): it checks per call what
the forward checks (the current device, context parallelism, index limits) and runs the
call's program (:mod:`gdn_dispatch.backends.call_program`), segmented calls included. A
call it does not take (a program not built yet, another specialization) it returns None
for, launching nothing; the route then runs the Python path from the contract on with the
form's kept registry choice (:func:`gdn_dispatch.registry.confirm`: the backend's own
per-call check still asked), instead of choosing again. Every error is the Python path's: a call the
native admission refuses, with an int scale, a forced segment count,
``GDN_DEBUG_CHECKS=1`` or unknown keywords never reaches a route, and the contract raises
its own messages on the path above.

Routes are kept per process (at most :data:`ROUTES_KEPT` forms, emptied when full) and
forgotten with the plans (``clear_plan_cache``, triton_generic's ``clear_programs``).
``GDN_DISPATCH_ROUTES=0`` turns them off (read at every call).
"""

from __future__ import annotations

from collections import Counter

from gdn_dispatch import gate, native
from gdn_dispatch import op as _op
from gdn_dispatch.contract import CHUNK_SIZE, debug_checks_enabled, make_problem
from gdn_dispatch.envvars import getenv
from gdn_dispatch.registry import ENV_VAR, confirm, select

#: "0" turns routes off.
ROUTES_ENV = "GDN_DISPATCH_ROUTES"
ROUTES_KEPT = 256
_ROUTES: dict[tuple, object] = {}

#: How routed calls went: "taken" (the route's runner ran the call), "declined" (a form
#: with no runner, or a runner that did not take the call: the Python path ran it).
#: Calls that never reach a route (see the module docstring) are not counted.
ROUTE_CALLS: Counter = Counter()


def clear() -> None:
    """Forget every route (with the plans and programs they lead to)."""
    _ROUTES.clear()


def form_key(q, g, beta, initial_state, device, facts, uniform: bool, output_final_state, use_qk_l2norm, vk: bool,
             backend, context_parallel, pool: bool, inplace: bool) -> tuple:
    """What a route is kept by (see the module docstring): ``facts`` is the native
    admission's ``(B, T, H, K, HV, V, N, longest, aligned)``; ``pool``: ``initial_state``
    is a state pool read through ``state_indices``, ``inplace``: written back."""
    _, T, H, K, HV, V, _, _, aligned = facts
    tails = T % CHUNK_SIZE != 0 if uniform else aligned is not True
    return (device, q.dtype, g.dtype, beta.dtype, None if initial_state is None else initial_state.dtype, H, K, HV, V,
            uniform, tails, bool(output_final_state), bool(use_qk_l2norm), vk, backend, context_parallel,
            pool, inplace, getenv(ENV_VAR), getenv("TRITON_INTERPRET"), getenv(gate.ENV_VAR))


def routed_call(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                use_qk_l2norm_in_kernel, state_layout, backend, context_parallel, state_indices=None,
                inplace_final_state=False):
    """``(o, final state or None)`` of a call of the common form through its route (its
    program, or the Python path with the form's kept registry choice), or None where the
    call reaches no route (nothing launched: the caller runs the Python path). The caller
    passes calls with no ``head_first``, no ``state_v_first`` and no other keywords."""
    if scale is not None and type(scale) is not float:
        return None
    if inplace_final_state is not False and (inplace_final_state is not True or state_indices is None):
        return None
    if state_layout is not None and state_layout != "kv" and state_layout != "vk":
        return None
    if context_parallel != "auto" and context_parallel != "off":
        return None
    module = native.for_calls()
    if module is None or debug_checks_enabled() or getenv(ROUTES_ENV) == "0":
        return None
    vk = state_layout == "vk"
    facts = module.admit(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, vk, state_indices)
    if facts is None:
        return None
    device = _op.default_probe().for_torch_device(q.device)
    key = form_key(q, g, beta, initial_state, device, facts, cu_seqlens is None, output_final_state,
                   use_qk_l2norm_in_kernel, vk, backend, context_parallel, state_indices is not None,
                   inplace_final_state)
    route = _ROUTES.get(key)
    if route is None:
        route = _make_route(device, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                            cu_seqlens_cpu, use_qk_l2norm_in_kernel, state_layout, backend, context_parallel,
                            state_indices, inplace_final_state)
        if route is None:
            return None
        if len(_ROUTES) >= ROUTES_KEPT:
            _ROUTES.clear()
        _ROUTES[key] = route
    run, selection = route
    done = None
    if run is not False:
        B, T, _, K, _, _, N, longest, _ = facts
        done = run(q, k, v, g, beta, cu_seqlens, initial_state, state_indices, B, T, N, longest,
                   K ** -0.5 if scale is None else scale, cu_seqlens_cpu)
    if done is not None:
        ROUTE_CALLS["taken"] += 1
        return done
    ROUTE_CALLS["declined"] += 1
    # The form's registry choice still holds (its key is the route's): the Python path
    # from the contract on, without a second choice.
    problem = make_problem(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_layout=state_layout,
                           backend=backend, context_parallel=context_parallel, state_indices=state_indices,
                           inplace_final_state=inplace_final_state)
    selection = confirm(selection, device, problem)
    return selection.module.forward(problem, selection)


def _make_route(device, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                use_qk_l2norm_in_kernel, state_layout, backend, context_parallel, state_indices, inplace_final_state):
    """``(runner, selection)`` of this call's form (runner False: the chosen backend has
    none for it), or None where the contract or the registry does not take the call (the
    Python path then raises what it raises)."""
    try:
        problem = make_problem(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                               cu_seqlens_cpu=cu_seqlens_cpu, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                               state_layout=state_layout, backend=backend, context_parallel=context_parallel,
                               state_indices=state_indices, inplace_final_state=inplace_final_state)
        selection = select(device, problem)
    except Exception:  # the Python path raises the same, with the call's own traceback
        return None
    factory = getattr(selection.module, "route_runner", None)
    run = None if factory is None else factory(problem, selection)
    return (False if run is None else run), selection
