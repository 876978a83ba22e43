"""Per-partition phase cycles of gluon_sm90's warp-specialized kernels, from Proton's
intra-kernel profiler.

    python benchmarks/partition_profile.py [--shape NAME ...] [--ws-walk] [--t-kernel | --aux-scores] [--late-o1]
                                           [--build-flag MODULE.NAME=VALUE ...] [--out DIR]

Each shape is one public gluon_sm90 call (bf16, K = V = 128, initial + final state; the
bench's gates) run once under a Proton session in instrumentation mode. Its kernels then
compile with the phases of ``gdn_dispatch.backends.gluon_common.scopes`` recorded: every
warp's cycles in each ``partition.phase`` of the warp-specialized path's fused kernel
(``state.*``, ``aux.*``) and of the warp-specialized state-output walk (``chain.*``,
``output.*``; shipped on, ``state_output.STATE_OUTPUT_WS``, which ``--ws-walk`` sets in a
build that turned it off). As
shipped the fused kernel forms the chunk inverses in its aux partition (``fused.AUX_T``;
``aux.inverse`` is one of its phases) and its state partition the causal scores
(``fused.STATE_SCORES``, ``state.scores``); with ``--t-kernel`` the T kernel forms the
inverses in a launch of its own (``fused.AUX_T`` off), with ``--aux-scores`` the aux
partition forms the scores (``fused.STATE_SCORES`` off), with ``--late-o1`` the state chain
issues the output's first product after the update (``fused.EARLY_O1`` off). The
profile is written to ``DIR/NAME.hatchet`` and every phase printed with its metrics as
Proton reports them (``cycles``: summed over every warp of every program that ran the
phase; ``normalized_cycles``: that sum over all the kernel's warps, whichever partition
they are in), then per warp of its partition and per chunk step (the sum over the
partition's warps and over every (chunk, v-head, value block) the kernel walked), and
each partition's loop: its ``PARTITION.walk`` (recorded once around its loop) beside the
sum of the phases within it, what they miss the difference; else its top-level phases
summed.
The record buffer is sized for every event of the walk (:func:`buffer_bytes`): Proton's
default keeps a warp's last 2,048 and drops the first, which cut the aux partition's
record of a 128-chunk walk to its last 93 chunks.

Shapes: ``H16-HV32-4x8192`` (the fused kernel), ``H16-HV32-1x32768`` (the pipeline: the
walk at BV = 32), ``H2-HV4-1x32768`` (context parallelism's pass 2 at
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

#: name -> (H, HV, lengths or (B, T), value block of the kernel profiled: the fused kernel's
#: whole V, the walk's BV).
SHAPES = {"H16-HV32-4x8192": (16, 32, (4, 8192), 128), "H16-HV32-1x32768": (16, 32, [32768], 32),
          "H2-HV4-1x32768": (2, 4, [32768], 64)}
#: The shape whose call is the fused kernel (the others run the walk).
FUSED_SHAPE = "H16-HV32-4x8192"
CHUNK = 64
V = 128
#: Events a warp records per chunk at most: an enter and a leave of each of its partition's
#: phases (the aux partition's eleven are the most), with room to spare.
EVENTS_PER_CHUNK = 32
#: Bytes of one Proton record.
EVENT_BYTES = 8
def buffer_bytes(chunks: int, warps: int) -> int:
    """Proton's record buffer of one program of ``warps`` warps for a walk of ``chunks``
    chunks: split evenly between its warps (each share a power of two, as Proton requires),
    every warp's every event kept."""
    need = chunks * EVENTS_PER_CHUNK * EVENT_BYTES
    return warps << (need - 1).bit_length()


def partition_warps(kernel_walk: bool, block_v: int) -> dict[str, int]:
    """Warps of each partition (the prefix of its phases) of the kernel profiled: the fused
    kernel's state and aux, or the warp-specialized walk's chain and its output partitions
    (their ``output.*`` records summed over all of them)."""
    from gdn_dispatch.backends.gluon_common import state_output_ws
    from gdn_dispatch.backends.gluon_sm90 import fused

    if kernel_walk:
        outputs = state_output_ws.output_partitions(block_v, False)
        return {"chain": 4, "output": outputs * state_output_ws.OUTPUT_WARPS.value}
    return {"state": fused.state_warps(V), "aux": fused.AUX_WARPS.value}


