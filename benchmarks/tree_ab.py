"""A/B of this checkout against another tree of the library (a change no flag turns
off), each arm in its own process, alternating; the same calls, timing and output
comparison as ``flag_ab.py``.

    git archive BASE | tar -x -C /tmp/base       # the other tree, e.g. the parent commit
    python benchmarks/tree_ab.py /tmp/base                    # the warp-specialized path's shapes
    python benchmarks/tree_ab.py /tmp/base --study aux_t      # flag_ab's shapes of a study
    python benchmarks/tree_ab.py /tmp/base --with aux_t       # a study's flag on in both arms

Arm ``base`` imports ``gdn_dispatch`` from the other tree, arm ``this`` from this
checkout; both time with this checkout's ``ab_timing``.
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
THIS_TREE = os.path.dirname(HERE)


def _arm(tree: str, tag: str, study: str, also: list[str], label: str) -> None:
    # The arm's tree first on the path, so that gdn_dispatch (and flag_ab's STUDIES
    # modules) resolve there; this folder after it for the timing helpers.
    sys.path[:0] = [tree, HERE]
    import flag_ab
    from ab_timing import run_variant

    for name in also:
        flag_ab.set_flag(name, "on")
    run_variant(label, tag, flag_ab.calls(_shapes(flag_ab, study)))


def _shapes(flag_ab, study: str | None) -> dict:
    if study:
        return flag_ab.STUDIES[study][3]
    return {name: flag_ab._WS_SHAPES[name] for name in ("H16-HV32-4x8192", "H16-HV32-ragged16", "H16-HV64-4x8192")}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="the other tree's root (holding gdn_dispatch/)")
    parser.add_argument("--study", help="time flag_ab's shapes of this study (default: the path's shapes)")
    parser.add_argument("--with", dest="also", default="", help="flag_ab studies whose flags are on in both arms")
    parser.add_argument("--arm", choices=("base", "this"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    base = os.path.abspath(args.base)
    if not os.path.isdir(os.path.join(base, "gdn_dispatch")):
        parser.error(f"base: {base} holds no gdn_dispatch/")
    also = [name for name in args.also.split(",") if name]
    label = "_".join(["tree_ab", args.study or "path"] + also)
    if args.arm:
        _arm(base if args.arm == "base" else THIS_TREE, args.arm, args.study, also, label)
        sys.exit(0)
    sys.path.insert(0, HERE)
    from ab_timing import compare_outputs
    import flag_ab

    print(f"| tree (base: {base}{'; with ' + ', '.join(also) + ' on' if also else ''}) | shape | call ms "
          "| enqueue µs | kernels ms |")
    for arm in ("base", "this", "base", "this"):
        cmd = [sys.executable, __file__, base, "--arm", arm] + (["--study", args.study] if args.study else []) \
            + (["--with", args.also] if also else [])
        run = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, cwd=THIS_TREE if arm == "this" else base)
        if run.returncode:
            sys.exit(f"the {arm} arm failed:\n" + "\n".join(run.stderr.splitlines()[-25:]))
    compare_outputs(label, list(_shapes(flag_ab, args.study)), "base", "this")
