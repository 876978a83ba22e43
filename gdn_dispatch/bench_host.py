"""``python -m gdn_dispatch bench --host``: what a call costs the host, beside what it costs the GPU.

For each GPU backend (forced) and fla, on Qwen3.5-shaped bf16 calls (H = 16, HV = 32,
K = V = 128, initial and final state):

* *eager enqueue*: host microseconds per call over back-to-back calls with no
  synchronization inside the loop (the time a serving loop spends issuing the call);
* *GPU time*: microseconds per replay of the call captured in a CUDA graph (no host work);
* for our backends, the *host breakdown*: validate (``make_problem``), select (device probe
  and registry), forward (plan, allocations and launches), each timed alone; and how many
  of the enqueued calls their call program ran (``program taken/calls``: the native host
  layer's one-call path, :mod:`gdn_dispatch.backends.call_program`; absent where no call
  consulted one) and how many their route ran (``route taken/calls``,
  :mod:`gdn_dispatch.routes`: those calls skip the three steps above);

for uniform and varlen calls (with and without ``cu_seqlens_cpu``) at 64 and 8192 tokens.
First, a *host reference* line: two fixed pieces of host work timed in the same process
(:func:`host_reference_us`), since the same host runs the same Python well apart from one
process to the next: tables are comparable through it. The lent hosts also change speed
within a process, so every row carries the Python reference read around its first
enqueue round (``py ref``, µs; the slower of the readings before and after it): rows are
comparable through it.
Last, the *enqueue over passes*: the case list is timed ``passes`` times over (the passes
after the first re-time the enqueue alone), each round between two readings of the Python
reference. The lent hosts are virtual machines whose CPUs run at about half speed for
seconds at a time, on every CPU in turn (pinning a process does not avoid it); a round whose
readings stay within :data:`FULL_SPEED` of the run's fastest reading ran on a host at full
speed. The summary gives each row's median over all rounds, its best round and its median
over the full-speed rounds, so a row is read at the host's speed and not at the stretch of
contention it happened to meet.
Then the *ragged stream*: :data:`STREAM_BATCHES` seeded random batches of 1..16 sequences of
1..4000 tokens, each one call followed by a synchronize, timed wall-clock; the median per
backend. A call is host-bound where its enqueue time exceeds its GPU time.

The clock and the device synchronization are arguments, so the measuring loops are tested
on the CPU with stand-ins; only :func:`run_host` needs a GPU.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from gdn_dispatch.backends.call_program import PROGRAM_CALLS
from gdn_dispatch.routes import ROUTE_CALLS
from gdn_dispatch.bench_report import FLA

#: Head counts and dims of the host cases (Qwen3.5's linear-attention layer).
H, HV, HEAD_DIM = 16, 32, 128
#: Ragged stream: batches, and sequences per batch / tokens per sequence drawn uniformly.
STREAM_BATCHES, STREAM_SEQS, STREAM_TOKENS = 60, (1, 16), (1, 4000)


#: The tensor-parallel shard of the host table's context-parallel cases: Qwen3.5's heads
#: at TP = 8, where a long prompt's call is cut into segments ("auto").
TP8_HEADS = (2, 4)


@dataclass(frozen=True)
class HostCase:
    """One call of the host table: ``lengths`` packed (varlen) or one row (uniform), with
    ``heads`` (H, HV)."""

    name: str
    lengths: tuple[int, ...]
    varlen: bool
    host_copy: bool = True
    heads: tuple[int, int] = (H, HV)


def host_cases() -> list[HostCase]:
    """Uniform and varlen calls at 64 and 8192 tokens, varlen with and without the host
    copy; and a 32768-token prompt on the TP = 8 shard, which the planner cuts into
    segments (context parallelism: four launches or more per call)."""
    cases = []
    for tokens in (64, 8192):
        cases.append(HostCase(f"uniform-1x{tokens}", (tokens,), varlen=False))
        cases.append(HostCase(f"varlen-1x{tokens}", (tokens,), varlen=True))
        cases.append(HostCase(f"varlen-1x{tokens}-no-cpu", (tokens,), varlen=True, host_copy=False))
    cases.append(HostCase("varlen-4x2048", (2048,) * 4, varlen=True))
    cases.append(HostCase("varlen-4x2048-no-cpu", (2048,) * 4, varlen=True, host_copy=False))
    shard = "H{}-HV{}".format(*TP8_HEADS)
    cases.append(HostCase(f"{shard}-varlen-1x32768", (32768,), varlen=True, heads=TP8_HEADS))
    cases.append(HostCase(f"{shard}-varlen-1x32768-no-cpu", (32768,), varlen=True, host_copy=False, heads=TP8_HEADS))
    return cases


def ragged_stream(seed: int, batches: int = STREAM_BATCHES) -> list[tuple[int, ...]]:
    """``batches`` seeded batches, each a tuple of sequence lengths."""
    rng = random.Random(seed)
    return [tuple(rng.randint(*STREAM_TOKENS) for _ in range(rng.randint(*STREAM_SEQS))) for _ in range(batches)]


def make_call(lengths: tuple[int, ...], varlen: bool, host_copy: bool, device, seed: int,
              heads: tuple[int, int] = (H, HV)) -> dict:
    """Keyword arguments of one call (ours): q, k l2-normalized, logsigmoid gates, h0;
    ``heads`` (H, HV)."""
    from gdn_dispatch.testing import random_call

    kw = dict(lengths=list(lengths)) if varlen else dict(batch=(1, sum(lengths)))
    call = random_call(**kw, H=heads[0], HV=heads[1], K=HEAD_DIM, V=HEAD_DIM, dtype=torch.bfloat16, device=device,
                       seed=seed)
    if not host_copy:
        call.pop("cu_seqlens_cpu", None)
    return call


def fla_call(call: dict) -> dict:
    """The same call in fla's keywords (int64 cu_seqlens, no host copy)."""
    out = {k: v for k, v in call.items() if k != "cu_seqlens_cpu"}
    if out.get("cu_seqlens") is not None:
        out["cu_seqlens"] = out["cu_seqlens"].long()
    return out


