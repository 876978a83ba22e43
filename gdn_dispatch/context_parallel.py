"""Context parallelism: whether a call cuts its long sequences into segments, and how long.

The chunk-state recurrence is serial in chunks: one program per (sequence, v-head, V block)
walks every chunk of its sequence. A call with few sequences and heads (a tensor-parallel
shard of a long prompt) leaves most SMs idle. Per sequence and v-head the recurrence is
affine in the state, so a segment of tokens maps a start state ``S`` to ``M S + N``
(``M`` ``[K, K]``, ``N`` ``[K, V]``, float32). Segments are mapped in parallel, an exact
serial scan over each sequence's segments gives every segment's start state, and the
normal forward then runs over the segments as if they were sequences.

Segments are cut at multiples of ``L`` tokens inside each sequence (``L`` a multiple of the
chunk, so chunk boundaries do not move). Sequence ``n`` of a call with offsets ``cu``
owns the *segment slots* ``[cu[n] // L + n, cu[n + 1] // L + n + 1)``; its segment ``j``
is slot ``cu[n] // L + n + j`` and the remaining slots of its range are empty segments.
The slot count ``NSEG = T_total // L + N`` is known on the host without reading
``cu_seqlens``. This module is the planner: pure host arithmetic, no tensors.

The automatic rule, with the constants of :class:`CPTuning` (fitted to CUDA-graph GPU times
of the Gluon forward on an H200, 132 SMs, bf16, K = V = 128: 1-8 sequences of 1024-65536
tokens on 4-32 v-heads, forced counts of 2 to 64 segments against "off", under gates that
forget within a chunk, within a 2048-token segment, and never: ``python
benchmarks/cp_crossover.py --gates bench|crossover|weak``, benchmarks/RESULTS.md). The host
cannot see the gates, and pass 1 walks a segment whole where they do not forget, so every
constant holds under the weakest gates:

* off when the serial work already fills the device: ``N * HV * ceil(V / 64)`` programs
  (the state kernel's V blocks) at least ``fill * SMs`` (64 programs: one sequence of
  32768 tokens on 32 v-heads ran 0.76 ms at 4 segments against 1.03 off under gates that
  forget, but 1.23-1.44 ms at every count against 1.04 under gates that do not);
* off when the longest sequence (the mean length when ``cu_seqlens`` has no host copy) has
  fewer than ``min_chunks`` chunks, or fewer than ``chunks_per_program`` chunks per
  program (32 programs on 128 chunks gained 1.25x under gates that never forget and 1.65x
  under gates that do; 32 programs on 64 chunks gained 1.09-1.33x at 4 segments, but 8
  programs on 16 chunks lost at every count), or would give fewer than two segments;
* else segments of ``2^round(log2(seg_factor * sqrt(N * HV * chunks / SMs)))`` chunks, at
  least ``min_seg_chunks``: the segment walk (``seg`` chunk steps, pass 1 and pass 2)
  against the scan (``chunks / seg`` steps). FlashQLA's rule of thumb has the same form
  with a factor of 3; ours measured best at 6 (segments twice as long), since each scan
  step is a full ``[K, K] x [K, V]`` fp32 product.

triton_generic follows the same rule. Its pass 1 is slower (plain Triton), and on the H200
(where the registry does not pick it), under gates that never forget, it ran 0-3% slower
than "off" at 32 programs with 4-7 chunks each and faster everywhere else the rule engages.

Chained segments (``CPPlan.chained``) serve the band the rule leaves off: at least ``fill *
SMs`` programs but fewer than ``chain_fill * SMs``. There no segment map ``M`` is formed
and nothing is scanned: pass 1 maps only the segments whose gates provably forget their
start (``N`` over the forgetting suffix), and pass 2's program of segment ``j`` starts from
segment ``j - 1``'s ``N`` where that one forgets, else waits for segment ``j - 1``'s
program to hand over its end state (programs take their work in segment order from a
ticket, so a program only waits on one that is already running). Under gates that forget
the segments run in parallel; under gates that never forget the walk is as serial as
"off" and costs a hand-over per segment. Pass 2 keeps the unsegmented call's V-block (a
wider one, as the mapped segments take on their slots, would make the serial walk slower
than "off": on the H200 a chunk step takes about 3.1 µs at BV = 128 on two warpgroups
against 1.4 at BV = 32, from the fused kernel's timings behind its configuration rule). So the chain can only gain where one slot's programs at that V-block leave SMs
idle: below about half the SMs in programs of 64 columns (one sequence of 32 v-heads at
V = 128 already fills the H200 at BV = 32, and gains nothing). Timed against "off" on the
H200 with the band over every program count (``benchmarks/cp_crossover.py gluon_sm90
--chain-fill 1.0``, benchmarks/RESULTS.md): under the bench's gates, which forget, 1.10x
and 1.20x where the band gains (24 (sequence, v-head) pairs), 0.82-1.01x elsewhere; under
gates that never forget 0.37-0.57x where it would engage (a program that waits holds its
SM while the one before it walks). The host cannot see the gates, so ``chain_fill`` is 0:
the band is empty, and chained segments run only where a caller's tuning asks for them.
Every backend with context parallelism runs chained plans (the reference computes their
results as any segmented call's); gluon_sm90 runs them in one launch of its one-kernel
build where the call's class has it, each segment warmed up from its forgetting suffix
instead of pass 1's N (``backends/gluon_common/warm_chain.py``: on an H100 at 16/32 heads x
32768 tokens 1.89x faster than "off" under the bench's gates, 0.50x under gates that never
forget).

Picked plans (``CPPlan.picked``) serve that band where the device can see the gates: from
``fill`` to ``pick_fill`` of the SMs (:data:`PICKING`'s half: 16/32 heads on one sequence
make 64 programs, below 66 on 132 SMs), for sequences of at least ``pick_min_chunks``
chunks. A census kernel on the device counts the chained segments that cannot warm up from
their forgetting suffix; then the warm chain's launch and the unsegmented pipeline's
launches all run, each leaving at once unless the count names its plan
(``backends/gluon_common/pick.py``): the warm chain where every segment warms up, "off"
where one does not. So a picked call costs "off" plus a census and a few launches that
leave at once where the gates keep their state, and runs the warm chain where they forget
(H100, 16/32 heads, CUDA-graph GPU time, ``python benchmarks/cp_crossover.py --picking
--gates bench|weak --shapes 16/32/1/32768,16/32/1/8192``: 0.513 ms against 0.951 off at 32768
tokens and 0.165 against 0.252 at 8192 under the bench's gates; 0.972 against 0.947 and
0.265 against 0.252 under gates that never forget). A model's gates keep the state on a few
heads: drawn as Qwen3-Next's layer initializes its decay rates (``cp_crossover.py --gates
model``), 2 to 6 of 32 v-heads keep more than 2^-40 of their state over 2048 tokens, so the
census finds segments that cannot warm up on nearly every call, and a picked plan would cost
"off" plus its census on those calls. So ``pick_fill`` is 0 by default: picked plans run only
where a caller whose gates forget on every head asks for them (``TUNING = PICKING``).
Only gluon_sm90's classes with the one-kernel build can pick; every other backend and class
runs a picked plan "off" (:meth:`CPPlan.unpicked`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

#: Tokens per chunk; a segment length is a multiple of it.
CHUNK = 64
#: The V block the automatic rule counts programs in (the state kernel's usual BV).
COUNTED_BV = 64
#: Accepted values of ``context_parallel`` besides a positive segment count.
MODES = ("auto", "off")


@dataclass(frozen=True)
class CPTuning:
    """The constants of the automatic rule (see the module docstring).

    Attributes
    ----------
    fill : float, CP stays off when ``N * HV * ceil(V / 64) >= fill * SMs``.
    min_chunks : int, CP stays off for a longest sequence of fewer chunks.
    chunks_per_program : int, CP stays off for a longest sequence of fewer chunks than this
        many per program (``N * HV * ceil(V / 64)``).
    seg_factor : float, the factor in front of ``sqrt(N * HV * chunks / SMs)``.
    min_seg_chunks : int, the shortest segment, chunks.
    chain_fill : float, chained segments where ``fill * SMs <= N * HV * ceil(V / 64) <
        chain_fill * SMs`` (0: never).
    chain_waves : float, a chained plan cuts the longest sequence into ``2^round(log2(
        chain_waves * SMs / programs))`` segments (at least 2, none under ``min_seg_chunks``
        chunks): each segment slot's programs fill ``1 / chain_waves`` of the SMs.
    pick_fill : float, above the chained band and below ``pick_fill * SMs`` programs, a
        picked plan (``CPPlan.picked``): chained segments where the device finds that every
        segment warms up, else "off" (0: never).
    pick_min_chunks : int, a picked plan needs a longest (or mean) sequence of at least this
        many chunks: on shorter ones the census and the launches that leave at once weigh
        against a walk too short to gain.
    """

    fill: float = 0.25
    min_chunks: int = 16
    chunks_per_program: int = 4
    seg_factor: float = 6.0
    min_seg_chunks: int = 4
    chain_fill: float = 0.0
    chain_waves: float = 2.0
    pick_fill: float = 0.0
    pick_min_chunks: int = 128


DEFAULT_TUNING = CPTuning()
#: The automatic rule with picked plans on (``pick_fill`` at half the SMs): for a caller
#: whose gates forget on every head (module docstring), ``context_parallel.TUNING =
#: PICKING``.
PICKING = CPTuning(pick_fill=0.5)
#: The constants the planners read when a call gives none: a benchmark that re-fits the
#: rule (or times chained segments, ``chain_fill``) replaces it for its run.
TUNING = DEFAULT_TUNING


@dataclass(frozen=True)
class CPPlan:
    """The decision for one call.

    Attributes
    ----------
    enabled : bool, the call runs segmented.
    seg_len : int, ``L``: tokens per segment, a multiple of 64 (0 when not enabled).
    num_segments : int, ``NSEG = T_total // L + N`` segment slots (0 when not enabled).
    reason : str, why, in one line (shown by ``explain`` and ``info``).
    chained : bool, pass 2 hands each segment's end state to the next (module docstring)
        instead of starting every segment from a scanned state.
    picked : bool (with ``chained``), the device picks between these chained segments,
        where every segment warms up from its forgetting suffix, and "off", where one does
        not (module docstring); a backend that cannot pick runs the call as :meth:`unpicked`.
    """

    enabled: bool
    seg_len: int
    num_segments: int
    reason: str
    chained: bool = False
    picked: bool = False

    def describe(self) -> str:
        if not self.enabled:
            return f"off ({self.reason})"
        kind = "chained segments" if self.chained else "segments"
        if self.picked:
            kind = "picked on the device: off, or " + kind
        return f"on, {kind} of {self.seg_len} tokens, {self.num_segments} segment slots ({self.reason})"

    def unpicked(self, why: str) -> CPPlan:
        """This plan where the backend cannot pick on the device: a picked plan is "off"
        (``why`` names what is missing), any other plan itself."""
        if not self.picked:
            return self
        return _off(f"{self.reason}; picked segments need {why}")


def context_parallel_reason(value) -> str | None:
    """Why ``value`` is not a valid ``context_parallel`` argument, or None."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return f"expected 'auto', 'off' or a segment count >= 1, got {value!r}"
    if isinstance(value, str) and value not in MODES:
        return f"expected 'auto', 'off' or a segment count >= 1, got {value!r}"
    if isinstance(value, int) and value < 1:
        return f"expected a segment count >= 1, got {value}"
    return None


