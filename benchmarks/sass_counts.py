"""Static SASS instruction counts of gluon_sm90's fused kernel (no GPU needed): per source
function, and per loop of the kernel (a conditional backward branch over 2,000 bytes or
more: each partition's chunk loop) with the functions it spends the most instructions in.

    python benchmarks/sass_counts.py [--build-flag MODULE.NAME=VALUE ...] [--l2] [--dense]

The kernel is compiled for sm_90a at its first AOT specialization of that kind (bf16, "kv",
initial and final state, varlen unless ``--dense``; with the qk l2 norm on chip under
``--l2``) with the build flags set first (:func:`gdn_dispatch.testing.set_build_flags`, e.g.
``gluon_sm90.fused.AUX_T=0`` for the two-launch build's fused kernel; the one-kernel build
on fp16 products as shipped) by :func:`gdn_dispatch.aot.compile_kernel`, then Triton's bundled nvdisasm prints its cubin
with line info: each instruction counts for the innermost source line ptxas gives it
(inlined helpers count as themselves). Static counts say how much a partition issues per
chunk, not how long it takes.
"""
import argparse
import ast
import collections
import os
import re
import subprocess
import tempfile


def _functions(path: str, cache: dict) -> list:
    """(first line, last line, name) of every function defined in ``path``."""
    if path not in cache:
        tree = ast.parse(open(path).read())
        cache[path] = [(n.lineno, n.end_lineno, n.name) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    return cache[path]


def _owner(path: str, line: int, cache: dict) -> str:
    """The innermost function of ``path`` holding ``line`` ("?" outside any)."""
    best = None
    for first, last, name in _functions(path, cache):
        if first <= line <= last and (best is None or first > best[0]):
            best = (first, name)
    return f"{os.path.basename(path)}:{best[1] if best else '?'}"


def attribute(sass: str) -> list:
    """(address, owning function, opcode) of every instruction of nvdisasm's ``-g`` output."""
    cache, where, out = {}, None, []
    for text in sass.splitlines():
        found = re.search(r'//## File "([^"]+)", line (\d+)', text)
        if found:
            where = _owner(found.group(1), int(found.group(2)), cache) if os.path.exists(found.group(1)) else "?"
            continue
        found = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", text)
        if found and where:
            out.append((int(found.group(1), 16), where, found.group(2).split(".")[0]))
    return out


def loops(sass: str, min_bytes: int = 2000) -> list:
    """(first, last address) of each conditional backward branch spanning ``min_bytes`` or
    more (the partitions' chunk loops; the unconditional ones return from out-of-line wait
    retries)."""
    lines = sass.splitlines()
    labels = {}
    for i, text in enumerate(lines):
        found = re.match(r"(\.L_x_\d+):", text)
        if found:
            for after in lines[i + 1:i + 5]:
                at = re.search(r"/\*([0-9a-f]{4,})\*/", after)
                if at:
                    labels[found.group(1)] = int(at.group(1), 16)
                    break
    spans = []
    for text in lines:
        found = re.search(r"/\*([0-9a-f]{4,})\*/\s+@!?P\d\s+BRA.*`\((\.L_x_\d+)\)", text)
        if found and found.group(2) in labels:
            end, start = int(found.group(1), 16), labels[found.group(2)]
            if end - start >= min_bytes:
                spans.append((start, end))
    return spans


def local_loads(instructions: list, start: int, end: int) -> int:
    """LDL instructions (reloads of spilled values) among :func:`attribute`'s
    ``instructions`` from address ``start`` to ``end``."""
    return sum(1 for at, _, opcode in instructions if start <= at <= end and opcode == "LDL")


def fused_sass(l2: bool = False, dense: bool = False):
    """gluon_sm90's fused kernel at its first AOT specialization of the kind (with the qk l2
    norm on chip under ``l2``, without ragged tails under ``dense``), compiled for sm_90a
    with the build flags as set in this process: ``(kernel, report, sass)``, the SASS as
    nvdisasm prints it with line info."""
    import triton

    from gdn_dispatch.aot import compile_kernel
    from gdn_dispatch.backends import gluon_sm90
    from gdn_dispatch.backends.gluon_sm90 import fused

    kernel = next(k for k in fused.fused_kernels_for_aot((9, 0), "gluon_sm90", engine=gluon_sm90.ENGINE)
                  if k.constexprs["HAS_TAILS"] != dense and bool(k.constexprs.get("QK_NORM")) == l2)
    report = compile_kernel(kernel, (9, 0))
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(report.cubin)
        cubin.flush()
        sass = subprocess.run([nvdisasm, "-c", "-g", cubin.name], capture_output=True, text=True, check=True).stdout
    return kernel, report, sass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-flag", action="append", default=[], metavar="MODULE.NAME=VALUE")
    parser.add_argument("--l2", action="store_true", help="the specialization with the qk l2 norm on chip")
    parser.add_argument("--dense", action="store_true", help="the specialization without ragged tails")
    args = parser.parse_args()

    from gdn_dispatch.testing import set_build_flags

    set_build_flags(args.build_flag)
    kernel, report, sass = fused_sass(l2=args.l2, dense=args.dense)
    instructions = attribute(sass)
    print(f"fused {kernel.specialization}, flags {args.build_flag or 'as shipped'}: {len(instructions)} instructions, "
          f"{report.registers} registers, {report.spill_bytes} spill bytes")
    by_function = collections.Counter(owner for _, owner, _ in instructions)
    opcodes = collections.defaultdict(collections.Counter)
    for _, owner, opcode in instructions:
        opcodes[owner][opcode] += 1
    for owner, count in by_function.most_common(30):
        top = ", ".join(f"{op} {n}" for op, n in opcodes[owner].most_common(5))
        print(f"{count:6d}  {owner:48s} {top}")
    print("loops (first address, last, instructions, local loads of spilled values, top functions):")
    for start, end in loops(sass):
        inside = collections.Counter(owner for at, owner, _ in instructions if start <= at <= end)
        top = ", ".join(f"{owner} {n}" for owner, n in inside.most_common(4))
        print(f"  {start:#07x}-{end:#07x} {sum(inside.values()):6d} {local_loads(instructions, start, end):3d}  {top}")


if __name__ == "__main__":
    main()
