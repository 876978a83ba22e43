"""The command line, run as a user would (in a subprocess, on the CPU)."""

import os
import subprocess
import sys

import pytest

from gdn_dispatch.registry import load_registry
from gdn_dispatch.testing import StandInProbe

ARCHS = ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_103", "sm_120", "cpu"]
#: The architectures --target and --assume accept, as their messages list them.
KNOWN = "sm_75, sm_80, sm_86, sm_87, sm_89, sm_90, sm_100, sm_103, sm_120, sm_121"


def cli(*args, env=None, check=True):
    full_env = {k: v for k, v in os.environ.items() if k not in ("GDN_BACKEND", "TRITON_INTERPRET")}
    full_env.update(env or {})
    done = subprocess.run([sys.executable, "-m", "gdn_dispatch", *args], capture_output=True, text=True,
                          env=full_env, timeout=600)
    if check and done.returncode != 0:
        raise AssertionError(f"exit {done.returncode}\nstdout:\n{done.stdout}\nstderr:\n{done.stderr}")
    return done


def test_info_on_this_machine():
    out = cli("info").stdout
    for pkg in ("torch", "triton", "cuda-python"):
        assert pkg in out
    assert "[cpu]" in out
    sections = out.split("\n[")[1:]
    assert sections and all(s.rstrip().splitlines()[-1].startswith("selected: ") for s in sections)


def test_info_assume_explains_every_architecture():
    args = [a for arch in ARCHS for a in ("--assume", arch)]
    out = cli("info", *args).stdout
    sections = out.split("\n[")[1:]
    assert len(sections) == len(ARCHS)
    names = [r.name for r in load_registry()]
    for arch, section in zip(ARCHS, sections):
        lines = section.rstrip().splitlines()
        assert lines[-1].startswith("selected: ") and lines[-1] != "selected: NONE", section
        for name in names:  # every row has a verdict line with a reason
            assert any(line.split()[:1] == [name] and len(line.split()) >= 3 for line in lines), (arch, name)
    assert "needs compute capability in {sm_100, sm_103}, device is sm_120" in out


def test_info_shows_override():
    out = cli("info", "--assume", "sm_90", env={"GDN_BACKEND": "reference"}).stdout
    assert "GDN_BACKEND    reference" in out
    assert "forced: reference" in out and out.rstrip().endswith("selected: reference")


def test_info_rejects_unknown_architecture():
    done = cli("info", "--assume", "volta", check=False)
    assert done.returncode != 0 and "expected 'cpu' or an architecture" in done.stderr


def test_run_on_cpu():
    out = cli("run", "--device", "cpu").stdout
    assert "backend    reference" in out
    assert "context    parallel off (no SM count on this device)" in out
    assert "launches" not in out  # the reference backend does not describe its launches
    assert "tokens/s" in out and "rel. RMS error" in out
    assert out.rstrip().endswith("PASS")


def test_run_prints_the_launches_a_backend_describes(monkeypatch, capsys):
    """A backend with ``describe_launches`` (the Gluon ones) gets a "launches" line: here
    the reference backend is given one."""
    import gdn_dispatch.reference as reference
    from gdn_dispatch.job import run_main_job

    monkeypatch.setattr(reference, "describe_launches", lambda problem, device: f"one pass on {device.kind}",
                        raising=False)
    assert run_main_job(device="cpu") == 0
    assert "launches   one pass on cpu" in capsys.readouterr().out.splitlines()


def test_compile_requires_target():
    done = cli("compile", check=False)
    assert done.returncode == 2 and "--target" in done.stderr


@pytest.mark.slow
def test_compile_dumps_ptx_and_prints_the_table(tmp_path):
    out = cli("compile", "--target", "sm_80", "--backend", "triton_generic", "--dump", str(tmp_path)).stdout
    header = next(line for line in out.splitlines() if line.startswith("kernel"))
    assert header.split() == ["kernel", "specialization", "regs", "spills", "smem", "tmem", "instructions"]
    dumped = sorted(p.name for p in tmp_path.iterdir())
    assert dumped and all(name.startswith("triton_generic.") and name.endswith(".ptx") for name in dumped)
    assert any(name.startswith("triton_generic.state_fwd.") for name in dumped)
    assert all(".target sm_80" in (tmp_path / name).read_text() for name in dumped)
    assert f"{len(dumped)} kernels compiled" in out and "mma.sync" in out