def chunk_steps(name: str) -> int:
    """(chunk, v-head, value block) steps the profiled kernel walks in all: a segmented
    call walks the same chunks, cut between more programs."""
    H, HV, tokens, block_v = SHAPES[name]
    lengths = [tokens[1]] * tokens[0] if isinstance(tokens, tuple) else tokens
    return sum(-(-n // CHUNK) for n in lengths) * HV * (V // block_v)


def make_call(name: str) -> dict:
    from gdn_dispatch.testing import random_call

    H, HV, tokens, _ = SHAPES[name]
    shape = dict(batch=tokens) if isinstance(tokens, tuple) else dict(lengths=tokens)
    call = random_call(**shape, H=H, HV=HV, K=128, V=V, dtype=torch.bfloat16, device="cuda", seed=3)
    call["output_final_state"] = True
    return call


def walk_chunks(call: dict) -> int:
    """Chunks one program of ``call`` (:func:`make_call`) walks: its sequence's, or its
    segment's where the call is cut into segments (the planner's decision on this GPU)."""
    from gdn_dispatch.context_parallel import plan_for_problem
    from gdn_dispatch.contract import make_problem

    problem = make_problem(**call)
    cp = plan_for_problem(problem, torch.cuda.get_device_properties(0).multi_processor_count)
    # Every shape here is one sequence per batch row (T tokens each).
    return -(-(cp.seg_len if cp.enabled else problem.T) // CHUNK)


def _is_phase(name: str) -> bool:
    return "." in name


def phases(tree, *, depth: int | None = None) -> list[tuple[str, dict]]:
    """(name, numeric metrics) of every node of a hatchet tree whose frame name is a
    ``partition.phase`` (the format's other nodes, the kernel and its roots, left out);
    with ``depth`` only those with that many phases above them (0: the top level)."""
    out = []
    stack = [(node, 0) for node in (tree if isinstance(tree, list) else [tree])]
    while stack:
        node, above = stack.pop()
        if not isinstance(node, dict):
            continue
        name = (node.get("frame") or {}).get("name", "")
        metrics = {k: v for k, v in (node.get("metrics") or {}).items() if isinstance(v, (int, float))}
        if _is_phase(name) and metrics and depth in (None, above):
            out.append((name, metrics))
        stack.extend((child, above + _is_phase(name)) for child in node.get("children") or [])
    return sorted(out)


def per_warp_and_step(found: list[tuple[str, dict]], warps: dict[str, int], steps: int) -> dict[str, float]:
    """Each phase's ``cycles`` per warp of its partition and per chunk step."""
    out = {}
    for name, metrics in found:
        partition = name.split(".", 1)[0]
        if partition not in warps:
            raise ValueError(f"phase {name!r}: no partition {partition!r} in {sorted(warps)}")
        out[name] = metrics.get("cycles", 0) / (warps[partition] * steps)
    return out


def partition_loops(tree, warps: dict[str, int], steps: int) -> dict[str, tuple[float, float]]:
    """Each partition's loop per warp and chunk step, and the share of it its phases record:
    with a ``PARTITION.walk`` phase (the whole walk, recorded once) that and the sum of the
    phases within it; else the sum of its top-level phases, twice."""
    top = per_warp_and_step(phases(tree, depth=0), warps, steps)
    inner = per_warp_and_step(phases(tree, depth=1), warps, steps)
    loops = {}
    for partition in warps:
        walk = top.get(f"{partition}.walk")
        recorded = sum(v for name, v in (inner if walk is not None else top).items()
                       if name.split(".", 1)[0] == partition)
        loops[partition] = (recorded if walk is None else walk, recorded)
    return loops


def profile(name: str, call: dict, out_dir: Path, buffer_size: int):
    """``call`` run once under Proton's instrumentation (a record buffer of ``buffer_size``
    bytes a program, :func:`buffer_bytes`); its hatchet tree, also written to
    ``out_dir / name``."""
    import triton.profiler as proton

    from gdn_dispatch import chunk_gated_delta_rule

    chunk_gated_delta_rule(**call, backend="gluon_sm90")  # compiles the plain kernels and plans
    torch.cuda.synchronize()
    path = out_dir / name
    mode = proton.mode.Default(buffer_type="global", buffer_size=buffer_size)
    proton.start(str(path), backend="instrumentation", mode=mode)
    chunk_gated_delta_rule(**call, backend="gluon_sm90")
    torch.cuda.synchronize()
    proton.finalize()
    return json.loads(path.with_suffix(".hatchet").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", action="append", choices=sorted(SHAPES), help="default: every shape")
    parser.add_argument("--ws-walk", action="store_true", help="the state-output walk warp-specialized (as shipped)")
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
        call = make_call(name)
        chunks = walk_chunks(call)
        warps = partition_warps(name != FUSED_SHAPE, SHAPES[name][3])
        tree = profile(name, call, out_dir, buffer_bytes(chunks, sum(warps.values())))
        del call  # the next shape's inputs take its place
        found = phases(tree)
        steps = chunk_steps(name)
        flags = "".join(f" (--{name})" for name, on in (("ws-walk", args.ws_walk), ("t-kernel", args.t_kernel),
                                                          ("aux-scores", args.aux_scores),
                                                          ("late-o1", args.late_o1)) if on)
        flags += "".join(f" (--build-flag {setting})" for setting in args.build_flag)
        print(f"\n{name}{flags}: {len(found)} phases, {chunks} chunks per walk")
        if not found:
            print("  (no partition.phase scopes in the profile: was the kernel instrumented?)")
        keys = sorted({k for _, m in found for k in m})
        each = per_warp_and_step(found, warps, steps)
        print("| phase | " + " | ".join(keys) + " | cycles per warp and chunk step |")
        for phase, metrics in found:
            cells = " | ".join(f"{metrics.get(k, 0):.4g}" for k in keys)
            print(f"| {phase} | {cells} | {each[phase]:,.0f} |")
        loops = partition_loops(tree, warps, steps)
        print(f"loop per warp and chunk step ({steps:,} steps; " + ", ".join(
            f"{p}: {w} warps" for p, w in warps.items()) + "): " + ", ".join(
            f"{p} {loop:,.0f} (its phases {recorded:,.0f})" for p, (loop, recorded) in loops.items()))


if __name__ == "__main__":
    main()