def per_call_us(fn: Callable[[], object], calls: int, *, clock=time.perf_counter,
                sync: Callable[[], None] = lambda: None, warmup: int = 3) -> float:
    """Host microseconds per ``fn()`` over ``calls`` back-to-back calls, synchronized only
    before and after the loop (few enough calls that the launch queue never fills)."""
    for _ in range(warmup):
        fn()
    sync()
    start = clock()
    for _ in range(calls):
        fn()
    elapsed = clock() - start
    sync()
    return elapsed / calls * 1e6


def rounds_us(fn: Callable[[], object], calls: int, rounds: int, *, clock=time.perf_counter,
              sync: Callable[[], None] = lambda: None) -> float:
    """The median over ``rounds`` rounds of :func:`per_call_us` (``calls`` calls each;
    only the first round warms up): a round now and then lands on a busy host, which one
    round alone would report."""
    return statistics.median(per_call_us(fn, calls, clock=clock, sync=sync, warmup=3 if i == 0 else 0)
                             for i in range(rounds))


@dataclass(frozen=True)
class EnqueueRound:
    """One enqueue round: host µs per call, and the Python reference around it (the slower
    of the readings just before and just after the round, µs)."""

    us: float
    ref_us: float


def enqueue_rounds(fn: Callable[[], object], calls: int, rounds: int, *, clock=time.perf_counter,
                   sync: Callable[[], None] = lambda: None, reference: Callable[[], float] | None = None,
                   warmup: int = 3) -> list[EnqueueRound]:
    """``rounds`` rounds of :func:`per_call_us` (``calls`` calls each; only the first warms
    up), each between two readings of ``reference`` (one round of
    :func:`python_reference_us` unless given: the best of several would read fast where
    any part of the reading was; one reading between two rounds serves both)."""
    reference = reference or (lambda: python_reference_us(rounds=1))
    before, out = reference(), []
    for i in range(rounds):
        us = per_call_us(fn, calls, clock=clock, sync=sync, warmup=warmup if i == 0 else 0)
        after = reference()
        out.append(EnqueueRound(us, max(before, after)))
        before = after
    return out


#: Entries of the dict the Python reference reads (:func:`_python_reference`).
_REFERENCE_KEYS = tuple(f"k{i}" for i in range(16))
_REFERENCE_DICT = {key: i for i, key in enumerate(_REFERENCE_KEYS)}


def _python_reference() -> int:
    """A fixed piece of Python: 16 dict lookups, 16 attribute reads, 16 additions (the kind
    of work a call's host path does)."""
    total = 0
    for key in _REFERENCE_KEYS:
        total += _REFERENCE_DICT[key] + key.__len__()
    return total


