"""Which kernel vLLM's own ModelOpt / compressed-tensors configs give a layer, on faked sm_120 / sm_100 / sm_90."""

from __future__ import annotations

import pytest
import vllm.model_executor.kernels.linear as L
from vllm.config import set_current_vllm_config
from vllm.platforms import PlatformEnum

import fp4_routes_stub
import nvfp4_layers as NL
from vllm_nvfp4_sm120.dispatch import ops  # noqa: F401  (registers the ops)
from vllm_nvfp4_sm120.vllm import linear as ours
from vllm_platform import vllm_config
import vllm_nvfp4_sm120.vllm.log as glue_log_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("registered", "tp_group")
FORMATS = ["modelopt", "ct"]


def kernel_for(fmt: str, act: str, kind: str = "qkv", **kernel_config):
    with set_current_vllm_config(vllm_config(**kernel_config)):
        return NL.kernel_of(NL.build_layer(NL.quant_config(fmt, act), kind))


def test_our_classes_lead_vllms_cuda_list():
    lst = L._POSSIBLE_NVFP4_KERNELS[PlatformEnum.CUDA]
    assert tuple(lst[: len(ours.KERNEL_CLASSES)]) == ours.KERNEL_CLASSES
    assert L.EmulationNvFp4LinearKernel in lst[len(ours.KERNEL_CLASSES):]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "down"])
def test_auto_on_sm120_is_ours(fake_platform, fmt, kind):
    fake_platform((12, 0))
    assert type(kernel_for(fmt, "w4a4", kind)) is ours.Sm120TritonNvFp4LinearKernel


@pytest.mark.parametrize("cc", [(12, 1)])
def test_auto_on_sm121_is_ours(fake_platform, cc):
    fake_platform(cc)
    assert type(kernel_for("modelopt", "w4a4")) is ours.Sm120TritonNvFp4LinearKernel


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("cc", [(9, 0), (10, 0)])
def test_other_gpus_not_ours_unless_named(fake_platform, fmt, cc):
    fake_platform(cc)
    assert not isinstance(kernel_for(fmt, "w4a4"), ours.Sm120NvFp4LinearKernel)
    assert type(kernel_for(fmt, "w4a4", linear_backend="nvfp4_sm120")) is ours.Sm120TritonNvFp4LinearKernel
    assert type(kernel_for(fmt, "w4a4", linear_backend="nvfp4_sm120_triton")) is ours.Sm120TritonNvFp4LinearKernel


@pytest.mark.parametrize("fmt", FORMATS)
def test_w4a16_checkpoints_opt_in(fake_platform, fmt):
    fake_platform((12, 0))
    assert not isinstance(kernel_for(fmt, "w4a16"), ours.Sm120NvFp4LinearKernel)  # vLLM forces Marlin
    for name in ("nvfp4_sm120", "nvfp4_sm120_w4a16"):
        assert type(kernel_for(fmt, "w4a16", linear_backend=name)) is ours.Sm120W4A16NvFp4LinearKernel
    per_quant = {"nvfp4_w4a16": "nvfp4_sm120_w4a16"}
    assert type(kernel_for(fmt, "w4a16", linear_backend_per_quant=per_quant)) is ours.Sm120W4A16NvFp4LinearKernel
    fi = "nvfp4_sm120_flashinfer_w4a16"
    assert type(kernel_for(fmt, "w4a16", linear_backend=fi)) is ours.Sm120FlashInferW4A16NvFp4LinearKernel
    assert type(kernel_for(fmt, "w4a16", linear_backend_per_quant={"nvfp4_w4a16": fi})) is \
        ours.Sm120FlashInferW4A16NvFp4LinearKernel


@pytest.fixture
def all_routes_available(monkeypatch):
    """Every route selectable: the fp4_routes names (stub if missing)."""
    fp4_routes_stub.install(monkeypatch)


W4A4_NAMED = {
    "nvfp4_sm120": ours.Sm120TritonNvFp4LinearKernel,
    "nvfp4_sm120_triton": ours.Sm120TritonNvFp4LinearKernel,
    "nvfp4_sm120_cublas": ours.Sm120CublasNvFp4LinearKernel,
    "nvfp4_sm120_b12x": ours.Sm120B12xNvFp4LinearKernel,
    "nvfp4_sm120_w4a16": ours.Sm120W4A16NvFp4LinearKernel,
    "nvfp4_sm120_flashinfer_w4a16": ours.Sm120FlashInferW4A16NvFp4LinearKernel,
}


@pytest.mark.parametrize("name, cls", W4A4_NAMED.items(), ids=list(W4A4_NAMED))
def test_each_name_selects_its_class(fake_platform, all_routes_available, name, cls):
    fake_platform((12, 0))
    assert type(kernel_for("modelopt", "w4a4", linear_backend=name)) is cls
    assert type(kernel_for("ct", "w4a4", linear_backend_per_quant={"nvfp4_w4a4": name})) is cls


def test_refused_vendor_route_falls_back_and_says_why(fake_platform, plugin_log, monkeypatch):
    """A route whose requirement refuses the layer at load time: vLLM's automatic selection serves it (our first
    class on sm_120), with one line naming the route and the reason."""
    import torch

    from vllm_nvfp4_sm120.dispatch import vendor

    monkeypatch.setattr(vendor, "cublas_refusal", lambda capability, n, k, **kw: "no cuBLAS FP4 in this test")
    monkeypatch.setattr(glue_log_state, "_logged", set())
    fake_platform((12, 0))
    with set_current_vllm_config(vllm_config(linear_backend="nvfp4_sm120_cublas")):
        layer = NL.build_layer(NL.quant_config("modelopt", "w4a4"), "qkv")
        NL.load_checkpoint(layer, "modelopt", NL.problem_for(layer, torch.Generator().manual_seed(0)))
        layer.quant_method.process_weights_after_loading(layer)
    kernel = NL.kernel_of(layer)
    assert type(kernel) is ours.Sm120CublasNvFp4LinearKernel
    assert type(kernel._fallback) is ours.Sm120TritonNvFp4LinearKernel
    [msg] = [r.getMessage() for r in plugin_log.records if "cannot take" in r.getMessage()]
    assert "route cublas" in msg and "no cuBLAS FP4 in this test" in msg


def test_w4a4_route_named_on_w4a16_checkpoint_falls_back(fake_platform, plugin_log, monkeypatch):
    monkeypatch.setattr(glue_log_state, "_logged", set())
    fake_platform((12, 0))
    kernel = kernel_for("modelopt", "w4a16", linear_backend="nvfp4_sm120_triton")
    assert not isinstance(kernel, ours.Sm120NvFp4LinearKernel)
    assert any("needs activation scales" in r.getMessage() for r in plugin_log.records)


def test_disabled_kernels_env(fake_platform, monkeypatch):
    fake_platform((12, 0))
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", "Sm120TritonNvFp4LinearKernel")
    assert type(kernel_for("modelopt", "w4a4")) is not ours.Sm120TritonNvFp4LinearKernel
    monkeypatch.setenv("VLLM_DISABLED_KERNELS", ",".join(c.__name__ for c in ours.KERNEL_CLASSES))
    assert not isinstance(kernel_for("modelopt", "w4a4"), ours.Sm120NvFp4LinearKernel)
    assert not isinstance(kernel_for("modelopt", "w4a4", linear_backend="nvfp4_sm120"), ours.Sm120NvFp4LinearKernel)


def test_not_cuda_not_supported():
    """On the real (CPU-only) platform our classes decline, whatever is named."""
    for cls in ours.KERNEL_CLASSES:
        ok, why = cls.is_supported()
        assert not ok and "CUDA" in why
