"""The cross-architecture matrix: per simulated part, the registry's choice, and the chosen
backend's kernels compiled for that part (no GPU needed)."""

import pytest

from gdn_dispatch.aot import TMEM_COLUMNS, compile_kernel, kernels_for_target
from gdn_dispatch.device import SMEM_OPTIN, assumed_device
from gdn_dispatch.registry import QWEN35_CALL, explain

# arch -> (backend the registry must choose for a Qwen3.5 call, matrix instruction its PTX must hold)
MATRIX = {
    "sm_75": ("reference", None),
    "sm_80": ("triton_generic", "mma.sync"),
    "sm_86": ("triton_generic", "mma.sync"),
    "sm_87": ("triton_generic", "mma.sync"),
    "sm_89": ("triton_generic", "mma.sync"),
    "sm_90": ("gluon_sm90", "wgmma.mma_async"),
    "sm_100": ("gluon_sm100", "tcgen05.mma"),
    "sm_103": ("gluon_sm100", "tcgen05.mma"),
    "sm_120": ("triton_generic", "mma.sync"),
    "sm_121": ("triton_generic", "mma.sync"),
}


#: Kernels without a matrix product: the gate cumsum, the qk l2 norms and normalized rows
#: (row reductions), context parallelism's forgetting starts (sums over gates, beta, keys).
NO_MATRIX_PRODUCT = {"chunk_cumsum_fwd", "qk_rnorm_fwd", "qk_l2norm_fwd", "forgetting_start"}

#: The fast tier's sample of the matrix: on these parts, the first listed kernel with a
#: matrix product (one per matrix engine: mma.sync, wgmma, tcgen05, and consumer Blackwell).
#: Every other compile is in the slow tier (``-m slow``).
FAST_SAMPLE = ("sm_80", "sm_90", "sm_100", "sm_120")


def _cases():
    for arch, (backend, instruction) in MATRIX.items():
        capability = assumed_device(arch).capability
        kernels = [] if backend == "reference" else kernels_for_target(capability, [backend])
        yield pytest.param(arch, backend, None, None, id=f"{arch}-choice")
        sampled = arch not in FAST_SAMPLE
        for kernel in kernels:
            fast = not sampled and kernel.kernel not in NO_MATRIX_PRODUCT
            sampled = sampled or fast
            yield pytest.param(arch, backend, kernel, instruction,
                               id=f"{arch}-{kernel.backend}.{kernel.kernel}-{kernel.specialization}",
                               marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("arch, backend, kernel, instruction", list(_cases()))
def test_matrix(arch, backend, kernel, instruction):
    device = assumed_device(arch)
    assert explain(device, QWEN35_CALL, env={}).selected == backend
    if kernel is None:
        return
    report = compile_kernel(kernel, device.capability)
    assert report.spill_bytes <= kernel.spill_bytes_allowed, f"{report.spill_bytes} bytes of spills"
    # ptxas's note C7512: every wgmma waited for alone (gluon_sm90's fused kernel with
    # fused.EARLY_O1 off, the order test_gluon_aot pins, ran 4-11% slower so).
    assert not report.wgmma_serialized, "ptxas serialized the kernel's wgmma"
    assert report.shared_bytes <= SMEM_OPTIN[device.capability]
    assert report.tmem_columns <= TMEM_COLUMNS
    if kernel.kernel not in NO_MATRIX_PRODUCT:
        assert instruction in report.ptx, f"{instruction} missing from {kernel.kernel} for {arch}"
    assert f".target sm_{device.capability[0]}{device.capability[1]}" in report.ptx