def _chunks(tokens: int) -> int:
    return -(-tokens // CHUNK)


def _off(reason: str) -> CPPlan:
    return CPPlan(enabled=False, seg_len=0, num_segments=0, reason=reason)


def _on(seg_chunks: int, T_total: int, N: int, reason: str, chained: bool = False, picked: bool = False) -> CPPlan:
    L = seg_chunks * CHUNK
    return CPPlan(enabled=True, seg_len=L, num_segments=T_total // L + N, reason=reason, chained=chained,
                  picked=picked)


def chain_segment_chunks(programs: int, chunks: int, sm_count: int, tuning: CPTuning) -> int:
    """Chunks per segment of a chained plan: the longest sequence's ``chunks`` in
    ``2^round(log2(chain_waves * SMs / programs))`` segments (at least 2), each at least
    ``min_seg_chunks`` chunks."""
    count = max(2, 2 ** round(math.log2(max(tuning.chain_waves * sm_count / programs, 1.0))))
    return max(tuning.min_seg_chunks, -(-chunks // count))


def auto_segment_chunks(N: int, HV: int, chunks: int, sm_count: int,
                        tuning: CPTuning | None = None) -> int:
    """Chunks per segment of the automatic rule: ``2^round(log2(seg_factor * sqrt(N * HV *
    chunks / SMs)))``, at least ``min_seg_chunks``."""
    tuning = tuning or TUNING
    ideal = tuning.seg_factor * math.sqrt(N * HV * chunks / sm_count)
    return max(tuning.min_seg_chunks, 2 ** round(math.log2(max(ideal, 1.0))))


def plan_context_parallel(
    request,
    *,
    T_total: int,
    N: int,
    HV: int,
    V: int,
    sm_count: int,
    max_len: int | None = None,
    tuning: CPTuning | None = None,
) -> CPPlan:
    """Decide context parallelism for a call.

    Parameters
    ----------
    request : "auto", "off", or int ``n >= 1``: segments sized so that the longest
        sequence spans ``n`` of them (``T_total`` stands for the longest when its length
        is not known on the host, so no sequence gets more than ``n``).
    T_total : int, tokens on the packed axis (``B * T``).
    N : int, sequences.
    HV, V : int, value heads and value head dim.
    sm_count : int, multiprocessors of the device (0 or less: no device to fill; "auto"
        stays off).
    max_len : int or None, the longest sequence's length when known on the host (a
        uniform batch: ``T``; varlen with a host copy of ``cu_seqlens``); None otherwise,
        and then only ``T_total`` and ``N`` are used (no device sync).
    tuning : CPTuning, the automatic rule's constants (None: :data:`TUNING`).

    Returns
    -------
    CPPlan
    """
    tuning = tuning or TUNING
    reason = context_parallel_reason(request)
    if reason is not None:
        raise ValueError(f"context_parallel: {reason}")
    if request == "off":
        return _off("context_parallel='off'")
    if N == 0 or T_total == 0 or HV == 0:
        return _off("no tokens")
    if isinstance(request, int):
        longest = T_total if max_len is None else max_len
        if longest == 0:
            return _off("no tokens")
        seg_chunks = -(-_chunks(longest) // request)
        return _on(seg_chunks, T_total, N, f"context_parallel={request} forced")
    if sm_count <= 0:
        return _off("no SM count on this device")
    programs = N * HV * -(-V // COUNTED_BV)
    if tuning.fill * sm_count <= programs < tuning.chain_fill * sm_count:
        return _chained(programs, T_total, N, sm_count, max_len, tuning)
    if tuning.fill * sm_count <= programs < tuning.pick_fill * sm_count:
        return _chained(programs, T_total, N, sm_count, max_len, tuning, picked=True)
    if programs >= tuning.fill * sm_count:
        # Below one program per SM, segments still pay where the gates forget (pass 1 then
        # walks only what each segment remembers); the host cannot see the gates.
        hint = "; a forced count gains only where the gates forget" if programs < sm_count else ""
        return _off(f"N x HV x V-blocks = {programs} programs >= {tuning.fill:g} x {sm_count} SMs{hint}")
    known = max_len is not None
    longest = max_len if known else T_total // N
    chunks = _chunks(longest)
    what = "longest sequence" if known else "mean sequence"
    if chunks < tuning.min_chunks:
        return _off(f"{what} has {chunks} chunks < {tuning.min_chunks}")
    if chunks < tuning.chunks_per_program * programs:
        return _off(f"{what} has {chunks} chunks < {tuning.chunks_per_program} per program x {programs} programs")
    seg_chunks = auto_segment_chunks(N, HV, chunks, sm_count, tuning)
    if chunks < 2 * seg_chunks:
        return _off(f"{what} of {chunks} chunks gives fewer than 2 segments of {seg_chunks}")
    return _on(seg_chunks, T_total, N,
               f"N x HV x V-blocks = {programs} programs < {tuning.fill:g} x {sm_count} SMs; {what} of {chunks} chunks")


def _chained(programs: int, T_total: int, N: int, sm_count: int, max_len: int | None, tuning: CPTuning,
             picked: bool = False) -> CPPlan:
    """The band between ``fill`` and ``chain_fill`` of the SMs (``picked``: up to
    ``pick_fill``): chained segments (:func:`chain_segment_chunks`) where the longest (or
    mean) sequence gives two."""
    known = max_len is not None
    chunks = _chunks(max_len if known else T_total // N)
    what = "longest sequence" if known else "mean sequence"
    seg_chunks = chain_segment_chunks(programs, chunks, sm_count, tuning)
    top = tuning.pick_fill if picked else tuning.chain_fill
    band = f"N x HV x V-blocks = {programs} programs in [{tuning.fill:g}, {top:g}) x {sm_count} SMs"
    if chunks < 2 * seg_chunks:
        return _off(f"{band}; {what} of {chunks} chunks gives fewer than 2 chained segments of {seg_chunks}")
    if picked and chunks < tuning.pick_min_chunks:
        return _off(f"{band}; {what} of {chunks} chunks < {tuning.pick_min_chunks} for a picked plan")
    return _on(seg_chunks, T_total, N, f"{band}; {what} of {chunks} chunks", chained=True, picked=picked)


def plan_for_problem(problem, sm_count: int, tuning: CPTuning | None = None) -> CPPlan:
    """:func:`plan_context_parallel` for a validated call (a ``GDNProblem``): the longest
    sequence from the host copy of ``cu_seqlens`` when there is one, else the mean."""
    chunks = problem.chunks
    q, v = problem.q.shape, problem.v.shape
    request, N = problem.context_parallel, chunks.num_seqs
    longest = None
    if not chunks.uniform and chunks.cu_seqlens_host is not None and N > 0 and request != "off":
        longest = chunks.longest_length()
    return plan_for_counts(request, q[0], q[1], N, v[2], v[3], sm_count, chunks.uniform, longest, tuning)


def plan_for_counts(request, B: int, T: int, N: int, HV: int, V: int, sm_count: int, uniform: bool,
                    longest: int | None, tuning: CPTuning | None = None) -> CPPlan:
    """:func:`plan_for_problem` from a call's counts: ``B`` rows of ``T`` tokens (``uniform``),
    or ``N`` packed sequences whose longest is ``longest`` (None: no host copy, or not
    read)."""
    if uniform:
        longest = T
    elif N == 0 or request == "off":
        longest = None
    return _plan_kept(request, B * T, N, HV, V, sm_count, longest, tuning or TUNING)


@functools.lru_cache(maxsize=4096, typed=True)
def _plan_kept(request, T_total: int, N: int, HV: int, V: int, sm_count: int, max_len: int | None,
               tuning: CPTuning) -> CPPlan:
    """:func:`plan_context_parallel`, memoized: a call whose counts recur (a steady shape, a
    bucketed batch) skips forming the decision and its reason string (~2.5 µs of ~4 on a
    2-core CPU); a new count costs the cache insert (~0.5 µs)."""
    return plan_context_parallel(request, T_total=T_total, N=N, HV=HV, V=V, sm_count=sm_count, max_len=max_len,
                                 tuning=tuning)