def test_compile_rows_name_serialized_wgmma():
    """A kernel whose wgmma ptxas serialized says so in its row of the compile table."""
    import dataclasses

    from gdn_dispatch.aot import AotKernel, CompileReport

    kernel = AotKernel(backend="gluon_sm90", kernel="fused_fwd", specialization="bf16", fn=None, signature={},
                       constexprs={})
    report = CompileReport(kernel=kernel, target="sm_90a", ptx="", registers=168, spill_bytes=0, shared_bytes=0,
                           tmem_columns=0, instructions={"wgmma.mma_async": True, "tcgen05.mma": False})
    assert report.row()[-1] == "wgmma.mma_async"
    assert dataclasses.replace(report, wgmma_serialized=True).row()[-1] == "wgmma.mma_async,SERIALIZED-WGMMA"


def test_compile_target_without_kernel_backends():
    out = cli("compile", "--target", "sm_75").stdout
    assert "target sm_75: backends none" in out and "0 kernels compiled" in out


@pytest.mark.parametrize(
    "argv, gpus, message",
    [
        (["info", "--assume", "banana"], 0,
         "argument --assume: expected 'cpu' or an architecture like sm_80, sm_86, sm_89, sm_90a, sm_100a, "
         "sm_103a, sm_120, got 'banana'"),
        (["compile", "--target", "banana"], 0,
         "argument --target: expected a CUDA architecture like sm_80, sm_86, sm_89, sm_90a, sm_100a, "
         "sm_103a, sm_120, got 'banana'"),
        (["compile", "--target", "cpu"], 0, "argument --target: expected a CUDA architecture like"),
        (["compile", "--target", "sm_130"], 0, f"argument --target: unknown architecture 'sm_130'; valid: {KNOWN}"),
        (["compile", "--target", "sm_999"], 0, f"argument --target: unknown architecture 'sm_999'; valid: {KNOWN}"),
        (["info", "--assume", "sm_12"], 0, f"argument --assume: unknown architecture 'sm_12'; valid: cpu, {KNOWN}"),
        (["info", "--assume", "sm_1000"], 0,
         f"argument --assume: unknown architecture 'sm_1000'; valid: cpu, {KNOWN}"),
        (["info", "--assume", "9"], 0, f"argument --assume: unknown architecture '9'; valid: cpu, {KNOWN}"),
        (["compile", "--target", "sm_90a", "--backend", "bogus"], 0,
         "argument --backend: expected a backend with kernels (gluon_sm100, gluon_sm90, triton_generic), "
         "got 'bogus'"),
        (["compile", "--target", "sm_80", "--backend", "gluon_sm100"], 0,
         "argument --backend: gluon_sm100 is not admitted on sm_80; valid there: triton_generic"),
        (["run", "--device", "bogus"], 0,
         "argument --device: expected cpu, cuda, cuda:N or a CUDA device index N, got 'bogus'"),
        (["run", "--device", "cuda"], 0,
         "argument --device: cuda asked, but this machine has no CUDA device (no CUDA driver); valid: cpu"),
        (["run", "--device", "cuda:3"], 1,
         "argument --device: cuda:3 asked, but this machine has 1 CUDA device; valid: cpu, cuda:0"),
        (["warmup", "--heads", "2", "--v-heads", "4", "--device", "cuda:0"], 0,
         "argument --device: cuda:0 asked, but this machine has no CUDA device (no CUDA driver); valid: cpu"),
        (["warmup", "--heads", "2", "--v-heads", "4", "--device", "cuda:1"], 1,
         "argument --device: cuda:1 asked, but this machine has 1 CUDA device; valid: cpu, cuda:0"),
        (["selftest", "--device", "cuda"], 0,
         "argument --device: cuda asked, but this machine has no CUDA device (no CUDA driver); valid: cpu"),
        (["selftest", "--timeout", "-5"], 0, "argument --timeout: expected a positive number of seconds, got '-5'"),
        (["selftest", "--backend", "bogus"], 0,
         "argument --backend: unknown backend 'bogus'; valid: gluon_sm100, gluon_sm90, triton_generic, reference"),
        (["selftest", "--device", "cpu", "--backend", "gluon_sm100"], 0,
         "argument --backend: gluon_sm100 cannot run on cpu (host CPU, cpu): needs a CUDA device"),
    ],
    ids=lambda x: "-".join(x) if isinstance(x, list) else None,
)
def test_usage_errors_exit_2_with_one_line(argv, gpus, message, capsys):
    from gdn_dispatch.__main__ import main
    from gdn_dispatch.device import use_probe

    with use_probe(StandInProbe(*["sm_90"] * gpus)), pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"python -m gdn_dispatch {argv[0]}: error: {message}" in err
    assert "Traceback" not in err and len(err.strip().splitlines()[-1]) > 0


