"""benchmarks/ncu_lines.py's reading of Nsight Compute's source-page CSV (no GPU): source
lines with their SASS rows, samples grouped by how often each instruction ran."""

from __future__ import annotations

import csv
import random
from pathlib import Path

from gdn_dispatch.testing import script_module

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ncu_lines.py"

HEADER = ["Line No", "Source", "Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "# Samples", "Instructions Executed",
          "stall_long_sb", "stall_short_sb", "stall_long_sb (Not Issued)"]


def _module():
    return script_module(SCRIPT, "ncu_lines_under_test")


def _sass_row(rng, address, instruction, executed):
    long_sb, short_sb = rng.randrange(1, 50), rng.randrange(1, 50)
    samples = long_sb + short_sb + rng.randrange(0, 5)
    row = ["", "", address, f"      {instruction}", str(samples), "0", str(samples), str(executed),
           str(long_sb), str(short_sb), "7"]
    return row, samples, {"long_sb": long_sb, "short_sb": short_sb}


def test_lines_keep_their_sass_and_samples_group_by_executions(tmp_path):
    rng = random.Random(20261207)
    path = tmp_path / "source.csv"
    expected_groups = {}
    with open(path, "w", newline="") as f:
        out = csv.writer(f, quoting=csv.QUOTE_ALL)
        rows_written = []
        for file_name, lines in (("/a/fused.py", (12, 40)), ("/b/masks.py", (7,))):
            out.writerow(["File Path", file_name])
            out.writerow(["Function Name", "_kernel"])
            out.writerow(HEADER)
            for number in lines:
                sass = [_sass_row(rng, f"0x7f00{number:04x}{i:02x}", f"FADD R{i}, R1, R2", executed)
                        for i, executed in enumerate(rng.sample([1024, 65536, 131072], 2))]
                total = sum(samples for _, samples, _ in sass)
                out.writerow([str(number), f"x = {number}", "-", "-", str(total), "0", str(total), "-",
                              str(sum(s["long_sb"] for _, _, s in sass)),
                              str(sum(s["short_sb"] for _, _, s in sass)), "0"])
                out.writerow(["", "", "...", "...", "-", "-", "-", "-", "-", "-", "-"])
                for row, samples, stalls in sass:
                    out.writerow(row)
                    group = expected_groups.setdefault(int(row[7]), {"samples": 0, "long_sb": 0, "short_sb": 0})
                    group["samples"] += samples
                    group["long_sb"] += stalls["long_sb"]
                    group["short_sb"] += stalls["short_sb"]
                rows_written.append((f"{file_name.rsplit('/', 1)[-1]}:{number}", total, [r[3].strip() for r, _, _ in sass]))
    module = _module()
    lines = module.read(str(path))
    assert [(line.where, line.samples, [s[1] for s in line.sass]) for line in lines] == rows_written
    # The "Not Issued" copy of a reason is not read as the reason.
    assert all(set(line.stalls) <= {"long_sb", "short_sb"} for line in lines)
    groups = module.by_executions(lines)
    assert {executed: dict(counter) for executed, counter in groups.items()} == expected_groups
