"""A kernel build flag not shipped, through the GPU checks a flag passes before it ships, in one
run on a CUDA machine: the fused path's and the numerics' GPU tests, the differential fuzz's
gluon_sm90 cases, memcheck and synccheck (``tests/sanitize.py``), each in its own processes
with the study's flag on (and ``--with`` studies' flags) through ``--build-flag``; then the
timing A/B of :mod:`flag_ab` (the study off against on, the others on in both arms). A table of
the steps (passed / failed / ran out of time, seconds) comes last.

    python benchmarks/flag_gpu_check.py scores_behind_v_new
    python benchmarks/flag_gpu_check.py early_o1 --with fp16_inverse --steps tests,ab --log out.log

Studies and their flags are :data:`flag_ab.STUDIES` (and its :data:`flag_ab.GROUPS`, several
flags at once); a flag whose on value is not a bool or an int (``wy_inverse``) cannot be set
from the command line and is refused.
"""
import argparse
import subprocess
import sys
import time
from pathlib import Path

from flag_ab import GROUPS, STUDIES, members, repeated

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "gdn_dispatch.backends."


def build_flags(study: str) -> list[str]:
    """The ``--build-flag`` settings that turn ``study``'s flags on (a group's: each member's)."""
    settings = []
    for name in members(study):
        module, flag, (_, on), _ = STUDIES[name]
        value = getattr(on, "value", on)
        if not isinstance(value, int):
            raise SystemExit(f"{name}: its on value {value!r} is not a bool or an int")
        settings.append(f"{module.removeprefix(PREFIX)}.{flag}={int(value)}")
    return settings


def steps(study: str, also: list[str], workers: int) -> dict[str, list[str]]:
    flags = [arg for name in [study] + also for setting in build_flags(name) for arg in ("--build-flag", setting)]
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-n", str(workers)]
    ab = [sys.executable, "benchmarks/flag_ab.py", study] + (["--with", ",".join(also)] if also else [])
    return {"tests": pytest + flags + ["tests/test_gluon_fused.py", "tests/test_numerics.py"],
            "fuzz": pytest + flags + ["tests/test_fuzz.py", "-k", "gluon_sm90"],
            "sanitize": [sys.executable, "tests/sanitize.py", "--tools", "memcheck,synccheck", "--backends",
                         "gluon_sm90"] + flags,
            "ab": ab}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", choices=sorted(STUDIES) + sorted(GROUPS))
    parser.add_argument("--with", dest="also", default="", help="studies whose flags are on too (in both A/B arms)")
    parser.add_argument("--steps", default="tests,fuzz,sanitize,ab",
                        help="which of tests, fuzz, sanitize, ab, in order")
    parser.add_argument("--timeout", type=int, default=240, help="seconds a step may run (default 240)")
    parser.add_argument("--workers", type=int, default=8, help="pytest-xdist workers of the test steps (default 8)")
    parser.add_argument("--log", help="also write every step's output to this file")
    args = parser.parse_args()
    also = [name for name in args.also.split(",") if name]
    for name in also:
        if name not in STUDIES and name not in GROUPS or set(members(name)) & set(members(args.study)):
            parser.error(f"--with: {name!r} is not another study")
    if repeated(also):
        parser.error(f"--with names a flag twice: {repeated(also)}")
    commands = steps(args.study, also, args.workers)
    picked = [name for name in args.steps.split(",") if name]
    unknown = [name for name in picked if name not in commands]
    if unknown:
        parser.error(f"--steps: {unknown} not among {sorted(commands)}")
    log = open(args.log, "a") if args.log else None
    rows = []
    for name in picked:
        line = f"# {name}: {' '.join(commands[name])}"
        print(line, flush=True)
        start = time.monotonic()
        try:
            run = subprocess.run(commands[name], cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
            out, verdict = run.stdout + run.stderr, "passed" if run.returncode == 0 else f"failed (rc {run.returncode})"
        except subprocess.TimeoutExpired as err:
            out = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
            verdict = f"ran out of its {args.timeout} s"
        seconds = time.monotonic() - start
        tail = "\n".join(out.splitlines()[-30:])
        print(tail, flush=True)
        if log:
            log.write(f"{line}\n{out}\n")
            log.flush()
        rows.append((name, verdict, seconds))
    print(f"| {args.study}{' with ' + ', '.join(also) if also else ''} | verdict | s |")
    for name, verdict, seconds in rows:
        print(f"| {name} | {verdict} | {seconds:.0f} |")
    sys.exit(0 if all(verdict == "passed" for _, verdict, _ in rows) else 1)


if __name__ == "__main__":
    main()
