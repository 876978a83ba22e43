"""Command line: ``python -m gdn_dispatch {info,run,bench,compile,selftest,warmup}``.

Each subcommand is a ``cmd_<name>(args)`` returning the exit status, and its parser is
built in :func:`build_parser`. A :class:`~gdn_dispatch.usage.UsageError` raised by a
command is reported as that subcommand's usage error (exit 2), as argparse reports its own.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import sys


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cmd_info(args: argparse.Namespace) -> int:
    """Versions, devices, and every backend's verdict per device."""
    from gdn_dispatch import __version__
    from gdn_dispatch import gate, native
    from gdn_dispatch.device import default_probe
    from gdn_dispatch.registry import ENV_VAR, QWEN35_CALL, GDNDispatchError, explain

    print(f"gdn-dispatch {__version__}")
    for pkg in ("torch", "triton", "cuda-python", "cuda-bindings"):
        print(f"{pkg:<14} {_version(pkg)}")
    print(f"{ENV_VAR:<14} {os.environ.get(ENV_VAR, '(not set)')}")
    print(f"{gate.ENV_VAR:<14} {os.environ.get(gate.ENV_VAR, '(not set)')} (self-test verdicts in {gate.cache_dir()})")
    print(f"native host layer: {native.status()}")
    call = QWEN35_CALL
    print(f"call explained: {call.dtype}, K={call.K}, V={call.V}, varlen, grouped value heads, "
          f"state layout {call.state_layout!r}, initial and final state")
    if args.assume:
        devices = args.assume
    else:
        probe = default_probe()
        if probe.unavailable_reason:
            print(f"CUDA: none ({probe.unavailable_reason})")
        devices = probe.all()
    status = 0
    for device in devices:
        print()
        cap = "" if device.capability is None else f", capability {device.capability[0]}.{device.capability[1]} ({device.arch})"
        extra = "" if device.kind == "cpu" else f", {device.sm_count} SMs, {device.smem_optin // 1024} KiB smem/block"
        print(f"[{device.label}] {device.name}{cap}{extra}")
        if device.kind != "cpu":
            _print_context_parallel(device)
        try:
            print(explain(device, call).format())
        except GDNDispatchError as exc:
            print(f"  error: {exc}\nselected: NONE")
            status = 1
    return status


#: Calls whose context-parallel decision ``info`` shows per GPU: one 32k-token prompt on the
#: value heads of a tensor-parallel shard of Qwen3.5 (TP=8, TP=2, none); V = 128.
_CP_SHOWN = ((1, 32768, 4), (1, 32768, 16), (1, 32768, 32), (8, 4096, 4))


def _print_context_parallel(device) -> None:
    from gdn_dispatch.context_parallel import plan_context_parallel

    for N, T, HV in _CP_SHOWN:
        decision = plan_context_parallel("auto", T_total=N * T, N=N, HV=HV, V=128, sm_count=device.sm_count,
                                         max_len=T)
        print(f"  context parallel (auto), {N} x {T} tokens, HV={HV}: {decision.describe()}")


def cmd_run(args: argparse.Namespace) -> int:
    from gdn_dispatch.device import default_probe
    from gdn_dispatch.job import run_main_job
    from gdn_dispatch.usage import cuda_index

    if args.device is not None:
        index = cuda_index(args.device, default_probe())
        args.device = "cpu" if index is None else f"cuda:{index}"
    return run_main_job(device=args.device, seed=args.seed)


def cmd_bench(args: argparse.Namespace) -> int:
    from gdn_dispatch import bench
    return bench.run(args)


def cmd_compile(args: argparse.Namespace) -> int:
    from gdn_dispatch import aot
    return aot.run(args)


def cmd_selftest(args: argparse.Namespace) -> int:
    from gdn_dispatch import selftest
    return selftest.run(args)


def cmd_warmup(args: argparse.Namespace) -> int:
    # gdn_dispatch.warmup is the function (the package exports it); the module by its path:
    from gdn_dispatch.warmup import run
    return run(args)


def build_parser() -> argparse.ArgumentParser:
    from gdn_dispatch import __version__
    from gdn_dispatch.usage import arch_arg, device_arg

    parser = argparse.ArgumentParser(prog="python -m gdn_dispatch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"gdn-dispatch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="versions, devices, and which backend each device gets and why")
    info.add_argument("--assume", action="append", metavar="ARCH", type=arch_arg,
                      help="explain for a hypothetical device instead (sm_90, sm_100, sm_120, cpu...); repeatable")
    info.set_defaults(func=cmd_info)

    run = sub.add_parser("run", help="the main job: a Qwen3.5-shaped ragged prefill, timed and checked")
    run.add_argument("--device", type=device_arg, default=None,
                     help="cuda, cuda:N or cpu (default: cuda if present)")
    run.add_argument("--seed", type=int, default=0)
    run.set_defaults(func=cmd_run)

    bench_parser = sub.add_parser("bench", help="time every backend (and fla, if installed) side by side")
    from gdn_dispatch import bench
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(func=cmd_bench)

    comp = sub.add_parser("compile", help="compile backends' kernels ahead of time for a target (no GPU needed)")
    from gdn_dispatch import aot
    aot.add_arguments(comp)
    comp.set_defaults(func=cmd_compile)

    test = sub.add_parser("selftest", help="every backend the device admits against the reference, "
                                           "each in a child process with a time limit")
    from gdn_dispatch import selftest
    selftest.add_arguments(test)
    test.set_defaults(func=cmd_selftest)

    warm = sub.add_parser("warmup", help="compile every kernel specialization calls with given dims can hit "
                                         "on this device, before serving")
    from gdn_dispatch.warmup import add_arguments as add_warmup_arguments
    add_warmup_arguments(warm)
    warm.set_defaults(func=cmd_warmup)

    for subparser in sub.choices.values():  # where main() reports a command's UsageError
        subparser.set_defaults(usage_parser=subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from gdn_dispatch.usage import UsageError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as exc:
        args.usage_parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
