"""vLLM's view of the GPU as the dispatch's :class:`~vllm_nvfp4_sm120.dispatch.hw.Capability` (shared by the
linear and MoE glue)."""

from __future__ import annotations

from ..dispatch.hw import Capability


def current_capability() -> Capability | None:
    """vLLM's ``current_platform`` (``DeviceCapability.to_int()``, e.g. 120), None off CUDA; read at each call, so
    the tests' fake platform is seen."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    cap = current_platform.get_device_capability()
    return None if cap is None else Capability(cap.to_int())
