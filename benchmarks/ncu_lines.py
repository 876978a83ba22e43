"""Where a kernel's warps stall, by source line and by how often each instruction ran, from
Nsight Compute's source counters (no GPU needed to read them).

    ncu --clock-control none --profile-from-start off --section SourceCounters \\
        --section WarpStateStats --import-source yes -k regex:_fused_fwd -o fused \\
        python benchmarks/ncu_call.py --batch 4 8192
    ncu -i fused.ncu-rep --page source --csv --print-source cuda,sass > fused.csv
    python benchmarks/ncu_lines.py fused.csv [--top 30] [--line FILE:LINE ...]

The CSV holds, per source file, a row for each source line (its samples summed) followed
by its SASS rows. Printed: the warp stall samples by execution count (in a warp-specialized
kernel each partition's chunk loop runs its instructions a count of its own: e.g. chunks x
programs x the partition's warps) with their largest stall reasons, the ``--top`` source
lines, and the SASS rows of each ``--line`` with their samples and execution counts.
Line info names the innermost inlined function's line, not its caller.
"""
from __future__ import annotations

import argparse
import collections
import csv
from dataclasses import dataclass, field

#: Stall reasons as the CSV's columns name them (the "Not Issued" copies left out).
STALL_PREFIX = "stall_"


@dataclass
class Line:
    """One source line: where it is, its text, its samples and stall reasons, its SASS."""
    where: str
    text: str
    samples: int
    stalls: dict[str, int]
    sass: list[tuple[str, str, int, int, dict[str, int]]] = field(default_factory=list)


def _stalls(header: list[str], row: list[str]) -> dict[str, int]:
    return {name[len(STALL_PREFIX):]: int(value) for name, value in zip(header, row)
            if name.startswith(STALL_PREFIX) and "Not Issued" not in name and value.isdigit() and int(value)}


def read(path: str) -> list[Line]:
    """The source lines of an ``--page source --csv --print-source cuda,sass`` export, each
    with its SASS rows (address, instruction, samples, executions, stall reasons)."""
    lines: list[Line] = []
    where_file, header, current = None, None, None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "File Path":
                where_file = row[1].rsplit("/", 1)[-1]
            elif row[0] == "Line No":
                header = row
            elif row[0] == "Function Name" or header is None:
                continue
            elif row[0]:
                samples = int(row[4]) if row[4].isdigit() else 0
                current = Line(f"{where_file}:{row[0]}", row[1].strip(), samples, _stalls(header, row))
                lines.append(current)
            elif current is not None and row[2] != "..." and row[4].isdigit():
                executed = int(row[7]) if row[7].isdigit() else 0
                current.sass.append((row[2], row[3].strip(), int(row[4]), executed, _stalls(header, row)))
    return lines


def by_executions(lines: list[Line]) -> dict[int, collections.Counter]:
    """Samples and stall reasons of the SASS rows grouped by how many times each ran."""
    groups: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in lines:
        for _, _, samples, executed, stalls in line.sass:
            groups[executed]["samples"] += samples
            groups[executed].update(stalls)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", help="ncu -i REPORT --page source --csv --print-source cuda,sass output")
    parser.add_argument("--top", type=int, default=30, help="source lines to print (default 30)")
    parser.add_argument("--line", action="append", default=[], metavar="FILE:LINE",
                        help="print this source line's SASS rows (repeatable)")
    parser.add_argument("--min-share", type=float, default=0.02,
                        help="execution counts holding less than this share of the samples are left out")
    args = parser.parse_args()
    lines = read(args.csv)
    total = sum(line.samples for line in lines)
    if not total:
        parser.error(f"{args.csv}: no warp stall samples (was the SourceCounters section collected?)")
    print(f"{args.csv}: {total} warp stall samples on {len(lines)} source lines")
    print("by execution count (samples, share, top stall reasons):")
    for executed, counter in sorted(by_executions(lines).items(), key=lambda kv: -kv[1]["samples"]):
        if counter["samples"] < args.min_share * total:
            continue
        reasons = sorted(((r, n) for r, n in counter.items() if r != "samples"), key=lambda rn: -rn[1])[:4]
        top = ", ".join(f"{r} {100 * n / counter['samples']:.0f}%" for r, n in reasons)
        print(f"  {executed:>12,d} runs  {counter['samples']:7d}  {100 * counter['samples'] / total:5.1f}%  {top}")
    print(f"top {args.top} source lines (samples, share, top stall reasons):")
    for line in sorted(lines, key=lambda x: -x.samples)[:args.top]:
        top = ", ".join(f"{r} {n}" for r, n in sorted(line.stalls.items(), key=lambda rn: -rn[1])[:3])
        print(f"  {line.samples:7d} {100 * line.samples / total:5.1f}%  {line.where}  {line.text[:90]}  [{top}]")
    for wanted in args.line:
        matches = [line for line in lines if line.where == wanted]
        if not matches:
            parser.error(f"--line {wanted}: no such source line in {args.csv}")
        for line in matches:
            print(f"{line.where}: {line.text}")
            for address, instruction, samples, executed, _ in line.sass:
                print(f"  {address[-6:]}  {samples:6d}  {executed:>12,d} runs  {instruction}")


if __name__ == "__main__":
    main()
