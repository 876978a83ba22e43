"""Context parallelism at the tensor-parallel shards: GPU time over segment counts and the
fused kernel's configuration in pass 2, to fit the planner's choices.

Usage (a CUDA machine, repository root): ``python benchmarks/cp_sweep.py [BACKEND]
[--segments 8,16,32,64] [--planner-only]`` (default gluon_sm90; ``--planner-only``: pass 2
in the planner's configuration alone). Inputs as ``cp_crossover.py`` (bf16, K = V = 128, one sequence of
32768 tokens, initial and final state, varlen with a host copy). For each shard (H/HV),
``context_parallel`` forced to 8, 16, 32 and 64 segments, and pass 2's (BV, warps) forced
to each configuration the fused kernel has (``state_output.CONFIGS``) against the one the
planner picks; GPU time of one call (a CUDA graph, median of 9 x 5 replays) and the
relative RMS error of o against the unsegmented call. Prints a markdown table last.
"""
import argparse
import sys
from unittest import mock

import torch

from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.backends.gluon_common import plan as plan_module
from gdn_dispatch.backends.gluon_common.state_output import CONFIGS
from gdn_dispatch.bench_host import graph_replay_us
from gdn_dispatch.testing import rel_rms_error

sys.path.insert(0, "benchmarks")
from cp_crossover import call_for  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("backend", nargs="?", default="gluon_sm90")
parser.add_argument("--segments", default="8,16,32,64", help="segment counts to force, comma-separated")
parser.add_argument("--planner-only", action="store_true", help="pass 2 in the planner's configuration only")
args = parser.parse_args()
BACKEND = args.backend
SHARDS = [(2, 4), (4, 8), (2, 8), (8, 16)]
SEGMENTS = tuple(int(s) for s in args.segments.split(","))


def timed(call, segments, config):
    """(ms, o) of the call with ``segments`` forced and pass 2 in ``config`` (None: the planner's)."""
    plan_module.clear_plan_cache()
    patch = (mock.patch.object(plan_module, "state_output_config", lambda *a, **k: config) if config
             else mock.patch.object(plan_module, "state_output_config", plan_module.state_output_config))
    with patch:
        run = lambda: chunk_gated_delta_rule(**call, context_parallel=segments, backend=BACKEND)  # noqa: E731
        o, _ = run()
        ms = graph_replay_us(run, replays=5, windows=9) / 1e3
    plan_module.clear_plan_cache()
    return ms, o


rows = ["| H/HV | segments | pass 2 (BV, warps) | ms | error vs off |", "| --- | ---: | --- | ---: | ---: |"]
for H, HV in SHARDS:
    call = call_for(H, HV, 1, 32768)
    o_off, _ = chunk_gated_delta_rule(**call, context_parallel="off", backend=BACKEND)
    off = graph_replay_us(lambda: chunk_gated_delta_rule(**call, context_parallel="off", backend=BACKEND),
                          replays=5, windows=9) / 1e3
    rows.append(f"| {H}/{HV} | off | - | {off:.3f} | 0 |")
    print(rows[-1], flush=True)
    for segments in SEGMENTS:
        for config in (None,) if args.planner_only else (None, *CONFIGS):
            try:
                ms, o = timed(call, segments, config)
                rows.append(f"| {H}/{HV} | {segments} | {config or 'planner'} | {ms:.3f} | "
                            f"{rel_rms_error(o.float(), o_off.float()):.1e} |")
            except Exception as exc:  # a configuration the kernel cannot take here
                rows.append(f"| {H}/{HV} | {segments} | {config} | {type(exc).__name__} | - |")
            print(rows[-1], flush=True)
print("\n".join(rows))