def test_usage_error_in_a_subprocess():
    done = cli("compile", "--target", "banana", check=False)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].endswith("error: argument --target: expected a CUDA "
                                                          "architecture like sm_80, sm_86, sm_89, sm_90a, sm_100a, "
                                                          "sm_103a, sm_120, got 'banana'")


@pytest.mark.parametrize("flag, kind", [("--dump", "file"), ("--output", "missing-parent"),
                                        ("--output", "directory"), ("--dump", "below-a-file")])
def test_compile_checks_its_paths_before_compiling(flag, kind, tmp_path, monkeypatch, capsys):
    """A --dump or --output that cannot be written is a usage error before the first
    kernel compiles (from a cold cache the compile takes minutes)."""
    from gdn_dispatch import aot
    from gdn_dispatch.__main__ import main

    def no_compile(kernel, capability):
        raise AssertionError(f"compiled {kernel.backend}.{kernel.kernel} before checking {flag}")

    monkeypatch.setattr(aot, "compile_kernel", no_compile)
    (tmp_path / "table.txt").write_text("")
    path = {"file": tmp_path / "table.txt", "missing-parent": tmp_path / "missing" / "table.txt",
            "directory": tmp_path, "below-a-file": tmp_path / "table.txt" / "ptx"}[kind]
    with pytest.raises(SystemExit) as exited:
        main(["compile", "--target", "sm_80", flag, str(path)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    expected = {"file": f"argument --dump: expected a directory, got the file {str(path)!r}",
                "missing-parent": f"argument --output: the directory of {str(path)!r} does not exist",
                "directory": f"argument --output: expected a file, got the directory {str(path)!r}",
                "below-a-file": f"argument --dump: cannot make the directory {str(path)!r} (Not a directory)"}[kind]
    assert err.strip().splitlines()[-1] == f"python -m gdn_dispatch compile: error: {expected}"
    assert not (tmp_path / "missing").exists()


def test_compile_without_triton_is_one_line():
    """Where Triton does not import, compile says so in one line (exit 2), no traceback."""
    program = ("import runpy, sys; sys.modules['triton'] = None; "
               "sys.argv = ['gdn_dispatch', 'compile', '--target', 'sm_90a']; "
               "runpy.run_module('gdn_dispatch', run_name='__main__', alter_sys=True)")
    env = {k: v for k, v in os.environ.items() if k not in ("GDN_BACKEND", "TRITON_INTERPRET")}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        "python -m gdn_dispatch compile: error: needs Triton, which does not import here "
        "(ModuleNotFoundError: import of triton halted; None in sys.modules)"]
    assert done.stdout == ""


def test_version():
    from gdn_dispatch import __version__

    done = cli("--version")
    assert done.stdout.strip() == f"gdn-dispatch {__version__}"


def test_selftest_on_cpu(tmp_path):
    done = cli("selftest", "--quick", env={"GDN_SELFTEST_CACHE": str(tmp_path)})
    lines = done.stdout.strip().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("backend"))
    assert lines[header].split()[:4] == ["backend", "picked", "cases", "worst"]
    assert lines[header + 1].split()[:3] == ["reference", "yes", "3/3"] and lines[header + 1].endswith("PASS")
    assert lines[-1].startswith("selftest: PASS")
    assert "[3/3] reference" in done.stderr  # the progress counter


def test_info_assume_sm_100_notes_the_first_call_self_test(tmp_path):
    out = cli("info", "--assume", "sm_100", env={"GDN_SELFTEST_CACHE": str(tmp_path)}).stdout
    assert out.rstrip().endswith("selected: gluon_sm100")
    assert ("sm_100 not in verified_on, not yet self-tested on B200 (assumed): its first call runs the quick "
            "self-test (or run python -m gdn_dispatch selftest)") in out


def test_compile_streams_rows_and_writes_the_table(tmp_path):
    table = tmp_path / "sm_75.txt"
    out = cli("compile", "--target", "sm_75", "--output", str(table)).stdout
    assert table.read_text().splitlines() == out.splitlines()
