"""Faking vLLM's platform on a CPU-only machine (shared by conftest and the tests).

There is no CUDA ``Platform`` here (``import vllm.platforms.cuda`` needs ``libcuda.so.1``), so :func:`fake_cuda`
swaps ``current_platform`` for a minimal CUDA platform with a chosen compute capability, in ``vllm.platforms`` and
in every ``vllm`` module that imported it, plus ``cutlass_fp4_supported`` (it calls into ``vllm._C``).  Everything
goes through a ``MonkeyPatch``, so nothing outlives the test or module that asked.  Every vLLM module that runs
``_C`` code at import time must be imported before faking: see ``_PREIMPORT``.
"""

from __future__ import annotations

import contextlib
import importlib
import sys

import pytest

_PREIMPORT = (
    "vllm.model_executor.kernels.linear",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.quantization.modelopt",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4",
    "vllm.model_executor.layers.quantization.online.fp8",
    "vllm.model_executor.layers.quantization.online.lm_head",
    "vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils",
    "vllm.distributed",
    "vllm.engine.arg_utils",
)
for _m in _PREIMPORT:
    importlib.import_module(_m)

import vllm.platforms as P  # noqa: E402
from vllm.config import DeviceConfig, KernelConfig, VllmConfig  # noqa: E402
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum  # noqa: E402


def swap_platform(mp: pytest.MonkeyPatch, fake: Platform) -> Platform:
    """Make ``fake`` vLLM's ``current_platform`` everywhere it was imported (undone with ``mp``)."""
    real = P.current_platform
    mp.setattr(P, "_current_platform", fake)
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm") and not name.startswith("vllm_nvfp4_sm120"):
            if getattr(mod, "__dict__", {}).get("current_platform") is real:
                mp.setattr(mod, "current_platform", fake)
    return fake


def cpu_platform(mp: pytest.MonkeyPatch) -> Platform:
    """vLLM's CPU platform (what ``VLLM_TARGET_DEVICE=cpu`` gives): EngineArgs' CLI needs a device type."""
    from vllm.platforms.cpu import CpuPlatform

    return swap_platform(mp, CpuPlatform())


def fake_cuda(mp: pytest.MonkeyPatch, cc: tuple[int, int]) -> Platform:
    """Make vLLM believe it runs on a CUDA GPU of compute capability ``cc`` (undone with ``mp``)."""

    class FakeCudaPlatform(Platform):
        _enum = PlatformEnum.CUDA
        device_name = device_type = "cuda"
        dispatch_key = "CUDA"

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(*cc)

    nvfp4_utils = sys.modules["vllm.model_executor.layers.quantization.utils.nvfp4_utils"]
    cutlass_fp4_supported = nvfp4_utils.cutlass_fp4_supported
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm") and getattr(mod, "__dict__", {}).get("cutlass_fp4_supported") is cutlass_fp4_supported:
            mp.setattr(mod, "cutlass_fp4_supported", lambda: False)  # it asks vllm._C
    return swap_platform(mp, FakeCudaPlatform())


@contextlib.contextmanager
def fake_cuda_context(cc: tuple[int, int]):
    """:func:`fake_cuda` for module-scoped fixtures."""
    with pytest.MonkeyPatch.context() as mp:
        yield fake_cuda(mp, cc)


def vllm_config(**kernel) -> VllmConfig:
    return VllmConfig(device_config=DeviceConfig(device="cpu"), kernel_config=KernelConfig(**kernel))