def python_reference_us(*, calls: int = 1000, rounds: int = 3, clock=time.perf_counter) -> float:
    """Host microseconds, now, of :func:`_python_reference`: the best of ``rounds`` rounds
    of ``calls`` calls (a few milliseconds)."""
    return min(per_call_us(_python_reference, calls, clock=clock) for _ in range(rounds))


def host_reference_us(device, *, calls: int = 2000, rounds: int = 5, clock=time.perf_counter) -> dict[str, float]:
    """Host microseconds, now, of ``torch.empty`` of a [1, 64, 32, 128] bf16 tensor on
    ``device`` (an output of the host table's small calls) and of :func:`_python_reference`:
    the best of ``rounds`` rounds of ``calls`` calls each."""
    def empty():
        return torch.empty(1, 64, HV, HEAD_DIM, dtype=torch.bfloat16, device=device)

    return {name: min(per_call_us(fn, calls, clock=clock) for _ in range(rounds))
            for name, fn in (("torch.empty", empty), ("python", _python_reference))}


def format_reference(reference: dict[str, float]) -> str:
    """The host reference line of the table."""
    return (f"host reference (this process): torch.empty [1, 64, {HV}, {HEAD_DIM}] bf16 "
            f"{reference['torch.empty']:.2f} us, Python reference {reference['python']:.2f} us")


def synchronized_us(fn: Callable[[], object], *, clock=time.perf_counter,
                    sync: Callable[[], None] = lambda: None) -> float:
    """Wall-clock microseconds of one ``fn()`` followed by a synchronize."""
    sync()
    start = clock()
    fn()
    sync()
    return (clock() - start) * 1e6


def graph_replay_us(fn: Callable[[], object], replays: int = 20, windows: int = 1) -> float:
    """GPU microseconds per replay of ``fn`` captured in a CUDA graph (CUDA events): the
    median over ``windows`` timed windows of ``replays`` back-to-back replays each."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    per_window = []
    for _ in range(windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        per_window.append(start.elapsed_time(end) / replays * 1e3)
    return statistics.median(per_window)


def host_steps(call: dict, backend: str) -> dict[str, Callable[[], object]]:
    """The host steps of one of our calls, each runnable alone: validate, select, forward."""
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.device import default_probe
    from gdn_dispatch.registry import select

    problem = make_problem(**call, output_final_state=True, backend=backend)
    probe = default_probe()
    info = probe.for_torch_device(problem.device)
    selection = select(info, problem)
    return {
        "validate": lambda: make_problem(**call, output_final_state=True, backend=backend),
        "select": lambda: select(probe.for_torch_device(problem.device), problem),
        "forward": lambda: selection.module.forward(problem, selection),
    }


@dataclass
class HostRow:
    """One backend on one case: microseconds (None where not measured) and a note."""

    backend: str
    case: str
    enqueue_us: float | None = None
    gpu_us: float | None = None
    steps_us: dict[str, float] = field(default_factory=dict)
    note: str = ""
    #: (calls its call program ran, calls enqueued), or None where no call consulted one.
    program: tuple[int, int] | None = None
    #: (calls its route ran, calls enqueued), or None where no call reached a route.
    route: tuple[int, int] | None = None
    #: The Python reference around this row's first enqueue round (its ``ref_us``).
    host_ref_us: float | None = None
    #: Every enqueue round of every pass (the first pass's give ``enqueue_us``, their median).
    rounds: list[EnqueueRound] = field(default_factory=list)


#: A round ran at the host's full speed where the Python reference around it read at most
#: this many times the run's fastest reading (the lent hosts' slow stretches read 1.7-2.5x).
FULL_SPEED = 1.25


def format_passes(rows: list[HostRow]) -> list[str]:
    """The enqueue summary over all passes: per row its rounds, their median, the best
    round, and the median of the rounds at full host speed (:data:`FULL_SPEED`)."""
    refs = [r.ref_us for row in rows for r in row.rounds]
    if not refs:
        return []
    fastest = min(refs)
    lines = [f"enqueue over all passes, us per call (fs: rounds at full host speed, the Python reference around "
             f"them within {FULL_SPEED}x of the run's fastest reading, {fastest:.2f} us)",
             f"{'case':<28} {'backend':<15} {'rounds':>6} {'median':>8} {'best':>8} {'fs rounds':>10} "
             f"{'fs median':>9}"]
    for row in rows:
        if not row.rounds:
            continue
        fast = [r.us for r in row.rounds if r.ref_us <= FULL_SPEED * fastest]
        fast_median = f"{statistics.median(fast):9.1f}" if fast else f"{'-':>9}"
        lines.append(f"{row.case:<28} {row.backend:<15} {len(row.rounds):>6} "
                     f"{statistics.median(r.us for r in row.rounds):8.1f} {min(r.us for r in row.rounds):8.1f} "
                     f"{f'{len(fast)}/{len(row.rounds)}':>10} {fast_median}{'  ' + row.note if row.note else ''}")
    return lines


def format_rows(rows: list[HostRow]) -> list[str]:
    """The host table: one line per (case, backend)."""
    lines = [f"{'case':<24} {'backend':<15} {'enqueue us':>10} {'GPU us':>8} {'host/GPU':>8} {'py ref':>6}  "
             "steps (us, each alone)"]
    for r in rows:
        ratio = f"{r.enqueue_us / r.gpu_us:8.2f}" if r.enqueue_us and r.gpu_us else f"{'-':>8}"
        enqueue = f"{r.enqueue_us:10.1f}" if r.enqueue_us is not None else f"{'-':>10}"
        gpu = f"{r.gpu_us:8.1f}" if r.gpu_us is not None else f"{'-':>8}"
        ref = f"{r.host_ref_us:6.2f}" if r.host_ref_us is not None else f"{'-':>6}"
        steps = ", ".join(f"{k} {v:.1f}" for k, v in r.steps_us.items())
        if r.program is not None:
            steps += f"{', ' if steps else ''}program {r.program[0]}/{r.program[1]}"
        if r.route is not None:
            steps += f"{', ' if steps else ''}route {r.route[0]}/{r.route[1]}"
        lines.append(f"{r.case:<24} {r.backend:<15} {enqueue} {gpu} {ratio} {ref}  {steps}"
                     f"{'  ' + r.note if r.note else ''}")
    return lines


def format_stream(medians: dict[str, float | str]) -> list[str]:
    """The ragged stream's medians, each against fla's when fla ran."""
    base = medians.get(FLA)
    lines = [f"ragged stream: {STREAM_BATCHES} batches of {STREAM_SEQS[0]}..{STREAM_SEQS[1]} sequences of "
             f"{STREAM_TOKENS[0]}..{STREAM_TOKENS[1]} tokens, one synchronized call each; median"]
    for name, value in medians.items():
        if isinstance(value, str):
            lines.append(f"  {name:<15} {value}")
            continue
        rel = f"  {value / base:.2f}x fla" if isinstance(base, float) and name != FLA else ""
        lines.append(f"  {name:<15} {value / 1e3:8.3f} ms{rel}")
    return lines


def case_call(case: HostCase, device, seed: int) -> dict:
    """Our keyword arguments of ``case``'s call (:func:`make_call`)."""
    return make_call(case.lengths, case.varlen, case.host_copy, device, seed, case.heads)


