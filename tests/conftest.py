"""Session setup shared by every test tier."""

from __future__ import annotations

import os


def pytest_configure(config):
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
