"""What the backends' call programs share: the call's values a launch argument is bound to.

A call program (the native layer's ``CallProgram``, :mod:`gdn_dispatch.native`) runs the
allocations and launches of a common call in one C++ call: each launch's argument list is
the stage's own (the function its Python wrapper launches with), called once with
:class:`Ref` placeholders where a call's values go, and bound to them at every call.
:mod:`.gluon_common.call_program` and :mod:`.triton_generic.call_program` build them.
"""

from __future__ import annotations

from collections import Counter
from typing import NamedTuple

from gdn_dispatch.context_parallel import plan_for_counts
from gdn_dispatch.contract import CHUNK_SIZE, GDNProblem
from gdn_dispatch.varlen import kept_uniform_offsets

#: The call's inputs as a program indexes them (:func:`call_inputs`; the initial state is
#: the state pool where ``state_indices`` is given, else None).
INPUTS = ("q", "k", "v", "g", "beta", "cu_seqlens", "initial_state", "state_indices")
Q, K, V, G, BETA, CU, H0, INDICES = range(len(INPUTS))
#: The call's counts as a program indexes them (:func:`call_counts`): N, the token rows
#: ``B * T``, the (token, head) rows ``B * T * H``, the chunk slots, the state pool's rows
#: (0 without a pool); a segmented call's also its segment slots ``NSEG`` and segment
#: length ``L`` (:func:`segmented_counts`).
COUNT_N, COUNT_ROWS, COUNT_HEAD_ROWS, COUNT_SLOTS, COUNT_POOL, COUNT_NSEG, COUNT_L = range(7)


#: How the programs answered the calls that consulted one: "taken" (the program launched
#: the call), "refused" (a launcher missing or another specialization: the Python path
#: ran it). Calls of other forms never consult a program and are not counted. ``bench
#: --host`` reads it.
PROGRAM_CALLS: Counter = Counter()


def counted(buffers):
    """``buffers`` (a program's answer) after counting it in :data:`PROGRAM_CALLS`."""
    PROGRAM_CALLS["refused" if buffers is None else "taken"] += 1
    return buffers


class Ref(NamedTuple):
    """Where a launch argument's value comes from in a call: ``source`` "input" (index
    into :data:`INPUTS`), "buffer" (index into the program's buffers), "count" (index into
    the counts), "scale" (the call's scale), or "item" (entry ``item`` of buffer ``index``'s
    first dim)."""

    source: str
    index: int = 0
    item: int = -1


def input_ref(index: int) -> Ref:
    return Ref("input", index)


def buffer_ref(index: int) -> Ref:
    return Ref("buffer", index)


def count_ref(index: int) -> Ref:
    return Ref("count", index)


SCALE = Ref("scale")


def call_inputs(problem: GDNProblem) -> tuple:
    """The call's inputs in :data:`INPUTS` order (the chunk table's offsets, which the
    kernels read)."""
    return (problem.q, problem.k, problem.v, problem.g, problem.beta, problem.chunks.cu_seqlens,
            problem.initial_state, problem.state_indices)


def pool_rows(initial_state, state_indices) -> int:
    """The state pool's rows (:data:`COUNT_POOL`): 0 without ``state_indices``."""
    return 0 if state_indices is None else initial_state.shape[0]


def call_counts(problem: GDNProblem) -> tuple[int, int, int, int, int]:
    """The call's counts in :data:`COUNT_N` ... :data:`COUNT_POOL` order."""
    B, T, H = problem.q.shape[:3]
    chunks = problem.chunks
    return (chunks.num_seqs, B * T, B * T * H, chunks.num_slots,
            pool_rows(problem.initial_state, problem.state_indices))


def segmented_counts(counts: tuple, cp) -> tuple:
    """``counts`` (:func:`call_counts`) of a call segmented by ``cp`` (an enabled
    :class:`~gdn_dispatch.context_parallel.CPPlan`), with :data:`COUNT_NSEG` and
    :data:`COUNT_L`."""
    return (*counts[:COUNT_NSEG], cp.num_segments, cp.seg_len)


def route_decisions(q, cu, B: int, T: int, N: int, HV: int, V: int, request, sm_count: int, longest: int | None):
    """What both backends' route runners decide alike from a call's counts: None where
    the forward would not run the call through a program (no token rows, no (sequence,
    v-head) pair, a uniform batch under CUDA-graph capture), else ``(offsets, cp)``: the
    offsets its kernels read (``cu``, or a uniform batch's kept ones) and the call's
    context-parallel plan."""
    if B * T == 0 or N * HV == 0:
        return None
    offsets = kept_uniform_offsets(B, T, CHUNK_SIZE, q.device) if cu is None else cu
    if offsets is None:
        return None
    return offsets, plan_for_counts(request, B, T, N, HV, V, sm_count, cu is None, longest)


def add_step(program, module, compiled: dict, args: dict, tensors: dict, grid: tuple, rows_count: int,
             seqs_count: int, options=None) -> None:
    """Add one launch to the native ``program``: the launch site's dict whose "fast" entry is
    its GuardedLauncher (``compiled``), its runtime arguments and descriptor tensors by name
    (values :class:`Ref` or constants), its grid rule ``(row_block, ceil, per_seq, times,
    minimum, *more)`` over counts ``rows_count`` and ``seqs_count`` (-1: none), and the
    launch options its launcher was made with."""
    more = (*grid[5:], 1, 1)[:2]
    program.add_step(compiled, bindings(module, args), bindings(module, tensors), (*grid[:5], *more), rows_count,
                     seqs_count, options)


def bindings(module, values: dict) -> list[tuple]:
    """``values`` (argument name -> :class:`Ref` or constant) as the native program's
    bindings ``(name, source kind, index, item or constant)``."""
    kinds = {"input": module.SOURCE_INPUT, "buffer": module.SOURCE_BUFFER, "count": module.SOURCE_COUNT,
             "scale": module.SOURCE_SCALE, "item": module.SOURCE_ITEM}
    out = []
    for name, value in values.items():
        if isinstance(value, Ref):
            out.append((name, kinds[value.source], value.index, value.item))
        else:
            out.append((name, module.SOURCE_CONSTANT, 0, value))
    return out
