"""The watchdog of the GPU tier: a test stuck in a kernel that never finishes ends its run
with the stacks on stderr instead of stalling it (:func:`gdn_dispatch.testing.hang_guard`,
armed for every ``gpu``-marked test by ``tests/conftest.py``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _run(args: list[str], env: dict | None = None, cwd: Path | None = None) -> tuple[int, str, float]:
    start = time.monotonic()
    done = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def test_guard_ends_a_stuck_block_with_its_stack():
    rc, out, elapsed = _run([sys.executable, "-c", textwrap.dedent("""
        import time
        from gdn_dispatch.testing import hang_guard

        def stuck_in_a_kernel_wait():
            time.sleep(60)

        with hang_guard(1.0):
            stuck_in_a_kernel_wait()
        print("not reached")
    """)])
    assert rc == 1 and elapsed < 30, (rc, elapsed, out)
    assert "Timeout" in out and "stuck_in_a_kernel_wait" in out and "not reached" not in out, out


def test_guard_lets_a_block_that_finishes_go():
    rc, out, _ = _run([sys.executable, "-c", textwrap.dedent("""
        import time
        from gdn_dispatch.testing import hang_guard

        with hang_guard(1.0):
            time.sleep(0.1)
        with hang_guard(0):
            time.sleep(1.5)
        time.sleep(1.5)
        print("finished")
    """)])
    assert rc == 0 and "finished" in out and "Timeout" not in out, out


def test_gpu_marked_tests_run_under_the_guard(tmp_path):
    """A ``gpu`` test that outlives ``GDN_GPU_TEST_TIMEOUT`` ends the run (exit 1, its
    stack named); an unmarked test of the same length is not guarded."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_stall.py").write_text(textwrap.dedent("""
        import time
        import pytest

        @pytest.mark.gpu
        def test_stalled_on_the_gpu():
            time.sleep(60)

        def test_long_on_the_cpu():
            time.sleep(3)
    """))
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
            "-o", "markers=gpu: needs a GPU", str(tmp_path / "test_stall.py")]
    env = {"GDN_GPU_TEST_TIMEOUT": "2"}
    rc, out, elapsed = _run(base + ["-k", "stalled"], env, cwd=tmp_path)
    assert rc == 1 and elapsed < 60, (rc, elapsed, out)
    assert "Timeout" in out and "test_stalled_on_the_gpu" in out, out
    rc, out, _ = _run(base + ["-k", "long_on_the_cpu"], env, cwd=tmp_path)
    assert rc == 0 and "1 passed" in out, out