def bound_call(name: str, caller: Callable, call: dict) -> Callable[[], object]:
    """``caller`` on ``call`` with no arguments: fla's in its own keywords (:func:`fla_call`)."""
    if name == FLA:
        theirs = fla_call(call)
        return lambda: caller(**theirs)
    return lambda: caller(**call)


def measure_case(case: HostCase, call: dict, callers: dict[str, Callable], calls: int,
                 rounds: int = 1) -> list[HostRow]:
    """Every caller on ``case``'s ``call`` (GPU): enqueue and our host steps (each the
    median of ``rounds`` rounds of ``calls`` calls; the enqueue's rounds kept on the row
    with their Python reference, :func:`enqueue_rounds`), graph replay."""
    rows = []
    for name, caller in callers.items():
        row = HostRow(name, case.name)
        fn = bound_call(name, caller, call)
        enqueued = [0]

        def counting(fn=fn):
            enqueued[0] += 1
            return fn()

        try:
            consulted, routed = sum(PROGRAM_CALLS.values()), sum(ROUTE_CALLS.values())
            taken, route_taken = PROGRAM_CALLS["taken"], ROUTE_CALLS["taken"]
            row.rounds = enqueue_rounds(counting, calls, rounds, sync=torch.cuda.synchronize)
            row.host_ref_us = row.rounds[0].ref_us
            row.enqueue_us = statistics.median(r.us for r in row.rounds)
            if name != FLA and sum(PROGRAM_CALLS.values()) > consulted:
                row.program = (PROGRAM_CALLS["taken"] - taken, enqueued[0])
            if name != FLA and sum(ROUTE_CALLS.values()) > routed:
                row.route = (ROUTE_CALLS["taken"] - route_taken, enqueued[0])
            row.gpu_us = graph_replay_us(fn)
            if name != FLA:
                for step, step_fn in host_steps(call, name).items():
                    row.steps_us[step] = rounds_us(step_fn, calls, rounds, sync=torch.cuda.synchronize)
        except Exception as exc:  # report and go on: a table with a hole beats no table
            row.note = f"{type(exc).__name__}: {exc}"[:120]
        rows.append(row)
    return rows


