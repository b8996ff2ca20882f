"""Fixtures for the vLLM glue tests: the plugin registered, a one-process gloo TP group, a faked CUDA platform.

There is no CUDA ``Platform`` on a CPU-only machine (``import vllm.platforms.cuda`` needs ``libcuda.so.1``), so
:func:`fake_cuda` swaps ``current_platform`` for a minimal CUDA platform with a chosen compute capability, in
``vllm.platforms`` and in every ``vllm`` module that imported it, plus ``cutlass_fp4_supported`` (it calls into
``vllm._C``).  Everything goes through a ``MonkeyPatch``, so nothing outlives the test or module that asked.
Every vLLM module that runs ``_C`` code at import time must be imported before faking: see ``_PREIMPORT``.
"""

from __future__ import annotations

import contextlib
import importlib
import socket
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the glue tests need vLLM 0.33.0)")

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
from vllm.config import DeviceConfig, KernelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum  # noqa: E402

from vllm_nvfp4_sm120.vllm import register as plugin  # noqa: E402


def swap_platform(mp: pytest.MonkeyPatch, fake: Platform) -> Platform:
    """Make ``fake`` vLLM's ``current_platform`` everywhere it was imported (undone with ``mp``)."""
    real = P.current_platform
    mp.setattr(P, "_current_platform", fake)
    for name, mod in list(sys.modules.items()):
        if name.startswith("vllm") and not name.startswith("vllm_nvfp4_sm120"):
            if vars(mod).get("current_platform") is real:
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
        if name.startswith("vllm") and vars(mod).get("cutlass_fp4_supported") is cutlass_fp4_supported:
            mp.setattr(mod, "cutlass_fp4_supported", lambda: False)  # it asks vllm._C
    return swap_platform(mp, FakeCudaPlatform())


@contextlib.contextmanager
def fake_cuda_context(cc: tuple[int, int]):
    """:func:`fake_cuda` for module-scoped fixtures."""
    with pytest.MonkeyPatch.context() as mp:
        yield fake_cuda(mp, cc)


def vllm_config(**kernel) -> VllmConfig:
    return VllmConfig(device_config=DeviceConfig(device="cpu"), kernel_config=KernelConfig(**kernel))


@pytest.fixture(scope="session")
def registered():
    """The plugin registered for the session (as vLLM's entry point would), unregistered at the end."""
    was = plugin.is_registered()
    plugin.register()
    assert plugin.is_registered(), "register() did nothing (VLLM_NVFP4_SM120=0 in the environment?)"
    yield plugin
    if not was:
        plugin.unregister()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tp_group():
    """A one-process gloo tensor-parallel group: vLLM's parallel linears need one to create weights."""
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        yield
        return
    with set_current_vllm_config(vllm_config()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        ensure_model_parallel_initialized(1, 1)
    yield
    destroy_model_parallel()
    destroy_distributed_environment()


@pytest.fixture
def fake_platform(monkeypatch):
    """``fake_platform((12, 0))`` fakes an sm_120 CUDA GPU for this test."""
    return lambda cc: fake_cuda(monkeypatch, cc)


@pytest.fixture
def plugin_log(caplog):
    """Records of the plugin's logger (vLLM's loggers do not propagate to the root, where caplog listens)."""
    import logging

    log = logging.getLogger("vllm.nvfp4_sm120")
    log.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="vllm.nvfp4_sm120")
    yield caplog
    log.removeHandler(caplog.handler)
