"""One public gluon_sm90 call for Nsight Compute: warm-up calls first, then a single call
inside the profiler's range, so that ``--profile-from-start off`` sees each kernel once.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis_Tables --section SourceCounters \\
        python benchmarks/ncu_call.py --batch 4 8192 [--with t_block_tma:off]

``--with STUDY:ARM`` sets a :mod:`flag_ab` study's flag to its "off" or "on" value first.
"""
import argparse
import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", nargs=2, type=int, default=(4, 8192), metavar=("B", "T"))
    parser.add_argument("--heads", nargs=2, type=int, default=(16, 32), metavar=("H", "HV"))
    parser.add_argument("--with", dest="flags", action="append", default=[], metavar="STUDY:ARM")
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    from flag_ab import STUDIES

    for spec in args.flags:
        study, _, arm = spec.partition(":")
        if study not in STUDIES or arm not in ("off", "on"):
            parser.error(f"--with: expected STUDY:off or STUDY:on with STUDY in {sorted(STUDIES)}, got {spec!r}")
        module, flag, values, _ = STUDIES[study]
        setattr(importlib.import_module(module), flag, values[arm == "on"])

    from gdn_dispatch import chunk_gated_delta_rule
    from gdn_dispatch.testing import random_call

    call = random_call(batch=tuple(args.batch), H=args.heads[0], HV=args.heads[1], K=128, V=128, device="cuda",
                       seed=0)
    call["output_final_state"] = True
    for _ in range(args.warmup):
        chunk_gated_delta_rule(**call, backend="gluon_sm90")
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    chunk_gated_delta_rule(**call, backend="gluon_sm90")
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
