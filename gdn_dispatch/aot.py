"""Ahead-of-time compilation of a backend's kernels for a named target, without a GPU.

A backend lists what it can launch as :class:`AotKernel` values (``kernels_for_aot``);
this module compiles each for a target such as sm_90a or sm_100a and reads back what the
hardware would be asked to do: the PTX, registers, spills, shared memory, and which of the
instructions we care about the PTX holds. Registers and spills come from running Triton's
own ptxas with ``-v`` on the PTX (a compiled kernel only learns them when a driver loads
it, and there is no driver here).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from gdn_dispatch.device import SMEM_OPTIN, assumed_device


@dataclass(frozen=True)
class AotKernel:
    """One kernel at one specialization, ready to compile.

    Attributes
    ----------
    backend : str, registry name of the backend ("triton_generic", "gluon_sm100"...).
    kernel : str, the stage ("state_fwd", "output_fwd"...).
    specialization : str, a file-name-safe tag ("K128-V128-varlen-vk-bf16").
    fn : the ``@triton.jit`` or ``@gluon.jit`` function.
    signature : dict, argument name -> type string ("*bf16", "i32", "tensordesc<...>",
        "constexpr").
    constexprs : dict, argument name -> value for the constexpr arguments.
    dialect : "triton" or "gluon".
    num_warps, num_stages : launch options.
    maxnreg : register cap per thread (a launch option), or None.
    attrs : dict, argument-index tuple -> specialization hints, as a launch would pass
        them (e.g. ``{(0,): [["tt.divisibility", 16]]}`` for a 16-byte-aligned pointer).
    spill_bytes_allowed : spill bytes the kernel is known to keep (0 for all but a kernel
        whose list says why; the compile checks and ``compile``'s exit status allow them).
    """

    backend: str
    kernel: str
    specialization: str
    fn: object
    signature: dict
    constexprs: dict = field(default_factory=dict)
    dialect: str = "triton"
    num_warps: int = 4
    num_stages: int = 3
    attrs: dict | None = None
    maxnreg: int | None = None
    spill_bytes_allowed: int = 0


# PTX spellings of the instructions the compile table reports, per column.
INSTRUCTIONS = {
    "tcgen05.mma": r"tcgen05\.mma",
    "tcgen05.ld": r"tcgen05\.ld",
    "tcgen05.alloc": r"tcgen05\.alloc",
    "wgmma": r"wgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
    "tma": r"cp\.async\.bulk\.tensor",
    "scatter4": r"tile::scatter4",
    "mbarrier.wait": r"mbarrier\.try_wait",
}

#: Tensor-memory columns (32-bit, 128 lanes) of one Blackwell SM.
TMEM_COLUMNS = 512


@dataclass(frozen=True)
class CompileReport:
    """What one compiled kernel asks of the hardware."""

    kernel: AotKernel
    target: str
    ptx: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    tmem_columns: int
    instructions: dict
    #: Triton's GPU-level IR of the kernel (where warp-specialized partitions are regions).
    ttgir: str = ""
    #: ptxas serialized the kernel's wgmma (:data:`WGMMA_SERIALIZED`): every 16-deep step
    #: waited for before the next one issues, in the whole kernel.
    wgmma_serialized: bool = False
    #: The compiled binary (what nvdisasm reads; empty where the target produced none).
    cubin: bytes = b""

    def row(self) -> list[str]:
        k = self.kernel
        present = ",".join([name for name, found in self.instructions.items() if found]
                           + (["SERIALIZED-WGMMA"] if self.wgmma_serialized else [])) or "-"
        return [f"{k.backend}.{k.kernel}", k.specialization, str(self.registers), str(self.spill_bytes),
                str(self.shared_bytes), str(self.tmem_columns), present]


def _gpu_target(capability: tuple[int, int]):
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", capability[0] * 10 + capability[1], 32)


#: ptxas's performance note (C7512) for a kernel whose wgmma it could not keep in flight
#: (e.g. too few registers for the operands and accumulators of products issued together).
WGMMA_SERIALIZED = "wgmma.mma_async instructions are serialized"


def _ptxas_resources(ptx: str, arch: int) -> tuple[int, int, bool]:
    """(registers, spill bytes, whether it serialized the wgmma) from Triton's bundled ptxas -v."""
    from gdn_dispatch.backends.gluon_common.compat import ptxas_command

    ptxas, gpu_name = ptxas_command(arch)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp, "kernel.ptx")
        src.write_text(ptx)
        done = subprocess.run(
            [ptxas, "-v", f"--gpu-name={gpu_name}", str(src),
             "-o", str(Path(tmp, "kernel.cubin"))],
            capture_output=True, text=True,
        )
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed for sm_{arch}:\n{log}")
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None:
        raise RuntimeError(f"ptxas -v printed no register count:\n{log}")
    return int(regs.group(1)), sum(int(a) + int(b) for a, b in spills), WGMMA_SERIALIZED in log


