"""Per-partition phase cycles of gluon_sm90's warp-specialized kernels, from Proton's
intra-kernel profiler.

    python benchmarks/partition_profile.py [--shape NAME ...] [--ws-walk] [--t-kernel | --aux-scores] [--late-o1]
                                           [--build-flag MODULE.NAME=VALUE ...] [--out DIR]

Each shape is one public gluon_sm90 call (bf16, K = V = 128, initial + final state; the
bench's gates) run once under a Proton session in instrumentation mode. Its kernels then
compile with the phases of ``gdn_dispatch.backends.gluon_common.scopes`` recorded: every
warp's cycles in each ``partition.phase`` of the warp-specialized path's fused kernel
(``state.*``, ``aux.*``) and of the warp-specialized state-output walk (``chain.*``,
``output.*``; taken with ``--ws-walk``, which sets ``state_output.STATE_OUTPUT_WS``). As
shipped the fused kernel forms the chunk inverses in its aux partition (``fused.AUX_T``;
``aux.inverse`` is one of its phases) and its state partition the causal scores
(``fused.STATE_SCORES``, ``state.scores``); with ``--t-kernel`` the T kernel forms the
inverses in a launch of its own (``fused.AUX_T`` off), with ``--aux-scores`` the aux
partition forms the scores (``fused.STATE_SCORES`` off), with ``--late-o1`` the state chain
issues the output's first product after the update (``fused.EARLY_O1`` off). The
profile is written to ``DIR/NAME.hatchet`` and every phase printed with its metrics as
Proton reports them (its cycle counts are per warp, averaged over warps and programs), and
per chunk of the program's walk.

Shapes: ``H16-HV32-4x8192`` (the fused kernel), ``H16-HV32-1x32768`` (the pipeline: the
walk at BV = 32 with ``--ws-walk``), ``H2-HV4-1x32768`` (context parallelism's pass 2 at
BV = 64). Every launch goes through Triton's JIT here (``GDN_DISPATCH_JIT_LAUNCH=1``, the
native layer off), so that Proton's launch hook hands each instrumented kernel its buffer.
The records cost cycles of their own (ptxas keeps a few more bytes in local memory): read
the shares between phases, not the kernels' times (those come from ``bench`` and
``flag_ab.py``).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

#: name -> (H, HV, lengths or (B, T)).
SHAPES = {"H16-HV32-4x8192": (16, 32, (4, 8192)), "H16-HV32-1x32768": (16, 32, [32768]),
          "H2-HV4-1x32768": (2, 4, [32768])}
CHUNK = 64


def make_call(name: str) -> dict:
    from gdn_dispatch.testing import random_call

    H, HV, tokens = SHAPES[name]
    shape = dict(batch=tokens) if isinstance(tokens, tuple) else dict(lengths=tokens)
    call = random_call(**shape, H=H, HV=HV, K=128, V=128, dtype=torch.bfloat16, device="cuda", seed=3)
    call["output_final_state"] = True
    return call


def walk_chunks(name: str) -> int:
    """Chunks one program walks: its sequence's, or its segment's where the call is cut
    into segments (the planner's decision on this GPU)."""
    from gdn_dispatch.context_parallel import plan_for_problem
    from gdn_dispatch.contract import make_problem

    call = make_call(name)
    problem = make_problem(**call)
    cp = plan_for_problem(problem, torch.cuda.get_device_properties(0).multi_processor_count)
    # Every shape here is one sequence per batch row (T tokens each).
    return -(-(cp.seg_len if cp.enabled else problem.T) // CHUNK)


def phases(tree) -> list[tuple[str, dict]]:
    """(name, numeric metrics) of every node of a hatchet tree whose frame name is a
    ``partition.phase`` (the format's other nodes, the kernel and its roots, left out)."""
    out = []
    stack = list(tree) if isinstance(tree, list) else [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        name = (node.get("frame") or {}).get("name", "")
        metrics = {k: v for k, v in (node.get("metrics") or {}).items() if isinstance(v, (int, float))}
        if "." in name and metrics:
            out.append((name, metrics))
        stack.extend(node.get("children") or [])
    return sorted(out)


def profile(name: str, out_dir: Path) -> list[tuple[str, dict]]:
    import triton.profiler as proton

    from gdn_dispatch import chunk_gated_delta_rule

    call = make_call(name)
    chunk_gated_delta_rule(**call, backend="gluon_sm90")  # compiles the plain kernels and plans
    torch.cuda.synchronize()
    path = out_dir / name
    proton.start(str(path), backend="instrumentation", mode=proton.mode.Default(buffer_type="global"))
    chunk_gated_delta_rule(**call, backend="gluon_sm90")
    torch.cuda.synchronize()
    proton.finalize()
    return phases(json.loads(path.with_suffix(".hatchet").read_text()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: every shape")
    parser.add_argument("--ws-walk", action="store_true", help="the state-output walk warp-specialized")
    parser.add_argument("--t-kernel", action="store_true", help="the T kernel forms the chunk inverses (two launches)")
    parser.add_argument("--aux-scores", action="store_true", help="the aux partition forms the causal scores")
    parser.add_argument("--late-o1", action="store_true", help="the fused kernel's output product issued after the update")
    parser.add_argument("--build-flag", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="a kernel build flag (gdn_dispatch.testing.set_build_flags), e.g. "
                             "gluon_sm90.fused.SCORES_BEHIND_V_NEW=0: the state's scores between P^T and v_new^T")
    parser.add_argument("--out", default="partition_profile", help="directory of the hatchet files")
    args = parser.parse_args()
    if args.build_flag:
        from gdn_dispatch.testing import set_build_flags

        set_build_flags(args.build_flag)
    if args.aux_scores and args.t_kernel:
        parser.error("--aux-scores: the state forms the scores in the one-launch build only (not with --t-kernel)")
    # Before the first launch (both are read at launch): every launch through the JIT and
    # its hooks.
    os.environ["GDN_DISPATCH_JIT_LAUNCH"] = "1"
    os.environ["GDN_DISPATCH_NATIVE"] = "0"
    if args.ws_walk:
        from gdn_dispatch.backends.gluon_common import state_output

        state_output.STATE_OUTPUT_WS = True
    if args.t_kernel or args.aux_scores or args.late_o1:
        from gdn_dispatch.backends.gluon_sm90 import fused

        fused.AUX_T = fused.AUX_T and not args.t_kernel
        fused.EARLY_O1 = fused.EARLY_O1 and not args.late_o1
        fused.STATE_SCORES = fused.STATE_SCORES and not args.aux_scores
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.shape or list(SHAPES):
        chunks = walk_chunks(name)
        found = profile(name, out_dir)
        flags = "".join(f" (--{name})" for name, on in (("ws-walk", args.ws_walk), ("t-kernel", args.t_kernel),
                                                          ("aux-scores", args.aux_scores),
                                                          ("late-o1", args.late_o1)) if on)
        flags += "".join(f" (--build-flag {setting})" for setting in args.build_flag)
        print(f"\n{name}{flags}: {len(found)} phases, {chunks} chunks per walk")
        if not found:
            print("  (no partition.phase scopes in the profile: was the kernel instrumented?)")
        keys = sorted({k for _, m in found for k in m})
        print("| phase | " + " | ".join(keys) + " | per chunk (" + (keys[0] if keys else "-") + ") |")
        for phase, metrics in found:
            first = metrics.get(keys[0], 0) if keys else 0
            cells = " | ".join(f"{metrics.get(k, 0):.4g}" for k in keys)
            print(f"| {phase} | {cells} | {first / chunks:.4g} |")


if __name__ == "__main__":
    main()
