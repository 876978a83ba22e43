"""Host enqueue per public call with the native host layer off and on, in one process.

Usage (a CUDA machine, repository root): ``python benchmarks/native_ab.py``. Builds the
native layer first where it is not built (:func:`gdn_dispatch.native.build`). The GPU hosts
lent here run the same Python up to 1.6x apart from one process to the next, so the arms
alternate inside one process: per round and case, each arm (``GDN_DISPATCH_NATIVE=0``,
then ``=1``) starts from emptied plan caches (its launchers and allocators made afresh), warms
up with 3 calls and times 20 back-to-back calls (µs per call); 7 rounds. Prints, per case
(:func:`host_enqueue_ab.case_calls`, gluon_sm90, initial and final state), each arm's median
and the median of the per-round differences, after the host reference line.
"""
from __future__ import annotations

import os
import statistics

import torch

from gdn_dispatch import native
from gdn_dispatch.backends import direct_launch
from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
from gdn_dispatch.bench_host import format_reference, host_reference_us, per_call_us

from host_enqueue_ab import case_calls

ROUNDS = 7


def fresh(arm: str) -> None:
    """Switch the layer and drop every launcher and allocator made so far."""
    os.environ[native.NATIVE_ENV] = arm
    clear_plan_cache()
    direct_launch._CALL_SITES.clear()


def main() -> None:
    native.build()
    print(f"native host layer: {native.status()}")
    print(format_reference(host_reference_us("cuda")), flush=True)
    print("| case | off µs | on µs | on - off, median of rounds |")
    print("| --- | ---: | ---: | ---: |")
    for name, f in case_calls():
        times = {"0": [], "1": []}
        for _ in range(ROUNDS):
            for arm in ("0", "1"):
                fresh(arm)
                times[arm].append(per_call_us(f, 20, sync=torch.cuda.synchronize, warmup=3))
        diff = statistics.median(b - a for a, b in zip(times["0"], times["1"]))
        print(f"| {name} | {statistics.median(times['0']):.1f} | {statistics.median(times['1']):.1f} | "
              f"{diff:+.1f} |", flush=True)


if __name__ == "__main__":
    main()
