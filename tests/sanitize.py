"""compute-sanitizer over a fixed set of calls per GPU backend (the sanitizer tier).

    python tests/sanitize.py [--tools memcheck,racecheck,synccheck] [--backends NAMES] [--build-flag M.NAME=V ...]

For every (backend, tool) pair a child process runs the calls below under
``compute-sanitizer --tool TOOL --report-api-errors no`` (the cuda-python probe's lookups of
driver symbols otherwise count as API errors) and the parent reads the tool's error summary.
The calls cover ragged tails and empty sequences (the first one too), grouped value heads,
both state layouts, K != V and the qk l2 norm, and per backend one call cut into segments
(context parallelism, and one in chained segments, whose programs wait on each other's
hand-overs: on gluon_sm90 its one-kernel build's warm chain, and a call on the pipeline's
chained passes too), one on a state pool read and written in place (a -1 index among them) and
one on the views of a fused projection; each is also checked against the reference (pool
rows too), so a run that is clean but wrong fails too. Every call runs :data:`REPEATS`
times, so that with the native layer on the tools also see the calls a route runs (the
child fails when none was routed). Prints a table (backend, tool, calls, errors, seconds) and exits
0 only when every tool reports 0 errors for every backend. Needs a CUDA GPU and
compute-sanitizer (on PATH, or under /usr/local/cuda/bin).

racecheck first runs ``tests/ws_racecheck_control.py``, a textbook warp-specialized
handoff: where it reports hazards there (the racecheck of the H200 image does: it does not
model mbarriers between ``gl.warp_specialize`` partitions), the warp-specialized kernels of
:data:`WARP_SPECIALIZED` are excluded from racecheck (named in the output) and left to
memcheck and synccheck; once racecheck passes the control, it checks them too.

The blocked chunk inverse's flags (``gluon_common.blocked_inverse.F16_OPERANDS``,
``HALF_TABLES``, ``DIAGONAL_SERIES``) are read by the kernels as globals, fixed in a process
at its first compile: every call runs them as shipped (fp16 products, fp16 tables, the
series); the tf32 inverse is sanitized by a run with ``--build-flag`` setting all three to 0.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

TOOLS = ("memcheck", "racecheck", "synccheck")
ROOT = Path(__file__).resolve().parents[1]

#: (lengths, H, HV, K, V, dtype, layout, l2[, extras]) per call; small, since racecheck is
#: slow. extras: "cp" (a forced segment count), "chain" (chained segments: the planner's
#: band over every program count, :data:`CHAIN_TUNING`; on gluon_sm90's one-kernel classes
#: the warm chain, ``warm_chain.WARM_CHAIN``, or, with "warm" False, the pipeline's passes),
#: "pick" (a picked plan, :data:`PICK_TUNING`; "gates" scales g: 40 forgets within a chunk,
#: so the warm chain runs, 0.002 keeps the state, so the pipeline does), "pool" (the pool's dtype: a pool
#: of N + 2 rows, one index -1, written back in place), "fused" (q, k, v, g, beta as views
#: of one projection), "ws" (gluon_sm90: calls whose state-output walk is warp-specialized,
#: as ``state_output.STATE_OUTPUT_WS`` plans by default; where racecheck fails its control
#: they are left out of it and the other calls take the one-warpgroup walk there),
#: "aux_t" (gluon_sm90: the warp-specialized path's fused kernel forming the chunk
#: inverses itself, ``fused.AUX_T``, as shipped, or, False, the T kernel forming them in a
#: launch of its own, for that call), "small_heads" (gluon_sm90: K or V of 64 on that path,
#: ``fused.SMALL_HEADS``, for that call), "early_o1" (gluon_sm90: that path's state chain
#: issuing the output's first product with P^T or, False, after the chain's update,
#: ``fused.EARLY_O1``, for that call), "state_scores" (gluon_sm90: under "aux_t", the
#: causal scores formed by that kernel's state partition, ``fused.STATE_SCORES``, as
#: shipped, or, False, by its aux partition, for that call).
CALLS = {
    "triton_generic": [
        ([1, 63, 65, 130, 0], 2, 4, 32, 48, "bfloat16", "kv", False),
        ([0, 65, 130], 2, 4, 32, 48, "bfloat16", "kv", False),
        ([15, 64, 0, 70], 4, 4, 96, 16, "float16", "vk", True),
        ([64, 1], 1, 2, 128, 32, "bfloat16", "vk", False),
        ([33, 100], 2, 2, 8, 8, "float32", "kv", True),
        ([300, 0, 129], 1, 2, 64, 64, "bfloat16", "vk", True, {"cp": 3}),
        ([700, 0, 129, 1000], 1, 4, 64, 64, "bfloat16", "vk", False, {"chain": True, "pool": "bfloat16"}),
        ([70, 1, 64], 2, 4, 64, 32, "bfloat16", "vk", False, {"pool": "bfloat16"}),
        ([65, 130], 2, 4, 32, 64, "bfloat16", "kv", True, {"fused": True}),
    ],
    "gluon_sm100": [
        ([1, 63, 65, 130, 0], 2, 4, 128, 128, "bfloat16", "kv", False),
        ([0, 65, 130], 2, 4, 128, 128, "bfloat16", "kv", False),
        ([15, 64, 0, 70], 2, 8, 64, 128, "float16", "vk", True),
        ([64, 129], 1, 2, 128, 64, "bfloat16", "vk", True),
        ([300, 0, 129], 1, 2, 128, 128, "bfloat16", "vk", True, {"cp": 3}),
        ([700, 0, 129, 1000], 1, 4, 128, 128, "bfloat16", "vk", False, {"chain": True, "pool": "bfloat16"}),
        ([70, 1, 64], 2, 4, 128, 64, "bfloat16", "kv", False, {"pool": "float32"}),
        ([65, 130], 2, 4, 64, 128, "bfloat16", "kv", True, {"fused": True}),
    ],
}
#: gluon_sm90: the same calls, and three with enough (sequence, v-head) pairs (3 x 128) to
#: take its warp-specialized path (the fused kernel forming the chunk inverses itself; with
#: the qk l2 norm, the normalized-rows kernel first; in fp16, normalized copies of q and k
#: first), that path's other builds (the extras), and segments at four value heads per key
#: head with the norm (each stage's own norm flag).
CALLS["gluon_sm90"] = CALLS["gluon_sm100"] + [
    ([65, 0, 130], 32, 128, 128, 128, "bfloat16", "vk", False),
    ([70, 1, 64], 32, 128, 128, 128, "float16", "kv", False, {"pool": "bfloat16"}),
    ([63, 1, 129], 32, 128, 128, 128, "bfloat16", "kv", True),
    ([1, 63, 65, 130, 0], 2, 4, 128, 128, "bfloat16", "kv", False, {"ws": True}),
    ([300, 0, 129], 1, 2, 128, 128, "float16", "vk", True, {"ws": True, "pool": "float32"}),
    ([300, 0, 129], 1, 2, 128, 128, "bfloat16", "kv", False, {"ws": True, "cp": 3}),
    ([65, 0, 130], 32, 128, 128, 128, "bfloat16", "vk", False, {"aux_t": False}),
    ([70, 1, 64], 32, 64, 128, 128, "bfloat16", "kv", True, {"state_scores": False, "pool": "float32"}),
    ([65, 0, 130], 32, 128, 64, 128, "bfloat16", "vk", False, {"small_heads": True, "aux_t": False}),
    ([63, 1, 129], 32, 64, 128, 64, "bfloat16", "kv", True, {"small_heads": True, "state_scores": False}),
    ([65, 1, 130], 32, 64, 64, 64, "bfloat16", "vk", True, {"small_heads": True}),
    ([1, 63, 130, 0], 32, 128, 128, 128, "float16", "vk", False, {"early_o1": False, "aux_t": False,
                                                                  "pool": "float32"}),
    ([65, 0, 129], 32, 64, 128, 128, "bfloat16", "kv", True, {"early_o1": True, "aux_t": True, "state_scores": True}),
    ([63, 1, 129], 32, 128, 128, 128, "float16", "vk", True),
    ([300, 0, 129], 1, 4, 64, 64, "bfloat16", "vk", True, {"cp": 3}),
    ([700, 0, 129, 1000], 1, 4, 128, 128, "bfloat16", "kv", False, {"chain": True, "warm": False}),
    ([700, 0, 129, 1000], 1, 4, 128, 128, "bfloat16", "vk", True, {"pick": True, "gates": 40.0, "pool": "float32"}),
    ([700, 0, 129, 1000], 1, 4, 128, 128, "float16", "kv", True, {"pick": True, "gates": 0.002}),
]
#: The planner's constants for a "chain" call: chained segments at any program count, two
#: segments on the longest sequence of segments as short as one chunk.
CHAIN_TUNING = dict(fill=0.0, chain_fill=float("inf"), chain_waves=1e-9, min_seg_chunks=1)
#: The same for a "pick" call: a picked plan (the census, then the warm chain or the
#: pipeline), at any sequence length.
PICK_TUNING = dict(fill=0.0, pick_fill=float("inf"), chain_waves=1e-9, min_seg_chunks=1, pick_min_chunks=1)
#: Runs of each call (a pool call from the same pool rows each time).
REPEATS = 3
TOL = {"float32": 1e-5, "bfloat16": 5e-3, "float16": 5e-3}
#: Kernels with ``gl.warp_specialize`` partitions that hand shared memory over through
#: mbarriers, per backend: racecheck judges them only where it passes the control.
WARP_SPECIALIZED = {"gluon_sm90": ("_fused_fwd_kernel",)}
CONTROL = Path(__file__).resolve().parent / "ws_racecheck_control.py"


def run_calls(backend: str, skip_ws: bool = False) -> int:
    """Child: run the backend's calls on the GPU; 1 when one is wrong. ``skip_ws``: leave
    out the "ws" calls."""
    import torch

    from gdn_dispatch import chunk_gated_delta_rule, context_parallel, native, reference
    from gdn_dispatch.contract import make_problem
    from gdn_dispatch.routes import ROUTE_CALLS
    from gdn_dispatch.testing import fused_projection_views, padded_pool, random_call, rel_rms_error

    status = 0
    if skip_ws:
        _walk_warp_specialized(False)
    for i, (lengths, H, HV, K, V, dtype, layout, l2, *more) in enumerate(CALLS[backend]):
        extras = more[0] if more else {}
        if extras.get("ws") and skip_ws:
            print(f"call {i}: {extras}: left out (racecheck fails its control)", flush=True)
            continue
        call = random_call(lengths=lengths, H=H, HV=HV, K=K, V=V, dtype=getattr(torch, dtype), device="cuda",
                           seed=i, state_layout=layout, normalize_qk=not l2)
        if "gates" in extras:
            call["g"] = call["g"] * extras["gates"]
        flags = dict(use_qk_l2norm_in_kernel=l2, output_final_state=True)
        ref_call, ours = dict(call), dict(call)
        if extras.get("fused"):
            ours.update(fused_projection_views(call))
        if "cp" in extras:
            ours["context_parallel"] = extras["cp"]
        pool = None
        if "pool" in extras:
            dims = (K, V) if layout == "kv" else (V, K)
            pool, idx, ref_call["initial_state"] = padded_pool(len(lengths), HV, dims, getattr(torch, extras["pool"]),
                                                               seed=i, device="cuda")
            live = idx >= 0
            before = pool.clone()
            ours.update(initial_state=pool, state_indices=idx, inplace_final_state=True)
        o_ref, ht_ref = reference.forward(make_problem(**ref_call, **flags))
        # Every call runs three times (a pool from the same rows each time): the second and
        # third go through the form's route and its call program (the first builds them), so
        # the tools see those.
        err = 0.0
        kept = context_parallel.TUNING
        _path_builds(extras)
        if extras.get("chain"):
            context_parallel.TUNING = context_parallel.CPTuning(**CHAIN_TUNING)
            assert context_parallel.plan_for_problem(make_problem(**ours, **flags), 132).chained
        if extras.get("pick"):
            context_parallel.TUNING = context_parallel.CPTuning(**PICK_TUNING)
            assert context_parallel.plan_for_problem(make_problem(**ours, **flags), 132).picked
        _warm_chain(extras.get("warm"))
        for _ in range(REPEATS):
            if pool is not None:
                pool.copy_(before)
            o, ht = chunk_gated_delta_rule(**ours, **flags, backend=backend)
            err = max(err, rel_rms_error(o, o_ref), rel_rms_error(ht, ht_ref))
        context_parallel.TUNING = kept
        _path_builds({})
        _warm_chain(None)
        if pool is not None:
            rows = idx[live].long()
            err = max(err, rel_rms_error(pool[rows].float(), ht_ref[live]))
            untouched = torch.ones(pool.shape[0], dtype=torch.bool, device="cuda")
            untouched[rows] = False
            err = max(err, 0.0 if torch.equal(pool[untouched], before[untouched]) else float("inf"))
        ok = err <= TOL[dtype]
        status |= not ok
        print(f"call {i}: lengths={lengths} H={H} HV={HV} K={K} V={V} {dtype} {layout} l2={l2} {extras}: "
              f"error {err:.2e} {'ok' if ok else 'WRONG'}", flush=True)
    torch.cuda.synchronize()
    routed = ROUTE_CALLS["taken"]
    print(f"routed calls: {routed}", flush=True)
    if native.for_calls() is not None and routed == 0:
        print("WRONG: the native layer is on but no call went through a route", flush=True)
        status = 1
    return status


def _warm_chain(on: bool | None) -> None:
    """Chained plans on gluon_sm90's one-kernel build (the warm chain) or on the pipeline's
    passes from the next call on; None: as shipped (the flag before the first call set it)."""
    from gdn_dispatch.backends.gluon_common import warm_chain
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache

    if not _WARM_SHIPPED:
        _WARM_SHIPPED.append(warm_chain.WARM_CHAIN)
    want = _WARM_SHIPPED[0] if on is None else on
    if warm_chain.WARM_CHAIN != want:
        warm_chain.WARM_CHAIN = want
        clear_plan_cache()


#: ``warm_chain.WARM_CHAIN`` as shipped, kept by the first :func:`_warm_chain`.
_WARM_SHIPPED: list = []


def _walk_warp_specialized(on: bool) -> None:
    """Plan the state-output walk warp-specialized (the default) or not from the next call on."""
    from gdn_dispatch.backends.gluon_common import state_output
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache

    state_output.STATE_OUTPUT_WS = on
    clear_plan_cache()


#: A call's extras -> the gluon_sm90.fused build flag each one sets for it (on, or off
#: where the extra is False: the path's builds besides the shipped one).
PATH_BUILDS = {"aux_t": "AUX_T", "small_heads": "SMALL_HEADS", "early_o1": "EARLY_O1", "state_scores": "STATE_SCORES"}
#: Those flags as the module had them before the first call set any (the shipped builds,
#: which every other call runs), filled by :func:`_path_builds`.
_PATH_DEFAULTS: dict = {}


def _path_builds(extras: dict) -> None:
    """Plan gluon_sm90's warp-specialized path with the builds a call's ``extras`` name,
    as they name them (:data:`PATH_BUILDS`: the chunk inverses formed in its fused kernel,
    K or V of 64 on it, the state chain's early output product, the state's scores) and
    the defaults for the others, from the next call on."""
    from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
    from gdn_dispatch.backends.gluon_sm90 import fused

    if not _PATH_DEFAULTS:
        _PATH_DEFAULTS.update((flag, getattr(fused, flag)) for flag in PATH_BUILDS.values())
    wanted = {flag: bool(extras[name]) if name in extras else _PATH_DEFAULTS[flag]
              for name, flag in PATH_BUILDS.items()}
    if any(getattr(fused, flag) != on for flag, on in wanted.items()):
        for flag, on in wanted.items():
            setattr(fused, flag, on)
        clear_plan_cache()


def sanitizer_binary() -> str:
    found = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not Path(found).exists():
        raise SystemExit("tests/sanitize.py: compute-sanitizer not found on PATH or in /usr/local/cuda/bin")
    return found


def _run_tool(tool: str, script: list[str], exclude: tuple[str, ...] = ()) -> tuple[int | None, int, float, str]:
    """(errors the tool reported or None if it printed no summary, the script's exit code,
    seconds, output) of ``script`` (python arguments) under ``tool``, without the kernels
    named in ``exclude``."""
    cmd = [sanitizer_binary(), "--tool", tool, "--report-api-errors", "no"]
    for name in exclude:
        cmd += ["--kernel-name-exclude", f"kns={name}"]
    cmd += [sys.executable, *script]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("TRITON_INTERPRET", None)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    seconds = time.perf_counter() - start
    out = done.stdout + done.stderr
    # memcheck and synccheck end with "ERROR SUMMARY: N errors"; racecheck with
    # "RACECHECK SUMMARY: N hazards displayed (E errors, W warnings)".
    found = re.search(r"ERROR SUMMARY: (\d+) error", out) or re.search(r"RACECHECK SUMMARY: .*\((\d+) error", out)
    return (int(found.group(1)) if found else None), done.returncode, seconds, out


def sanitize(backend: str, tool: str, exclude: tuple[str, ...] = (),
             build_flags: tuple[str, ...] = ()) -> tuple[int | None, int, float, str]:
    """:func:`_run_tool` over the backend's calls (the ``--child`` run, with
    ``build_flags`` set in it); with kernels excluded, without the warp-specialized
    state-output walk too (its kernel shares its name with the one-warpgroup walk's): the
    "ws" calls left out, the others on the one-warpgroup walk."""
    flags = [arg for flag in build_flags for arg in ("--build-flag", flag)]
    return _run_tool(tool, [str(Path(__file__).resolve()), "--child", backend, *flags]
                     + (["--skip-ws"] if exclude else []), exclude)


def racecheck_orders_partitions() -> bool:
    """Whether racecheck passes :data:`CONTROL` (0 hazards); raises when the control's own
    result is wrong or racecheck printed no summary."""
    errors, code, seconds, out = _run_tool("racecheck", [str(CONTROL)])
    if errors is None or code != 0:
        raise SystemExit(f"tests/sanitize.py: the racecheck control failed (exit {code}):\n" + out[-3000:])
    print(f"racecheck control ({CONTROL.name}): {errors} hazards ({seconds:.0f} s)", flush=True)
    return errors == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/sanitize.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", default=",".join(TOOLS), help=f"comma-separated, from {', '.join(TOOLS)}")
    parser.add_argument("--backends", default=None, help="comma-separated GPU backends (default: those this GPU runs)")
    parser.add_argument("--child", metavar="BACKEND", help=argparse.SUPPRESS)
    parser.add_argument("--skip-ws", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--build-flag", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="a kernel build flag under gdn_dispatch.backends set in every child, e.g. "
                             "gluon_common.blocked_inverse.F16_OPERANDS=0")
    args = parser.parse_args(argv)
    if args.child:
        if args.build_flag:
            from gdn_dispatch.testing import set_build_flags

            set_build_flags(args.build_flag)
        return run_calls(args.child, args.skip_ws)

    tools = [t for t in args.tools.split(",") if t]
    for t in tools:
        if t not in TOOLS:
            parser.error(f"--tools: expected names from {', '.join(TOOLS)}, got {t!r}")
    import torch

    if not torch.cuda.is_available():
        print("tests/sanitize.py: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.backends:
        backends = [b for b in args.backends.split(",") if b]
        for b in backends:
            if b not in CALLS:
                parser.error(f"--backends: expected names from {', '.join(CALLS)}, got {b!r}")
    else:
        cap = torch.cuda.get_device_capability()
        backends = ["triton_generic"] + (["gluon_sm90"] if cap == (9, 0) else []) + \
            (["gluon_sm100"] if cap in ((10, 0), (10, 3)) else [])

    rows, status = [], 0
    unjudged = ()
    if "racecheck" in tools and any(WARP_SPECIALIZED.get(b) for b in backends) and not racecheck_orders_partitions():
        unjudged = tuple(name for b in backends for name in WARP_SPECIALIZED.get(b, ()))
        print(f"racecheck leaves {', '.join(unjudged)} to memcheck and synccheck: it reports hazards in the "
              f"control", flush=True)
    for backend in backends:
        for tool in tools:
            exclude = WARP_SPECIALIZED.get(backend, ()) if tool == "racecheck" and unjudged else ()
            errors, code, seconds, out = sanitize(backend, tool, exclude, tuple(args.build_flag))
            clean = errors == 0 and code == 0
            status |= not clean
            rows.append((backend, tool + ("*" if exclude else ""), len(CALLS[backend]),
                         "?" if errors is None else str(errors), code, seconds))
            print(f"{backend} {tool}: {'clean' if clean else 'FAILED'} ({seconds:.0f} s)", flush=True)
            if not clean:
                print("\n".join(out.splitlines()[-60:]))
    print(f"\n{'backend':<16} {'tool':<10} {'calls':>5} {'errors':>6} {'exit':>4} {'seconds':>8}")
    for backend, tool, calls, errors, code, seconds in rows:
        print(f"{backend:<16} {tool:<10} {calls:>5} {errors:>6} {code:>4} {seconds:>8.1f}")
    if unjudged:
        print(f"* without {', '.join(unjudged)} (racecheck fails its control: {CONTROL.name})")
    return status


if __name__ == "__main__":
    sys.exit(main())
