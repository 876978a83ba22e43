"""The context-parallel scan alone, in several forms of its step: error and GPU time.

Usage (a CUDA machine, repository root): ``python benchmarks/scan_variants.py``; with
``--cpu`` (under ``TRITON_INTERPRET=1``) it only checks the forms' numerics at a small size.

Each form is a ``segment_scan_fwd`` launch config: the whole M per step or M's column
blocks, the BV slice, warps and pipeline stages (M split as pass 1 stores it:
``segment_scan.split_maps``; the "bf16 split" forms as with ``segment_map.BF16_MAPS``).
Inputs: one sequence of ``NSEG`` segments of 64 tokens (plus the empty slot past its end),
K = V = 128, random contracting maps ``M`` (entries ``0.9 randn / sqrt(K)``) and random
``N``. The error is the relative RMS error of every segment start state against a float64
scan; the time is the GPU time per call (a CUDA graph of 10 calls, median of 15 replays).
Prints a markdown table last.
"""
import sys

import torch

from md_table import print_table
from gdn_dispatch.backends.triton_generic import segment_scan
from gdn_dispatch.backends.triton_generic.configs import LaunchConfig
from gdn_dispatch.testing import rel_rms_error

CPU = "--cpu" in sys.argv
DEVICE = "cpu" if CPU else "cuda"
K = V = 128
#: (name, config, M split in two bf16 parts as with ``segment_map.BF16_MAPS`` instead of
#: TF32-exact fp32 + bf16)
FORMS = [
    ("whole M, BV 16, 8 warps, 2 stages (sm_90 default)", LaunchConfig(num_warps=8, num_stages=2, BK=128, BV=16, BKC=128)),
    ("whole M, BV 16, 4 warps, 2 stages", LaunchConfig(num_warps=4, num_stages=2, BK=128, BV=16, BKC=128)),
    ("whole M, BV 8, 8 warps, 2 stages", LaunchConfig(num_warps=8, num_stages=2, BK=128, BV=8, BKC=128)),
    ("whole M, BV 8, 8 warps, 3 stages", LaunchConfig(num_warps=8, num_stages=3, BK=128, BV=8, BKC=128)),
    ("whole M, BV 16, 8 warps, 1 stage", LaunchConfig(num_warps=8, num_stages=1, BK=128, BV=16, BKC=128)),
    ("whole M, BV 32, 8 warps, 1 stage", LaunchConfig(num_warps=8, num_stages=1, BK=128, BV=32, BKC=128)),
    ("column blocks, BV 32, 8 warps (elsewhere)", LaunchConfig(num_warps=8, num_stages=1, BK=128, BV=32)),
    ("bf16 split: whole M, BV 16, 8 warps, 3 stages", LaunchConfig(num_warps=8, num_stages=3, BK=128, BV=16, BKC=128)),
    ("bf16 split: whole M, BV 8, 8 warps, 3 stages", LaunchConfig(num_warps=8, num_stages=3, BK=128, BV=8, BKC=128)),
    ("bf16 split: whole M, BV 8, 8 warps, 2 stages", LaunchConfig(num_warps=8, num_stages=2, BK=128, BV=8, BKC=128)),
]
SHAPES = [(2, 3)] if CPU else [(4, 16), (4, 32), (16, 8)]  # (HV, NSEG)


def maps(HV: int, NSEG: int):
    """``NSEG + 1`` slots of float64 maps (the last one is the empty slot past the end) and
    the one sequence's offsets, drawn on the device from torch's seeded generator."""
    m = 0.9 * torch.randn(NSEG + 1, HV, K, K, device=DEVICE, dtype=torch.float64) / K ** 0.5
    n = torch.randn(NSEG + 1, HV, K, V, device=DEVICE, dtype=torch.float64)
    return m, n, torch.tensor([0, NSEG * 64], device=DEVICE, dtype=torch.int32)


def scan64(m: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Every slot's start state, float64: ``S_0 = 0``, ``S_{s+1} = M_s S_s + N_s``."""
    s, starts = torch.zeros_like(n[0]), []
    for m_s, n_s in zip(m, n):
        starts.append(s)
        s = m_s @ s + n_s
    return torch.stack(starts)


def main() -> None:
    if not CPU:
        from gdn_dispatch.bench_host import graph_replay_us
    torch.manual_seed(0)
    rows = []
    for HV, NSEG in SHAPES:
        m64, n64, cu = maps(HV, NSEG)
        want = scan64(m64, n64)
        n = n64.float()
        for name, cfg in FORMS:
            m_hi, m_lo = segment_scan.split_maps(m64.float(), bf16=name.startswith("bf16 split"))
            try:
                seg_h0, _ = segment_scan.segment_scan_fwd(m_hi, m_lo, n, cu, 64, config=cfg)
                err = rel_rms_error(seg_h0.double(), want)
                us = None if CPU else graph_replay_us(
                    lambda: [segment_scan.segment_scan_fwd(m_hi, m_lo, n, cu, 64, config=cfg) for _ in range(10)],
                    replays=1, windows=15) / 10
                rows.append((HV, NSEG, name, f"{err:.2e}", "-" if us is None else f"{us:.1f}"))
            except Exception as exc:  # a form that does not compile here is a row, not a stop
                rows.append((HV, NSEG, name, "-", f"{type(exc).__name__}: {str(exc)[:60]}"))
            print(rows[-1], flush=True)
    print_table(["HV", "segments", "step form", "rel. error", "µs per call"], "rrlrr", rows)


if __name__ == "__main__":
    main()
