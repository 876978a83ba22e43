"""The command line, run as a user would (in a subprocess, on the CPU)."""

import os
import subprocess
import sys

import pytest

from gdn_dispatch.registry import load_registry

ARCHS = ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_103", "sm_120", "cpu"]


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
    assert "tokens/s" in out and "rel. RMS error" in out
    assert out.rstrip().endswith("PASS")


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


def test_compile_target_without_kernel_backends():
    out = cli("compile", "--target", "sm_75").stdout
    assert "target sm_75: backends none" in out and "0 kernels compiled" in out