def retime_enqueue(call: dict, rows: list[HostRow], callers: dict[str, Callable], calls: int, rounds: int) -> None:
    """One more pass of enqueue rounds on ``call`` (the rows' case) for every caller,
    appended to its row."""
    for row in rows:
        if row.enqueue_us is None:  # it failed in the first pass, which reported why
            continue
        try:
            row.rounds += enqueue_rounds(bound_call(row.backend, callers[row.backend], call), calls, rounds,
                                         sync=torch.cuda.synchronize)
        except Exception as exc:  # the row keeps the rounds it has; the summary says why it has fewer
            row.note += f"{'; ' if row.note else ''}a later pass: {type(exc).__name__}: {exc}"[:120]


def measure_stream(callers: dict[str, Callable], device, seed: int) -> dict[str, float | str]:
    """The ragged stream per caller: one untimed pass (compiles), then one timed pass."""
    batches = [make_call(lengths, True, True, device, seed + i) for i, lengths in enumerate(ragged_stream(seed))]
    medians: dict[str, float | str] = {}
    for name, caller in callers.items():
        calls = [fla_call(c) if name == FLA else c for c in batches]
        try:
            for c in calls:
                caller(**c)
            times = [synchronized_us(lambda c=c: caller(**c), sync=torch.cuda.synchronize) for c in calls]
            medians[name] = statistics.median(times)
        except Exception as exc:
            medians[name] = f"error: {type(exc).__name__}: {exc}"[:120]
    return medians


def run_host(backends: list[str], fla_fn, device: torch.device, *, seed: int, calls: int, out,
             rounds: int = 1, passes: int = 1) -> int:
    """The host table, the ragged stream and, over ``passes`` passes of the enqueue rounds,
    the enqueue summary (:func:`format_passes`) on ``device``; returns 0, or 1 if one of
    ours failed."""
    from gdn_dispatch.api import chunk_gated_delta_rule

    callers: dict[str, Callable] = {}
    for name in backends:
        callers[name] = (lambda name=name: lambda **c: chunk_gated_delta_rule(**c, output_final_state=True,
                                                                                backend=name))()
    if fla_fn is not None:
        callers[FLA] = lambda **c: fla_fn(**c, output_final_state=True)
    print(f"host cost per call (H={H}, HV={HV} unless the case names its heads, K=V={HEAD_DIM}, bf16, h0 + final "
          f"state); enqueue = {calls} back-to-back calls (median of {rounds} rounds; {passes} passes, summary "
          f"last), GPU = CUDA-graph replay",
          file=out)
    print(format_reference(host_reference_us(device)), file=out, flush=True)
    from gdn_dispatch import native

    print(f"native host layer: {native.status()}", file=out, flush=True)
    rows: list[HostRow] = []
    by_case: list[tuple[dict, list[HostRow]]] = []  # each case's call, kept for the later passes
    with torch.inference_mode():
        # A process's first second or two of calls run slower on the lent hosts (the first
        # case read 1.2-1.8x the next ones in every run): one untimed pass of the first case.
        first = host_cases()[0]
        measure_case(first, case_call(first, device, seed), callers, calls, 1)
        for case in host_cases():
            call = case_call(case, device, seed)
            case_rows = measure_case(case, call, callers, calls, rounds)
            lines = format_rows(case_rows)
            print("\n".join(lines if not rows else lines[1:]), file=out, flush=True)  # header once
            rows += case_rows
            by_case.append((call, case_rows))
        print("\n".join(format_stream(measure_stream(callers, device, seed))), file=out, flush=True)
        for p in range(1, passes):
            print(f"enqueue pass {p + 1}/{passes}", file=out, flush=True)
            for call, case_rows in by_case:
                retime_enqueue(call, case_rows, callers, calls, rounds)
        print("\n".join(format_passes(rows)), file=out, flush=True)
    return 1 if any(r.note and r.backend != FLA for r in rows) else 0
