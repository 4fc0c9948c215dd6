"""The "template" Backend: the host CPU under its own backend name, below the built-in cpu backend."""

from __future__ import annotations

import os
import re
from importlib import metadata

import torch
from flashllm.registry.backend import Availability, Backend, DeviceAdapter
from flashllm.registry.precision import DeviceProfile

NAME = "template"
DEVICE_TYPE = "cpu"
# The built-in cpu backend has priority 10; staying below it means `--device cpu` and
# `--device auto` keep picking it, and this backend runs only when asked: `--backend template`.
PRIORITY = 5
# The oldest torch this package's kernels were tested with; a vendor would put its SDK pin here.
MIN_TORCH = (2, 4)

_FLOATS = frozenset({torch.float32, torch.float16, torch.bfloat16})
# What the device (the host CPU) can run, whichever backend's kernels run it: ops without a
# template kernel fall back to the reference, which runs these quantized formats on a CPU too.
HOST_CPU = DeviceProfile(
    "host CPU (template)",
    dtypes=_FLOATS,
    quant=frozenset({"none", "w8a16", "w4a16", "a8w8"}),
    kv_dtypes=frozenset({torch.int8, torch.float8_e4m3fn}),
    native_bf16=False,  # not probed here: `--dtype auto` then computes in float32
    notes="one template kernel (rms_norm); every other op runs the reference",
    accelerator=False,
)


class HostAdapter(DeviceAdapter):
    """Device services for the host CPU: nothing to select or synchronize; memory from the OS."""

    dist_backend = "gloo"

    def __init__(self) -> None:
        super().__init__(DEVICE_TYPE)

    def set_device(self, device: torch.device) -> None:
        return None

    def synchronize(self, device: torch.device) -> None:
        return None

    def memory_info(self, device: torch.device) -> tuple[int, int]:
        """(free_bytes, total_bytes) of host memory, which sizes the KV cache when it is not given."""
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


class TemplateBackend(Backend):
    """The template's device facts; its kernels are registered by `kernels.register`."""

    def is_available(self) -> Availability:
        """Available when the installed torch is at least MIN_TORCH; the reason says what was found."""
        # A vendor backend checks here, not at import, that its SDK imports and sees a device,
        # e.g. importlib.util.find_spec("vendor_torch") and vendor_torch.device_count() > 0.
        found = _torch_version()
        if found < MIN_TORCH:
            wanted = ".".join(map(str, MIN_TORCH))
            return False, (f"needs torch >= {wanted} for its kernels, found torch {torch.__version__}; "
                           f"pip install 'torch>={wanted}'")
        capability = torch.backends.cpu.get_cpu_capability()
        return True, f"host CPU ({capability}, {os.cpu_count()} cores), torch {torch.__version__}"

    def device_profile(self, device: torch.device) -> DeviceProfile:
        return HOST_CPU

    def known_profiles(self) -> list[DeviceProfile]:
        return [HOST_CPU]

    def adapter(self) -> DeviceAdapter:
        return HostAdapter()


def _torch_version() -> tuple[int, int]:
    # from the distribution metadata: "2.13.0+cpu" -> (2, 13)
    numbers = re.findall(r"\d+", metadata.version("torch"))
    return int(numbers[0]), int(numbers[1])


def make_backend() -> Backend:
    """Build the template backend with its kernels; cheap, so plugin discovery stays fast."""
    from flashllm_backend_template import kernels

    backend = TemplateBackend(
        name=NAME,
        device_type=DEVICE_TYPE,
        priority=PRIORITY,
        description="flashllm-backend-template: an rms_norm kernel in plain torch on the host CPU",
        install_hint="pip install flashllm-backend-template",
        proof="conformance",
    )
    kernels.register(backend)
    return backend
