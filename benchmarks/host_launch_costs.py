"""What one Gluon call's host work is made of, piece by piece, on a CUDA machine.

Usage (repository root, a GPU of compute capability 9.0 or 10.x, Triton 3.6):
``python benchmarks/host_launch_costs.py``.

One bf16 Qwen3.5-shaped varlen call (H = 16, HV = 32, K = V = 128, 64 tokens, initial and
final state) on the device's Gluon backend. Its kernel launches are captured once from
Triton's Python launcher (``CudaLauncher.__call__``); then each piece is timed alone (host
microseconds per call, the minimum over 7 windows of 300 calls, the stream drained between
windows):

* the whole public call;
* per launch: Triton's Python launcher with the call's arguments (descriptors as host
  objects it encodes), the C launch with pre-encoded descriptors and tensors, and with
  pointers as addresses (what ``launch.launch_planned`` calls); one TMA encoding;
* ``torch.empty`` of the call's output shapes, and the device and stream queries.

Prints a markdown table last.
"""
import time

import torch

from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.backends.gluon_common.plan import clear_plan_cache
from gdn_dispatch.bench_host import make_call


def host_us(fn, calls: int = 300, windows: int = 7) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(windows):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return best


def captured_launches(call: dict) -> list:
    """(CudaLauncher, its call's arguments) of every launch of one call through Triton's launcher."""
    from triton.backends.nvidia import driver as nvd

    from gdn_dispatch.backends.gluon_common import launch as L

    seen = []
    original = nvd.CudaLauncher.__call__

    def spy(self, *args):
        seen.append((self, args))
        return original(self, *args)

    nvd.CudaLauncher.__call__ = spy
    kept, L.compat.raw_launch = L.compat.raw_launch, lambda kernel: None  # through the Python launcher
    try:
        clear_plan_cache()  # fresh plans keep no kernel: the first call binds, the second launches
        chunk_gated_delta_rule(**call)
        chunk_gated_delta_rule(**call)  # the second call launches the kept kernels
    finally:
        nvd.CudaLauncher.__call__ = original
        L.compat.raw_launch = kept
    torch.cuda.synchronize()
    half = len(seen) // 2
    return seen[half:]


def launch_rows(launcher, args) -> list[tuple[str, float]]:
    from triton.backends.nvidia import driver as nvd

    inner = launcher.launch
    free = dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__ or ())))
    c_launch, meta = free.get("launcher", inner), free.get("tensordesc_meta") or []
    indices = sorted(free.get("tensordesc_indices", ()))
    head = [*args[:5], launcher.launch_cooperative_grid, launcher.launch_pdl, None, None, *args[5:9]]
    kernel_args = args[9:]
    expanded, slot = [], 0
    for i, arg in enumerate(kernel_args):
        if i in indices:
            expanded.extend(nvd.make_tensordesc_arg(arg, meta[slot]))
            slot += 1
        else:
            expanded.append(arg)
    as_addresses = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in expanded]
    name = f"{len(kernel_args)} args, {len(indices)} descriptors"
    rows = [(f"launch ({name}): Triton's Python launcher", host_us(lambda: launcher(*args))),
            (f"launch ({name}): C launch, tensors", host_us(lambda: c_launch(*head, *expanded))),
            (f"launch ({name}): C launch, addresses", host_us(lambda: c_launch(*head, *as_addresses)))]
    if indices:
        desc = kernel_args[indices[0]]
        rows.append(("one TMA encoding (make_tensordesc_arg)", host_us(lambda: nvd.make_tensordesc_arg(desc, meta[0]))))
    return rows


def main() -> None:
    device = torch.device("cuda")
    backend = "gluon_sm100" if torch.cuda.get_device_capability()[0] == 10 else "gluon_sm90"
    call = dict(make_call((64,), True, True, device, seed=1), output_final_state=True, backend=backend)
    rows = [("public call, varlen 1 x 64", host_us(lambda: chunk_gated_delta_rule(**call)))]
    for launcher, args in captured_launches(call):
        rows += launch_rows(launcher, args)
    o_shape, h_shape = (1, 64, 32, 128), (1, 32, 128, 128)
    rows += [("torch.empty o [1, 64, 32, 128] bf16",
              host_us(lambda: torch.empty(o_shape, dtype=torch.bfloat16, device=device))),
             ("torch.empty final state [1, 32, 128, 128] fp32",
              host_us(lambda: torch.empty(h_shape, dtype=torch.float32, device=device))),
             ("torch.cuda.current_device()", host_us(torch.cuda.current_device))]
    print("| piece | host µs |\n| --- | ---: |")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
