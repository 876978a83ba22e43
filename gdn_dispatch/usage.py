"""Command-line argument checks shared by the subcommands.

Each ``*_arg`` function is an argparse ``type=``: it returns the parsed value or raises
``argparse.ArgumentTypeError``, which argparse turns into a usage error (exit 2, one line
naming the flag). Checks that need more than one argument or the machine (a CUDA device
that is not there) raise :class:`UsageError` from the command; ``__main__.main`` reports
it the same way, as the subcommand's usage error.
"""

from __future__ import annotations

import argparse
import re

#: Architectures the arguments name, for the messages.
ARCH_EXAMPLES = "sm_80, sm_86, sm_89, sm_90a, sm_100a, sm_103a, sm_120"


class UsageError(ValueError):
    """A command-line argument that the command cannot honour; the message names it."""


def arch_arg(text: str):
    """``--assume``: 'cpu' or a known architecture ("sm_90", "sm_100a", "90") -> DeviceInfo."""
    from gdn_dispatch.device import CPU, assumed_device

    if text.strip().lower() == "cpu":
        return CPU
    _known_capability(text, f"expected 'cpu' or an architecture like {ARCH_EXAMPLES}", "cpu, ")
    return assumed_device(text)


def target_arg(text: str) -> tuple[int, int]:
    """``--target``: a known CUDA architecture ("sm_100a", "sm_90", "100") -> (major, minor)."""
    return _known_capability(text, f"expected a CUDA architecture like {ARCH_EXAMPLES}")


def _known_capability(text: str, expected: str, also_valid: str = "") -> tuple[int, int]:
    """The capability ``text`` names; ArgumentTypeError with ``expected`` for text that names
    none, and with the valid names for one no known part has (sm_130, sm_12)."""
    from gdn_dispatch.device import KNOWN_CAPABILITIES, known_archs, parse_arch

    try:
        capability = parse_arch(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None
    if capability not in KNOWN_CAPABILITIES:
        raise argparse.ArgumentTypeError(f"unknown architecture {text!r}; valid: {also_valid}{known_archs()}")
    return capability


def device_arg(text: str) -> str:
    """``--device``: "cpu", "cuda", "cuda:N" or "N" -> "cpu", "cuda" or "cuda:N"."""
    value = text.strip().lower()
    if value.isdigit():
        return f"cuda:{int(value)}"
    if value in ("cpu", "cuda") or re.fullmatch(r"cuda:\d+", value):
        return value
    raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or a CUDA device index N, got {text!r}")


def backend_arg(names):
    """A ``type=`` for ``--backend``: one of ``names()`` (a callable, read when parsing)."""
    def parse(text: str) -> str:
        valid = list(names())
        if text not in valid:
            raise argparse.ArgumentTypeError(f"unknown backend {text!r}; valid: {', '.join(valid)}")
        return text
    parse.__name__ = "backend"
    return parse


def cuda_index(label: str, probe) -> int | None:
    """The CUDA index ``label`` ("cuda", "cuda:N", "cpu") names on this machine, None for
    the CPU; UsageError naming ``--device`` when there is no such device."""
    if label == "cpu":
        return None
    count = probe.count()
    index = 0 if label == "cuda" else int(label.partition(":")[2])
    if count == 0:
        why = probe.unavailable_reason or "no CUDA device"
        raise UsageError(f"argument --device: {label} asked, but this machine has no CUDA device ({why}); "
                         f"valid: cpu")
    if index >= count:
        valid = ", ".join(["cpu", *(f"cuda:{i}" for i in range(count))])
        raise UsageError(f"argument --device: {label} asked, but this machine has {count} CUDA "
                         f"device{'s' if count > 1 else ''}; valid: {valid}")
    return index


def int_arg(low: int = 1, high: int | None = None):
    """A ``type=`` for an integer flag in ``[low, high]`` (``high`` None: no upper bound)."""
    expected = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    parse.__name__ = "int"
    return parse


def seconds_arg(text: str) -> float:
    """``--timeout``: a positive number of seconds."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return seconds
