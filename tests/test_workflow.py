"""The CI workflow cannot rot: every command it runs exists in this repository.

``.github/workflows/ci.yml`` is parsed and each ``run:`` line (for every matrix value) is
checked: pytest markers are declared in pyproject.toml and test paths exist, scripts
exist, ``python -m gdn_dispatch`` arguments parse with the CLI's own parser, pip extras
are declared. The matrices are checked against what the README promises: Python 3.10 and
3.12 by Triton 3.6.0 and newest, one compile job per target, GPU runners per architecture.
"""

from __future__ import annotations

import itertools
import re
import shlex
import sys
from pathlib import Path

import yaml  # PyYAML, in the test extra

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
MARKERS = {m.split(":")[0].strip() for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])
AOT_TARGETS = ["sm_80", "sm_86", "sm_89", "sm_90a", "sm_100a", "sm_103a", "sm_120"]


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _matrix_values(job: dict) -> list[dict]:
    """Every combination of the job's matrix (one empty combination without a matrix)."""
    matrix = dict(job.get("strategy", {}).get("matrix", {}))
    include = matrix.pop("include", [])
    matrix.pop("exclude", None)
    keys = list(matrix)
    combos = [dict(zip(keys, values)) for values in itertools.product(*(matrix[k] for k in keys))]
    return combos + list(include)


def _expand(text: str, values: dict) -> str:
    def value(m):
        name = m.group(1).strip()
        if name.startswith("matrix."):
            return str(values[name.removeprefix("matrix.")])
        return "EXPR"  # github.*, vars.*: not repository content
    return re.sub(r"\$\{\{(.*?)\}\}", value, text)


def commands() -> list[tuple[str, str, list[str]]]:
    """(job, step name, argv) of every command the workflow runs, per matrix value."""
    found = []
    for job_name, job in _workflow()["jobs"].items():
        for values in _matrix_values(job):
            for step in job["steps"]:
                if "run" not in step:
                    continue
                for line in _expand(step["run"], values).splitlines():
                    for part in line.split("&&"):
                        argv = shlex.split(part, comments=True)
                        if argv:
                            found.append((job_name, step.get("name", ""), argv))
    return found


def _marker_names(expression: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]\w*", expression)) - {"and", "or", "not"}


def check_pytest(args: list[str]) -> list[str]:
    """Problems with a pytest invocation's markers and paths."""
    problems, it = [], iter(args)
    for arg in it:
        if arg == "-m":
            unknown = _marker_names(next(it)) - MARKERS
            problems += [f"marker {m!r} not declared in pyproject.toml" for m in sorted(unknown)]
        elif arg in ("-k", "-n", "-p", "--maxfail", "--timeout"):
            next(it)
        elif not arg.startswith("-"):
            path = arg.split("::")[0]
            if not (ROOT / path).exists():
                problems.append(f"test path {path} does not exist")
    return problems


def check_cli(args: list[str]) -> list[str]:
    """Problems parsing ``python -m gdn_dispatch ARGS`` with the CLI's parser."""
    from gdn_dispatch.__main__ import build_parser

    try:
        build_parser().parse_args(args)
    except SystemExit as exc:
        if exc.code not in (0, None):  # --version and --help exit 0
            return [f"python -m gdn_dispatch {' '.join(args)}: the CLI rejects it (exit {exc.code})"]
    return []


def check_pip(args: list[str]) -> list[str]:
    problems = []
    for arg in args:
        m = re.fullmatch(r"\.\[(.+)\]", arg)
        if m:
            problems += [f"pip extra {e!r} not in pyproject.toml" for e in m.group(1).split(",") if e not in EXTRAS]
    return problems


def check_command(argv: list[str]) -> list[str]:
    """Problems with one command: what it names must exist in the repository."""
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        argv = argv[1:]  # VAR=value prefixes
    exe, args = Path(argv[0]).name, argv[1:]
    if "/" in argv[0] and not argv[0].startswith(".venv") and not (ROOT / argv[0]).exists():
        return [f"{argv[0]} does not exist"]
    if exe in ("pip", "pip3"):
        return check_pip(args)
    if exe in ("python", "python3"):
        if args[:2] == ["-m", "pytest"]:
            return check_pytest(args[2:])
        if args[:2] == ["-m", "gdn_dispatch"]:
            return check_cli(args[2:])
        if args[:2] == ["-m", "venv"]:
            return []
        if args and not args[0].startswith("-"):
            return [] if (ROOT / args[0]).is_file() else [f"script {args[0]} does not exist"]
        return [f"unchecked python invocation {argv}"]
    return [f"unknown command {exe!r}: teach tests/test_workflow.py how to check it"]


def test_every_command_exists():
    found = commands()
    assert found
    problems = [f"{job} / {step}: {p}" for job, step, argv in found for p in check_command(argv)]
    assert not problems, "\n".join(problems)


def test_checker_catches_rot():
    # Negative controls: each kind of rot is caught.
    assert check_command(["python", "-m", "pytest", "-m", "gpu and not nightly"]) == [
        "marker 'nightly' not declared in pyproject.toml"]
    assert check_command(["python", "-m", "pytest", "tests/test_gone.py"]) == ["test path tests/test_gone.py does not exist"]
    assert check_command(["python", "-m", "gdn_dispatch", "compile", "--target", "sm_100a", "--fast"])
    assert check_command(["python", "-m", "gdn_dispatch", "warp-speed"])
    assert check_command(["python", "tests/gone.py"]) == ["script tests/gone.py does not exist"]
    assert check_command(["pip", "install", "-e", ".[gpu]"]) == ["pip extra 'gpu' not in pyproject.toml"]
    assert check_command([".ci/gone"]) == [".ci/gone does not exist"]


def test_matrices():
    jobs = _workflow()["jobs"]
    cpu = jobs["cpu"]["strategy"]["matrix"]
    assert cpu["python"] == ["3.10", "3.12"] and cpu["triton"] == ["3.6.0", "newest"]
    assert jobs["aot"]["strategy"]["matrix"]["target"] == AOT_TARGETS
    gpu = jobs["gpu"]
    assert gpu["strategy"]["matrix"]["arch"] == ["sm80", "sm90", "sm100"]
    assert gpu["runs-on"] == ["self-hosted", "${{ matrix.arch }}"]


def _job_commands(job: str) -> list[str]:
    return [" ".join(argv) for name, _, argv in commands() if name == job]


def test_jobs_run_the_tiers():
    cpu = _job_commands("cpu")
    assert any(c.endswith("-m pytest -q") for c in cpu)
    assert any(c.endswith("-m pytest -q -m slow") for c in cpu)
    aot = _job_commands("aot")
    for target in AOT_TARGETS:
        assert f"python -m gdn_dispatch compile --target {target} --output compile-{target}.txt" in aot
    gpu = _job_commands("gpu")
    for tail in ("-m pytest -q -m gpu", "-m pytest -q -m gpu tests/test_fuzz.py", "-m gdn_dispatch selftest",
                 "tests/sanitize.py"):
        assert any(c.endswith(tail) for c in gpu), tail
    steps = _workflow()["jobs"]["aot"]["steps"]
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["with"]["path"] == "compile-${{ matrix.target }}.txt"