def compile_kernel(kernel: AotKernel, capability: tuple[int, int]) -> CompileReport:
    """Compile one kernel for ``capability`` and report its resources and instructions."""
    import triton

    if kernel.dialect == "gluon":
        from gdn_dispatch.backends.gluon_common.compat import gluon_ast_source as Source
    else:
        from triton.compiler import ASTSource as Source
    target = _gpu_target(capability)
    options = {"num_warps": kernel.num_warps}
    if kernel.dialect == "triton":
        options["num_stages"] = kernel.num_stages
    if kernel.maxnreg is not None:
        options["maxnreg"] = kernel.maxnreg
    compiled = triton.compile(Source(kernel.fn, kernel.signature, kernel.constexprs, kernel.attrs),
                              target=target, options=options)
    ptx = compiled.asm["ptx"]
    registers, spills, serialized = _ptxas_resources(ptx, target.arch)
    found = {name: re.search(pattern, ptx) is not None for name, pattern in INSTRUCTIONS.items()}
    # A kernel asking for more than the 512 TMEM columns of an SM compiles into a trap, so
    # the column count is part of the report, not only the shared memory.
    tmem = int(getattr(compiled.metadata, "tmem_size", 0) or 0)
    return CompileReport(kernel=kernel, target=f"sm_{target.arch}", ptx=ptx, registers=registers,
                         spill_bytes=spills, shared_bytes=int(compiled.metadata.shared), tmem_columns=tmem,
                         instructions=found, ttgir=compiled.asm.get("ttgir", ""), wgmma_serialized=serialized,
                         cubin=compiled.asm.get("cubin", b""))


def backends_for_target(capability: tuple[int, int]) -> list[str]:
    """Backends whose registry row admits a CUDA device of ``capability`` (devices only)."""
    from gdn_dispatch.registry import device_reason, load_registry

    device = assumed_device(f"sm_{capability[0]}{capability[1]}")
    return [r.name for r in load_registry() if r.device == "cuda" and device_reason(r, device) is None]


def kernels_for_target(capability: tuple[int, int], backends: list[str] | None = None) -> list[AotKernel]:
    """Every AotKernel that the admitted backends can launch on ``capability``."""
    from gdn_dispatch.registry import load_registry

    rows = {r.name: r for r in load_registry()}
    kernels = []
    for name in backends or backends_for_target(capability):
        module = importlib.import_module(rows[name].module)
        kernels.extend(module.kernels_for_aot(capability))
    return kernels


HEADER = ["kernel", "specialization", "regs", "spills", "smem", "tmem", "instructions"]
#: Widths of the numeric columns, wide enough for any value, so rows print as they finish.
_NUMBER_WIDTHS = [4, 6, 6, 4]


def _column_widths(kernels: list[AotKernel]) -> list[int]:
    """Widths of every column but the last, known before anything compiles."""
    name = max([len(HEADER[0]), *(len(f"{k.backend}.{k.kernel}") for k in kernels)])
    spec = max([len(HEADER[1]), *(len(k.specialization) for k in kernels)])
    return [name, spec, *(max(w, len(h)) for w, h in zip(_NUMBER_WIDTHS, HEADER[2:6]))]


def _format_row(row: list[str], widths: list[int]) -> str:
    return "  ".join([*(c.ljust(w) for c, w in zip(row, widths)), row[-1]]).rstrip()


