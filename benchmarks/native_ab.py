"""Host enqueue per public call with the native host layer off, on without call programs,
on without routes, and on, in one process.

Usage (a CUDA machine, repository root): ``python benchmarks/native_ab.py [BACKEND]``
(gluon_sm90 by default, or triton_generic). Builds the
native layer first where it is not built (:func:`gdn_dispatch.native.build`). The GPU hosts
lent here run the same Python up to 1.6x apart from one process to the next, so the arms
alternate inside one process: per round and case, each arm (``GDN_DISPATCH_NATIVE=0``;
``=1`` with the backend's call programs left out (:mod:`gdn_dispatch.backends.call_program`);
``=1`` with routes off (``GDN_DISPATCH_ROUTES=0``, :mod:`gdn_dispatch.routes`); ``=1``)
starts from emptied plan caches (its launchers, allocators and programs made afresh),
warms up with 3 calls and times 20 back-to-back calls (µs per call); 7 rounds. Prints, per
case (:func:`host_enqueue_ab.case_calls`, initial and final state), each arm's
median and the medians of the per-round differences, after the host reference line.
"""
from __future__ import annotations

import importlib
import os
import statistics
import sys
from unittest import mock

import torch

from gdn_dispatch import native, routes
from gdn_dispatch.backends import direct_launch
from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
from gdn_dispatch.backends.triton_generic.call_program import clear_programs
from gdn_dispatch.bench_host import format_reference, host_reference_us, per_call_us

from host_enqueue_ab import case_calls

ROUNDS = 7


#: The arms: (GDN_DISPATCH_NATIVE, call programs on, GDN_DISPATCH_ROUTES). Routes lead to
#: programs: off wherever programs are.
ARMS = {"off": ("0", False, "0"), "no programs": ("1", False, "0"), "no routes": ("1", True, "0"),
        "on": ("1", True, "1")}


#: The forward module whose run_call the "no programs" arm replaces, per backend.
FORWARDS = {"gluon_sm90": "gdn_dispatch.backends.gluon_common.forward",
            "triton_generic": "gdn_dispatch.backends.triton_generic.forward"}


def fresh(arm: str) -> None:
    """Switch the layer and drop every launcher, allocator and program made so far."""
    os.environ[native.NATIVE_ENV] = ARMS[arm][0]
    os.environ[routes.ROUTES_ENV] = ARMS[arm][2]
    clear_plan_cache()
    clear_programs()
    direct_launch._CALL_SITES.clear()


def timed(arm: str, f, forward_module) -> float:
    fresh(arm)
    if ARMS[arm][1]:
        return per_call_us(f, 20, sync=torch.cuda.synchronize, warmup=3)
    with mock.patch.object(forward_module, "run_call", lambda *args: None):
        return per_call_us(f, 20, sync=torch.cuda.synchronize, warmup=3)


def main() -> None:
    backend = sys.argv[1] if len(sys.argv) > 1 else "gluon_sm90"
    forward_module = importlib.import_module(FORWARDS[backend])
    native.build()
    print(f"{backend}; native host layer: {native.status()}")
    print(format_reference(host_reference_us("cuda")), flush=True)
    print("| case | off µs | on, no programs µs | on, no routes µs | on µs | on - off | on - no programs | "
          "on - no routes |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, f in case_calls(backend):
        times = {arm: [] for arm in ARMS}
        for _ in range(ROUNDS):
            for arm in ARMS:
                times[arm].append(timed(arm, f, forward_module))
        med = {arm: statistics.median(t) for arm, t in times.items()}
        diff = {base: statistics.median(b - a for a, b in zip(times[base], times["on"]))
                for base in ("off", "no programs", "no routes")}
        print(f"| {name} | {med['off']:.1f} | {med['no programs']:.1f} | {med['no routes']:.1f} | {med['on']:.1f} | "
              f"{diff['off']:+.1f} | {diff['no programs']:+.1f} | {diff['no routes']:+.1f} |", flush=True)


if __name__ == "__main__":
    main()
