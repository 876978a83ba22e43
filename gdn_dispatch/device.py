"""What the device can do, read through the CUDA driver API (cuda-python), not torch.cuda.

The probe answers without creating a CUDA context in torch, works on machines with no
driver (it reports why there is no device instead of raising), and caches per device.
Tests and ``info --assume`` build :class:`DeviceInfo` values directly, or install a probe
of their own for a block with :func:`use_probe`.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceInfo:
    """One device as dispatch sees it.

    ``kind`` is "cuda" or "cpu". For CUDA devices: ``capability`` (major, minor),
    ``sm_count`` multiprocessors, ``smem_optin`` the opt-in shared memory per block in bytes.
    """

    kind: str
    index: int | None = None
    name: str = ""
    capability: tuple[int, int] | None = None
    sm_count: int = 0
    smem_optin: int = 0

    @property
    def label(self) -> str:
        """"cuda:0" or "cpu": the key GDN_BACKEND maps use."""
        return self.kind if self.index is None else f"{self.kind}:{self.index}"

    @property
    def arch(self) -> str:
        """"sm_90", "sm_100"... or "cpu"."""
        if self.capability is None:
            return self.kind
        return f"sm_{self.capability[0]}{self.capability[1]}"


CPU = DeviceInfo(kind="cpu", name="host CPU")

#: Opt-in shared memory per block (bytes) by compute capability (major, minor): what the
#: probe reads as ``CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`` on each part.
#: The one table of shared-memory limits: planners and ahead-of-time targets without a
#: device read it (:func:`shared_memory_per_block`). A multiprocessor holds 1 KB more
#: (:data:`SMEM_RESERVED_PER_BLOCK`, which each resident block reserves).
SMEM_OPTIN = {
    (7, 5): 64 * 1024,
    (8, 0): 163 * 1024,
    (8, 6): 99 * 1024,
    (8, 7): 163 * 1024,
    (8, 9): 99 * 1024,
    (9, 0): 227 * 1024,
    (10, 0): 227 * 1024,
    (10, 3): 227 * 1024,
    (12, 0): 99 * 1024,
    (12, 1): 99 * 1024,
}
#: Shared memory the hardware reserves for each resident block (sm_80 and later).
SMEM_RESERVED_PER_BLOCK = 1024


def shared_memory_per_block(device: DeviceInfo) -> int:
    """Opt-in shared memory per block of ``device``, bytes: the probed value, else (a
    DeviceInfo built by hand, or an ahead-of-time target) :data:`SMEM_OPTIN` of its
    capability; 0 when neither is known."""
    if device.smem_optin:
        return device.smem_optin
    if device.capability is None:
        return 0
    return SMEM_OPTIN.get(tuple(device.capability), 0)


# Representative parts, for `info --assume` and the dispatch matrix in tests.
_ASSUMED = {
    75: ("Tesla T4 (assumed)", 40),
    80: ("A100 (assumed)", 108),
    86: ("RTX A6000 (assumed)", 84),
    87: ("Jetson AGX Orin (assumed)", 16),
    89: ("L40S (assumed)", 142),
    90: ("H100/H200 (assumed)", 132),
    100: ("B200 (assumed)", 148),
    103: ("B300 (assumed)", 148),
    120: ("RTX PRO 6000 Blackwell (assumed)", 188),
    121: ("DGX Spark GB10 (assumed)", 48),
}


#: Compute capabilities a name may give (``info --assume``, ``compile --target``): those
#: whose limits :data:`SMEM_OPTIN` knows.
KNOWN_CAPABILITIES = tuple(sorted(SMEM_OPTIN))


def known_archs() -> str:
    """:data:`KNOWN_CAPABILITIES` as names, for messages: "sm_75, sm_80, ..."."""
    return ", ".join(f"sm_{major}{minor}" for major, minor in KNOWN_CAPABILITIES)


def parse_arch(arch: str) -> tuple[int, int]:
    """(major, minor) that an architecture's name spells ("sm_90", "sm_100a", "90");
    ValueError for text that spells none. Whether a part has it: :data:`KNOWN_CAPABILITIES`."""
    m = re.fullmatch(r"(?:sm_?)?(\d+)a?", arch.strip().lower())
    if m is None:
        raise ValueError(f"expected an architecture like sm_90 or sm_100, got {arch!r}")
    return divmod(int(m.group(1)), 10)


def assumed_device(arch: str) -> DeviceInfo:
    """A hypothetical device for "sm_90", "sm_100a", "90", "cpu"...: no hardware needed.
    ValueError for any other text, or an architecture outside :data:`KNOWN_CAPABILITIES`."""
    if arch.strip().lower() == "cpu":
        return CPU
    try:
        major, minor = parse_arch(arch)
    except ValueError:
        raise ValueError(f"expected 'cpu' or an architecture like sm_90 or sm_100, got {arch!r}") from None
    if (major, minor) not in KNOWN_CAPABILITIES:
        raise ValueError(f"unknown architecture {arch!r}; valid: cpu, {known_archs()}")
    number = major * 10 + minor
    name, sms = _ASSUMED.get(number, (f"sm_{number} (assumed)", 0))
    return DeviceInfo(kind="cuda", index=0, name=name, capability=(major, minor), sm_count=sms,
                      smem_optin=SMEM_OPTIN.get((major, minor), 0))


class DeviceProbe:
    """Reads CUDA devices through the driver API; cached, safe without a driver."""

    def __init__(self):
        self._error: str | None = None
        self._driver = None

    def _load(self):
        if self._driver is not None or self._error is not None:
            return self._driver
        try:
            from cuda.bindings import driver
        except Exception as exc:  # no cuda-python: a reason, not a crash
            self._error = f"cuda-python not importable: {type(exc).__name__}: {exc}"
            return None
        try:
            (err,) = driver.cuInit(0)
        except Exception as exc:  # no driver library on this machine
            self._error = f"no CUDA driver: {type(exc).__name__}: {exc}"
            return None
        if err != driver.CUresult.CUDA_SUCCESS:
            self._error = f"no CUDA device: cuInit returned {err.name}"
            return None
        self._driver = driver
        return driver

    @property
    def unavailable_reason(self) -> str | None:
        """Why there are no CUDA devices here, or None when the driver answered."""
        self._load()
        return self._error

    @functools.cache
    def count(self) -> int:
        driver = self._load()
        if driver is None:
            return 0
        err, n = driver.cuDeviceGetCount()
        return n if err == driver.CUresult.CUDA_SUCCESS else 0

    @functools.cache
    def info(self, index: int) -> DeviceInfo:
        """DeviceInfo of CUDA device ``index``; ValueError when there is no such device."""
        driver = self._load()
        if driver is None or not 0 <= index < self.count():
            raise ValueError(f"cuda:{index}: no such CUDA device ({self._error or f'{self.count()} present'})")
        err, dev = driver.cuDeviceGet(index)
        attr = driver.CUdevice_attribute

        def get(a):
            e, value = driver.cuDeviceGetAttribute(a, dev)
            return value if e == driver.CUresult.CUDA_SUCCESS else 0

        err, raw = driver.cuDeviceGetName(256, dev)
        name = raw.split(b"\0", 1)[0].decode(errors="replace")
        return DeviceInfo(
            kind="cuda",
            index=index,
            name=name,
            capability=(get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                        get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)),
            sm_count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
            smem_optin=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        )

    def all(self) -> list[DeviceInfo]:
        """Every CUDA device, then the CPU."""
        return [self.info(i) for i in range(self.count())] + [CPU]

    def for_torch_device(self, device) -> DeviceInfo:
        """DeviceInfo for a torch.device ("cpu", "cuda", "cuda:1")."""
        if device.type == "cpu":
            return CPU
        if device.type != "cuda":
            raise ValueError(f"device {device}: only cuda and cpu devices are supported")
        index = device.index
        if index is None:
            import torch  # the current device is torch's notion, asked only for "cuda" without index
            if not torch.cuda.is_available():
                raise ValueError(f"device {device}: no CUDA device here (torch {torch.__version__}, "
                                 f"CUDA {torch.version.cuda or 'not built in'})")
            index = torch.cuda.current_device()
        return self.info(index)


@functools.cache
def _driver_probe() -> DeviceProbe:
    return DeviceProbe()


_PROBE_OVERRIDE: contextvars.ContextVar = contextvars.ContextVar("gdn_dispatch_probe", default=None)


def default_probe():
    """The probe in force: the driver probe (created on first use, never at import), or
    the one installed by :func:`use_probe` in this context."""
    return _PROBE_OVERRIDE.get() or _driver_probe()


@contextlib.contextmanager
def use_probe(probe):
    """Within the block, calls in this context see ``probe``'s devices (any object with
    ``count()``, ``info(index)``, ``all()``, ``for_torch_device(device)`` and
    ``unavailable_reason``): how tests stand in hardware without patching module state."""
    token = _PROBE_OVERRIDE.set(probe)
    try:
        yield probe
    finally:
        _PROBE_OVERRIDE.reset(token)
