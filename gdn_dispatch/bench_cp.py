"""``bench --context-parallel``: which context-parallel request our backends are timed with,
and the crossover table of ``compare`` (each backend timed with ``'off'`` and ``'auto'`` side
by side in one run, with the segments ``auto`` chose).

``auto`` turns segments on where the planner expects them to pay
(:mod:`gdn_dispatch.context_parallel`); the table is how that rule is checked against
measurements: on every shape where ``auto`` cuts segments it should be no slower than
``off``. Pure host code, tested on the CPU.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from gdn_dispatch.bench_report import ShapeResult
from gdn_dispatch.bench_shapes import BenchShape
from gdn_dispatch.context_parallel import CPPlan, context_parallel_reason, plan_context_parallel

#: The request that times every backend twice, with "off" and with "auto".
COMPARE = "compare"
#: The two requests ``compare`` times, in table order.
COMPARED = ("off", "auto")


def parse_mode(text: str) -> str | int:
    """``--context-parallel``'s value: "auto", "off", "compare" or a segment count >= 1."""
    if text == COMPARE:
        return COMPARE
    value = int(text) if text.lstrip("-").isdigit() else text
    if context_parallel_reason(value) is not None:
        raise argparse.ArgumentTypeError(f"expected auto, off, compare or a segment count >= 1, got {text!r}")
    return value


def label(backend: str, request: str | int) -> str:
    """The name a backend's measurement carries under ``compare``: ``name[cp=off]``."""
    return f"{backend}[cp={request}]"


def make_callers(names: list[str], mode: str | int, caller: Callable) -> dict:
    """The callers to time: ``caller(name, context_parallel=mode)`` per backend name, or under
    ``compare`` one per backend and request of :data:`COMPARED`, labelled by :func:`label`."""
    if mode != COMPARE:
        return {name: caller(name, context_parallel=mode) for name in names}
    return {label(name, request): caller(name, context_parallel=request) for name in names for request in COMPARED}


def auto_decision(shape: BenchShape, sm_count: int) -> CPPlan:
    """What ``context_parallel='auto'`` decides for ``shape`` on ``sm_count`` SMs (the bench
    passes ``cu_seqlens_cpu``, so the planner sees the longest sequence)."""
    longest = max(shape.seqlens, default=0) if shape.is_varlen else shape.T
    return plan_context_parallel("auto", T_total=shape.tokens, N=shape.N, HV=shape.HV, V=shape.V,
                                 sm_count=sm_count, max_len=longest)


@dataclass(frozen=True)
class CrossoverRow:
    """One (shape, backend) of the crossover table; times are medians in ms (None: failed)."""

    shape: str
    backend: str
    off_ms: float | None
    auto_ms: float | None
    segments: str

    @property
    def speedup(self) -> float | None:
        """``off / auto``: above 1 where segments pay."""
        if self.off_ms is None or self.auto_ms is None:
            return None
        return self.off_ms / self.auto_ms


def crossover_rows(results: list[ShapeResult], names: list[str], sm_count: int,
                   runs_segments: Callable[[str], bool]) -> list[CrossoverRow]:
    """The table of a ``compare`` run: per shape and backend, the ``off`` and ``auto``
    medians and what ``auto`` chose (``"off"`` where it stays off or where the backend's
    registry row runs no segments, per ``runs_segments(name)``)."""
    rows = []
    for result in results:
        times = {m.backend: m.ms for m in result.measurements}
        decision = auto_decision(result.shape, sm_count)
        for name in names:
            if not decision.enabled or not runs_segments(name):
                chosen = "off"
            else:
                chosen = f"{decision.num_segments} x {decision.seg_len}"
            rows.append(CrossoverRow(shape=result.shape.name, backend=name, off_ms=times.get(label(name, "off")),
                                     auto_ms=times.get(label(name, "auto")), segments=chosen))
    return rows


def format_crossover(rows: list[CrossoverRow]) -> list[str]:
    """The crossover table as Markdown (for benchmarks/RESULTS.md)."""

    def ms(value):
        return "-" if value is None else f"{value:.3f}"

    lines = ["| shape | backend | off ms | auto ms | off / auto | auto: segment slots x tokens |",
             "| --- | --- | ---: | ---: | ---: | --- |"]
    for r in rows:
        speedup = "-" if r.speedup is None else f"{r.speedup:.2f}"
        lines.append(f"| {r.shape} | {r.backend} | {ms(r.off_ms)} | {ms(r.auto_ms)} | {speedup} | {r.segments} |")
    return lines