def _compile_backend_arg(text: str) -> str:
    """``--backend`` of compile: a backend with kernels (a CUDA row of the registry)."""
    from gdn_dispatch.registry import load_registry

    valid = [r.name for r in load_registry() if r.device == "cuda"]
    if text not in valid:
        raise argparse.ArgumentTypeError(f"expected a backend with kernels ({', '.join(valid)}), got {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gdn_dispatch.usage import target_arg

    parser.add_argument("--target", required=True, type=target_arg, help="sm_80, sm_90a, sm_100a, sm_103a, sm_120...")
    parser.add_argument("--backend", action="append", type=_compile_backend_arg,
                        help="only this backend (repeatable); default: every backend admitted on the target")
    parser.add_argument("--dump", metavar="DIR", help="write each kernel's PTX as DIR/<backend>.<kernel>.<specialization>.ptx")
    parser.add_argument("--output", metavar="FILE", help="also write the table and its summary to FILE")


def _check_backends(names: list[str], capability: tuple[int, int]) -> None:
    """UsageError naming ``--backend`` for a backend the target's capability does not admit."""
    from gdn_dispatch.usage import UsageError

    admitted = backends_for_target(capability)
    for name in names:
        if name not in admitted:
            raise UsageError(f"argument --backend: {name} is not admitted on sm_{capability[0]}{capability[1]}; "
                             f"valid there: {', '.join(admitted) or 'none'}")


def _check_paths(args: argparse.Namespace) -> None:
    """UsageError naming ``--output`` or ``--dump`` where the table or the PTX could not be
    written: found before the compile, which takes minutes, not after it. Makes the
    ``--dump`` directory."""
    from gdn_dispatch.usage import UsageError

    if args.output is not None:
        output = Path(args.output)
        if output.is_dir():
            raise UsageError(f"argument --output: expected a file, got the directory {str(output)!r}")
        if not output.parent.is_dir():
            raise UsageError(f"argument --output: the directory of {str(output)!r} does not exist")
        if not os.access(output if output.exists() else output.parent, os.W_OK):
            raise UsageError(f"argument --output: {str(output)!r} is not writable")
    if args.dump is not None:
        dump = Path(args.dump)
        if dump.exists() and not dump.is_dir():
            raise UsageError(f"argument --dump: expected a directory, got the file {str(dump)!r}")
        try:
            dump.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"argument --dump: cannot make the directory {str(dump)!r} ({exc.strerror})") from None


def triton_missing_reason() -> str | None:
    """Why Triton does not import here (compile has nothing to compile with), or None."""
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        return " ".join(f"{type(exc).__name__}: {exc}".split())
    return None


def run(args: argparse.Namespace) -> int:
    """``python -m gdn_dispatch compile``: compile, print each kernel's row as it finishes
    (a counter on stderr), exit 1 on spills or smem overflow, 2 without Triton or with a
    ``--dump`` or ``--output`` that cannot be written. ``args.target`` is a capability
    (major, minor), as ``--target`` parses it."""
    from gdn_dispatch.progress import Progress

    reason = triton_missing_reason()
    if reason is not None:
        print(f"python -m gdn_dispatch compile: error: needs Triton, which does not import here ({reason})",
              file=sys.stderr)
        return 2
    _check_paths(args)
    capability = tuple(args.target)
    if args.backend:
        _check_backends(args.backend, capability)
    names = args.backend or backends_for_target(capability)
    print(f"target sm_{capability[0]}{capability[1]}: backends {', '.join(names) or 'none'}", flush=True)
    limit = SMEM_OPTIN.get(capability)
    kernels = kernels_for_target(capability, names)
    widths = _column_widths(kernels)
    lines, status, serialized = [_format_row(HEADER, widths)], 0, 0
    print(lines[0], flush=True)
    progress = Progress(len(kernels), f"compiling for sm_{capability[0]}{capability[1]}")
    for kernel in kernels:
        report = compile_kernel(kernel, capability)
        lines.append(_format_row(report.row(), widths))
        print(lines[-1], flush=True)
        serialized += report.wgmma_serialized
        progress.step(f"{kernel.backend}.{kernel.kernel}")
        if args.dump:
            Path(args.dump, f"{kernel.backend}.{kernel.kernel}.{kernel.specialization}.ptx").write_text(report.ptx)
        if (report.spill_bytes > kernel.spill_bytes_allowed or (limit is not None and report.shared_bytes > limit)
                or report.tmem_columns > TMEM_COLUMNS):
            status = 1
    progress.close()
    if limit is not None:
        lines.append(f"shared memory limit per block: {limit} bytes")
    lines.append(f"{len(kernels)} kernels compiled"
                 + (f"; {serialized} with every wgmma serialized by ptxas (C7512: too few registers to keep "
                    "them in flight)" if serialized else "")
                 + ("" if status == 0 else "; SOME SPILL OR EXCEED SHARED OR TENSOR MEMORY"))
    print("\n".join(lines[-2 if limit is not None else -1:]))
    if args.output:
        Path(args.output).write_text(f"target sm_{capability[0]}{capability[1]}: backends {', '.join(names) or 'none'}\n"
                                     + "\n".join(lines) + "\n")
    return status
