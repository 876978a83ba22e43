"""Session setup shared by every test tier."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--build-flag", action="append", default=[], metavar="MODULE.NAME=VALUE",
                     help="set a kernel build flag under gdn_dispatch.backends for the whole run, e.g. "
                          "gluon_common.blocked_inverse.F16_OPERANDS=0 (gdn_dispatch.testing.set_build_flags)")


def pytest_configure(config):
    # Build flags first, in every process (pytest-xdist's workers parse the same options):
    # a jit function's globals are fixed at its first compile.
    if config.getoption("--build-flag"):
        from gdn_dispatch.testing import set_build_flags

        set_build_flags(config.getoption("--build-flag"))
    # The run reads no cache of the user's (self-test verdicts, the native host layer a
    # warmup built): tests that assume neither would take other paths where one exists.
    # A cache named in the environment is kept (GPU runs name the one holding their build).
    if not os.environ.get("GDN_SELFTEST_CACHE"):
        import tempfile

        os.environ["GDN_SELFTEST_CACHE"] = tempfile.mkdtemp(prefix="gdn-dispatch-test-cache-")
    # Nor the library's call-time switches from the user's shell (a forced backend, the
    # self-test gate's mode, debug checks, Triton's JIT launches): tests that need one set it.
    for name in ("GDN_BACKEND", "GDN_SELFTEST", "GDN_DEBUG_CHECKS", "GDN_DISPATCH_JIT_LAUNCH"):
        os.environ.pop(name, None)
    # Each pytest-xdist worker is a process with torch's default of one intra-op thread per
    # core: n workers then run n x cores threads on the cores, and the float32 CPU
    # references of the GPU tier (recurrences over thousands of tokens and 64 heads) slow
    # to a crawl as the threads contend. The workers share the cores instead.
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not workers:
        return
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // int(workers)))


#: Seconds a GPU-tier test may run (``GDN_GPU_TEST_TIMEOUT``; 0: no limit) before
#: :func:`gdn_dispatch.testing.hang_guard` ends its process with the stacks on stderr
#: (pytest-xdist then names the test its worker crashed in): long enough for the fuzz's
#: cold compiles, short of a CI job's limit.
GPU_TEST_TIMEOUT = 900.0


@pytest.fixture(autouse=True)
def _gpu_hang_guard(request):
    """A stuck GPU test fails its run instead of stalling it (:data:`GPU_TEST_TIMEOUT`)."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    from gdn_dispatch.testing import hang_guard

    with hang_guard(float(os.environ.get("GDN_GPU_TEST_TIMEOUT", GPU_TEST_TIMEOUT)), _terminal_fd(request.config)):
        yield


def _terminal_fd(config) -> int | None:
    """The stderr that pytest's output capture set aside (a dump written into the capture
    would end with the process, unread), or None where nothing is captured."""
    capture = getattr(config.pluginmanager.getplugin("capturemanager"), "_global_capturing", None)
    return getattr(getattr(capture, "err", None), "targetfd_save", None)


@pytest.fixture(scope="session")
def native_built(tmp_path_factory):
    """The native host layer (:mod:`gdn_dispatch.native`) compiled into a temporary cache
    directory, with that directory: it is the process's GDN_SELFTEST_CACHE while the run's
    tests run. Only slow-tier tests ask for it (a C++ compile)."""
    cache = tmp_path_factory.mktemp("native-cache")
    saved = os.environ.get("GDN_SELFTEST_CACHE")
    os.environ["GDN_SELFTEST_CACHE"] = str(cache)
    try:
        from gdn_dispatch import native

        yield native.build(log=lambda message: None), cache
    finally:
        if saved is None:
            os.environ.pop("GDN_SELFTEST_CACHE", None)
        else:
            os.environ["GDN_SELFTEST_CACHE"] = saved
