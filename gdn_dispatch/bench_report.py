"""The results of ``python -m gdn_dispatch bench`` and how they are reported: one
:class:`Measurement` per backend and shape, the text table printed as a run goes, the JSON
report (``--json``) and the plot (``--plot``). Pure functions, tested on the CPU.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import shlex
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gdn_dispatch.bench_shapes import BenchShape

#: The name fla's row carries (the yardstick of every ``x fla`` ratio).
FLA = "fla"


@dataclass
class Measurement:
    """One backend on one shape. Times in milliseconds; ratios are time / yardstick."""

    backend: str
    ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    iters: int = 0
    tflops: float | None = None
    sol_ratio: float | None = None
    fla_ratio: float | None = None
    err_o: float | None = None
    err_state: float | None = None
    note: str = ""
    failed: bool = False


@dataclass
class ShapeResult:
    """Every backend on one shape, with the shape's byte/FLOP counts and SOL bound."""

    shape: BenchShape
    min_bytes: int
    flops: float
    bound_ms: float
    bound_by: str
    input_sets: int
    measurements: list[Measurement] = field(default_factory=list)


def from_times(backend: str, times_ms: list[float]) -> Measurement:
    """A Measurement from per-call event times (ratios are filled by :func:`finish`)."""
    return Measurement(backend=backend, ms=statistics.median(times_ms), min_ms=min(times_ms),
                       max_ms=max(times_ms), iters=len(times_ms))


def finish(result: ShapeResult) -> ShapeResult:
    """Fill TFLOP/s, x SOL and x fla of every timed measurement, in place; returns it."""
    fla = next((m for m in result.measurements if m.backend == FLA and m.ms is not None), None)
    for m in result.measurements:
        if m.ms is None:
            continue
        m.tflops = result.flops / (m.ms * 1e-3) / 1e12
        m.sol_ratio = m.ms / result.bound_ms
        m.fla_ratio = None if fla is None else m.ms / fla.ms
    return result


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(results: list[ShapeResult], check: bool = False) -> str:
    """The side-by-side table: one block per shape (its bound first), one row per backend."""
    lines = [format_columns(check)]
    for result in results:
        lines.extend(format_shape_block(result, check))
    return "\n".join(lines)


_COLUMNS = (("backend", 16, "<"), ("ms", 9, ">"), ("TFLOP/s", 8, ">"), ("x SOL", 8, ">"), ("x fla", 7, ">"))
_CHECK_COLUMNS = (("err o", 9, ">"), ("err state", 9, ">"))


def format_columns(check: bool = False) -> str:
    """The column header line of :func:`format_table`."""
    cols = _COLUMNS + (_CHECK_COLUMNS if check else ())
    return "  " + "  ".join(f"{name:{align}{width}}" for name, width, align in cols) + "  note"


def format_shape_block(result: ShapeResult, check: bool = False) -> list[str]:
    """The lines of one shape: a title with its counts and bound, then one row per backend."""
    s = result.shape
    lines = [
        f"{s.name}: {s.describe()}; {result.min_bytes / 1e6:.1f} MB, {result.flops / 1e9:.1f} GFLOP, "
        f"bound {result.bound_ms:.4f} ms ({result.bound_by}), {result.input_sets} input sets",
    ]
    for m in result.measurements:
        cells = [f"{m.backend:<16}", f"{_fmt(m.ms, '.4f'):>9}", f"{_fmt(m.tflops, '.1f'):>8}",
                 f"{_fmt(m.sol_ratio, '.2f'):>8}", f"{_fmt(m.fla_ratio, '.3f'):>7}"]
        if check:
            cells += [f"{_fmt(m.err_o, '.2e'):>9}", f"{_fmt(m.err_state, '.2e'):>9}"]
        lines.append(("  " + "  ".join(cells) + "  " + m.note).rstrip())
    return lines


def build_report(results: list[ShapeResult], *, device: dict, versions: dict, ceilings: dict,
                 settings: dict, command: str, date: str | None = None) -> dict:
    """Everything a run measured, as JSON-ready data."""
    shapes = []
    for r in results:
        entry = dataclasses.asdict(r.shape)
        entry.update(tokens=r.shape.tokens, N=r.shape.N, min_bytes=r.min_bytes, flops=r.flops,
                     bound_ms=r.bound_ms, bound_by=r.bound_by, input_sets=r.input_sets,
                     results=[dataclasses.asdict(m) for m in r.measurements])
        if entry["seqlens"] is not None:
            entry["seqlens"] = list(entry["seqlens"])
        shapes.append(entry)
    return {
        "command": command,
        "date": date or datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device,
        "versions": versions,
        "ceilings": ceilings,
        "settings": settings,
        "shapes": shapes,
    }


def json_safe(value):
    """``value`` with every NaN or infinity replaced by its name ("nan", "inf", "-inf").

    Strict JSON has no such numbers, and a NaN error column is a finding worth keeping.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_json(path: str, report: dict) -> None:
    """Write ``report`` (from :func:`build_report`) as strict JSON."""
    with open(path, "w") as f:
        json.dump(json_safe(report), f, indent=2, allow_nan=False)
        f.write("\n")


def command_line(argv: list[str]) -> str:
    """The command as typed: ``python -m gdn_dispatch ...`` when run as a module."""
    head = ["python", "-m", "gdn_dispatch"] if argv and argv[0].endswith("__main__.py") else argv[:1]
    return shlex.join(head + argv[1:])


def write_plot(path: str, report: dict) -> str | None:
    """A grouped bar chart of the fraction of SOL (bound / time) per shape and backend.

    Returns None when written, else a note saying why not (matplotlib missing, or nothing
    was timed); never raises for a missing matplotlib, so a run without it still finishes.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display on GPU hosts
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"--plot: matplotlib not importable ({exc}); no plot written"
    shape_names = [s["name"] for s in report["shapes"]]
    backends = list(dict.fromkeys(m["backend"] for s in report["shapes"] for m in s["results"]
                                  if m["ms"] is not None))
    if not backends:
        return "--plot: nothing was timed; no plot written"
    width = 0.8 / len(backends)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.1 * len(shape_names)), 4.5))
    for i, name in enumerate(backends):
        fractions = []
        for s in report["shapes"]:
            m = next((m for m in s["results"] if m["backend"] == name and m["ms"] is not None), None)
            fractions.append(0.0 if m is None else 1.0 / m["sol_ratio"])
        ax.bar([x + i * width for x in range(len(shape_names))], fractions, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(shape_names))])
    ax.set_xticklabels(shape_names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("fraction of speed of light (bound / time)")
    ax.set_title(f"chunk_gated_delta_rule on {report['device'].get('name', '?')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
