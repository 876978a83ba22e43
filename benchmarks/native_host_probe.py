"""What a native host path would cost on this host: the pieces of a call done from C++
against the same pieces from Python.

Usage (a CUDA machine with a C++ compiler, ninja and the CUDA headers, repository root):
``python benchmarks/native_host_probe.py``. Builds a small torch C++ extension (about a
minute, once per process) and times, in host microseconds per call (the minimum over 7
windows of 300 calls, the stream drained between windows):

* the outputs and intermediates of one pipeline call (o, final state, w, u, g_cum;
  Qwen3.5's H = 16, HV = 32, K = V = 128, 64 tokens, bf16): five ``torch.empty`` from
  Python against five ``at::empty`` in one C++ call;
* the tensor metadata the contract reads (dim, sizes, strides, dtype, device, address of
  the call's eight tensors): Python attribute reads against the same reads in C++;
* one kernel launch (a Triton kernel of 11 pointer arguments and 2 integers): Triton's C
  launch with addresses (what ``launch.launch_planned`` calls) against ``cuLaunchKernel``
  from C++ with the stream queried there;
* the whole public call, for scale, and the host reference line of ``bench --host``.

Prints a markdown table last.
"""
import time

import torch
import triton
import triton.language as tl

from gdn_dispatch import chunk_gated_delta_rule
from gdn_dispatch.bench_host import format_reference, host_reference_us, make_call

from host_launch_costs import host_us

CPP = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>

std::vector<at::Tensor> alloc5(const at::Tensor& like, int64_t T, int64_t N) {
  auto opts = like.options();
  auto f32 = opts.dtype(at::kFloat);
  return {at::empty({1, T, 32, 128}, opts), at::empty({N, 32, 128, 128}, f32), at::empty({1, T, 32, 128}, opts),
          at::empty({1, T, 32, 128}, opts), at::empty({1, T, 32}, f32)};
}

int64_t read_meta(const std::vector<at::Tensor>& ts) {
  int64_t acc = 0;
  for (const auto& t : ts) {
    acc += t.dim();
    for (auto s : t.sizes()) acc += s;
    for (auto s : t.strides()) acc += s;
    acc += static_cast<int64_t>(t.scalar_type()) + t.device().index();
    acc += reinterpret_cast<int64_t>(t.data_ptr()) & 15;
  }
  return acc;
}

int64_t launch(int64_t function, int64_t grid, int64_t threads, int64_t shared, const std::vector<int64_t>& ptrs,
               int64_t n0, int64_t n1) {
  CUstream stream = c10::cuda::getCurrentCUDAStream().stream();
  void* values[16];
  void* params[16];
  size_t count = ptrs.size();
  for (size_t i = 0; i < count; ++i) { values[i] = reinterpret_cast<void*>(ptrs[i]); params[i] = &values[i]; }
  int32_t a = static_cast<int32_t>(n0), b = static_cast<int32_t>(n1);
  params[count] = &a;
  params[count + 1] = &b;
  void* scratch = nullptr;  // Triton's global and profile scratch arguments
  params[count + 2] = &scratch;
  params[count + 3] = &scratch;
  return cuLaunchKernel(reinterpret_cast<CUfunction>(function), grid, 1, 1, threads, 1, 1, shared, stream, params,
                        nullptr);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("alloc5", &alloc5);
  m.def("read_meta", &read_meta);
  m.def("launch", &launch);
}
"""


@triton.jit
def _probe_kernel(p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, n0, n1):
    if tl.program_id(0) == n0 + n1:  # never: the launch alone is timed
        tl.store(p0, tl.load(p1))


def main() -> None:
    from torch.utils.cpp_extension import load_inline

    start = time.perf_counter()
    ext = load_inline("gdn_native_probe", cpp_sources=[CPP], extra_cflags=["-O2"],
                      extra_ldflags=["-lcuda", "-lc10_cuda"], with_cuda=True)
    print(f"extension built in {time.perf_counter() - start:.0f} s", flush=True)
    device = torch.device("cuda")
    call = make_call((64,), True, True, device, seed=1)
    tensors = [call[name] for name in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "cu_seqlens_cpu")]
    q = call["q"]
    T, N = q.shape[1], call["cu_seqlens"].shape[0] - 1
    rows = []

    def py_alloc():
        return (torch.empty((1, T, 32, 128), dtype=q.dtype, device=device),
                torch.empty((N, 32, 128, 128), dtype=torch.float32, device=device),
                torch.empty((1, T, 32, 128), dtype=q.dtype, device=device),
                torch.empty((1, T, 32, 128), dtype=q.dtype, device=device),
                torch.empty((1, T, 32), dtype=torch.float32, device=device))

    rows.append(("5 allocations", host_us(py_alloc), host_us(lambda: ext.alloc5(q, T, N))))

    def py_meta():
        acc = 0
        for t in tensors:
            acc += t.dim() + sum(t.shape) + sum(t.stride()) + (t.device.index or 0) + t.data_ptr() % 16
            acc += t.dtype.itemsize
        return acc

    rows.append(("metadata of 8 tensors", host_us(py_meta), host_us(lambda: ext.read_meta(tensors))))

    buf = torch.empty(1024, device=device)
    ptrs = [buf.data_ptr()] * 11
    compiled = _probe_kernel[(1,)](*([buf] * 11), 5, 7)
    torch.cuda.synchronize()
    from gdn_dispatch.backends.gluon_common import compat

    raw = compat.raw_launch(compiled)
    stream = compat.current_stream_query()
    dev = torch.cuda.current_device()
    threads = compiled.metadata.num_warps * 32
    shared = compiled.metadata.shared
    assert ext.launch(compiled.function, 1, threads, shared, ptrs, 5, 7) == 0
    torch.cuda.synchronize()
    if raw is not None:
        py_launch = host_us(lambda: raw.c_launch(1, 1, 1, stream(dev), *raw.prefix, *ptrs, 5, 7))
    else:
        py_launch = float("nan")
    rows.append(("one launch", py_launch, host_us(lambda: ext.launch(compiled.function, 1, threads, shared, ptrs, 5, 7))))

    public = host_us(lambda: chunk_gated_delta_rule(**call), calls=100)
    print(format_reference(host_reference_us(device)))
    print(f"public varlen 1 x 64 call (gluon default backend): {public:.1f} us")
    print("| piece | Python µs | C++ µs |")
    print("| --- | ---: | ---: |")
    for name, py, cpp in rows:
        print(f"| {name} | {py:.2f} | {cpp:.2f} |")


if __name__ == "__main__":
    main()
