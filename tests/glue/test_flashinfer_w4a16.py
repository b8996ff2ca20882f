"""Route ``nvfp4_sm120_flashinfer_w4a16`` in vLLM layers, on a faked sm_120 with FlashInfer faked on CPU.

FlashInfer's ``mm_bf16_fp4`` runs only on sm_100/sm_12x, so nothing here checks its numerics: the fake
(``fp4_routes_stub.install_flashinfer_w4a16``) lays the weight out with each backend's shapes and dtypes and
computes the W4A16 reference on the original weight recovered from that layout.  What is tested is ours: the
load-time refusals and fallback, what the layer keeps after preparation, and the op the forward calls.
"""

from __future__ import annotations

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

import fp4_routes_stub
import nvfp4_layers as NL
import vllm_nvfp4_sm120.vllm.log as glue_log_state
from vllm_nvfp4_sm120.format import linear_w4a16_ref, swizzle_128x4
from vllm_nvfp4_sm120.vllm import linear as ours
from vllm_platform import fake_cuda, vllm_config

pytestmark = pytest.mark.usefixtures("registered", "tp_group")

NAME = "nvfp4_sm120_flashinfer_w4a16"
FI = ours.Sm120FlashInferW4A16NvFp4LinearKernel


def build_layer(fmt: str, act: str, kind: str, *, dtype=torch.bfloat16, layer_idx: int = 0) -> torch.nn.Module:
    """``nvfp4_layers.build_layer`` plus fused kinds with N % 64 == 0 (cute-dsl's rule on sm_12x) and a dtype."""
    cfg = NL.quant_config(fmt, act)
    common = dict(bias=False, quant_config=cfg, params_dtype=dtype)
    p = f"model.layers.{layer_idx}"
    if kind == "qkv64":  # q 128, k 64, v 64
        return QKVParallelLinear(NL.HIDDEN, head_size=32, total_num_heads=4, total_num_kv_heads=2,
                                 prefix=f"{p}.self_attn.qkv_proj", **common)
    if kind == "gate_up64":
        return MergedColumnParallelLinear(NL.HIDDEN, [64, 64], prefix=f"{p}.mlp.gate_up_proj", **common)
    assert dtype == torch.bfloat16
    return NL.build_layer(cfg, kind, layer_idx)


def load(layer: torch.nn.Module, fmt: str, seed: int, *, part_decs: list[float] | None = None) -> None:
    """Checkpoint tensors into the layer; fused parts share one weight global unless ``part_decs`` says otherwise."""
    prob = NL.problem_for(layer, torch.Generator().manual_seed(seed))
    parts = len(layer.logical_widths)
    NL.load_checkpoint(layer, fmt, prob, part_decs=part_decs or [float(prob.part_globals[0].dec)] * parts)
    codes = layer.weight if fmt == "modelopt" else layer.weight_packed
    layer.codes_before, layer.scales_before = codes.data.clone(), layer.weight_scale.data.clone()


# (format, activation, layer kind, VLLM_NVFP4_SM120_FI_W4A16_BACKEND)
CASES = [
    ("modelopt", "w4a4", "qkv64", "cute-dsl"),
    ("ct", "w4a16", "gate_up64", "cute-dsl"),
    ("modelopt", "w4a16", "qkv", "cudnn"),  # N = 160: not cute-dsl's, fine for cuDNN
    ("ct", "w4a4", "down", "cute-dsl-native"),
]


def _case_id(case):
    return "-".join(case)


@pytest.fixture(scope="module")
def built(registered, tp_group):
    """Each case's layer loaded and processed on a faked sm_120 with FlashInfer faked."""
    layers = {}
    with pytest.MonkeyPatch.context() as mp:
        fake_cuda(mp, (12, 0))
        fp4_routes_stub.install_flashinfer_w4a16(mp)
        for i, case in enumerate(CASES):
            fmt, act, kind, backend = case
            mp.setenv(ours.FI_W4A16_BACKEND_ENV, backend)
            with set_current_vllm_config(vllm_config(linear_backend=NAME)):
                layer = build_layer(fmt, act, kind)
                load(layer, fmt, seed=i)
                layer.quant_method.process_weights_after_loading(layer)
            layers[case] = layer
    return layers


@pytest.fixture
def fake_flashinfer(monkeypatch):
    return fp4_routes_stub.install_flashinfer_w4a16(monkeypatch)


def _tensors(layer):
    return [*layer.parameters(), *layer.buffers()]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prepared_layer_keeps_only_flashinfers_tensors(built, case):
    layer = built[case]
    fmt, act, kind, backend = case
    kernel = NL.kernel_of(layer)
    assert type(kernel) is FI and kernel._fallback is None and kernel.fi_backend == backend
    n, k = layer.codes_before.shape[0], layer.codes_before.shape[1] * 2
    assert layer._nvfp4_sm120_fi_n == n
    # One weight global, FlashInfer's alpha: the one vLLM left on the layer (the parts were loaded equal).
    torch.testing.assert_close(layer._nvfp4_sm120_fi_alpha, layer.weight_global_scale.reshape(1), rtol=0, atol=0)
    assert not hasattr(layer, "_nvfp4_sm120_w_dec_rows") and not hasattr(layer, "_nvfp4_sm120_part_dec")
    code_bytes = [t for t in _tensors(layer) if t.dtype in (torch.uint8, torch.int32)
                  and t.numel() * t.element_size() == n * k // 2]
    assert len(code_bytes) == 1, "one copy of the codes"
    if backend == "cute-dsl":  # repacked: the checkpoint's row-major codes and linear scales are gone
        assert layer.weight.dtype == torch.int32 and layer.weight.shape == (k // 16, 2 * n)
        assert layer.weight_scale.dtype == torch.uint8 and layer.weight_scale.shape == (k // 16, n)
        assert not any(t.dtype == torch.float8_e4m3fn for t in _tensors(layer))
    else:  # the codes as they are
        assert torch.equal(layer.weight.data, layer.codes_before)
        expected = layer.scales_before if backend == "cudnn" else swizzle_128x4(layer.scales_before)
        assert layer.weight_scale.dtype == torch.float8_e4m3fn
        assert torch.equal(layer.weight_scale.data.view(torch.uint8), expected.view(torch.uint8))
        assert sum(t.dtype == torch.float8_e4m3fn for t in _tensors(layer)) == 1, "one copy of the scales"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("lead", [(1,), (17,), (2, 20)])
def test_apply_calls_flashinfer_on_the_prepared_weight(built, fake_flashinfer, case, lead):
    layer = built[case]
    n, k = layer.codes_before.shape[0], layer.codes_before.shape[1] * 2
    x = torch.randn(*lead, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    out = NL.kernel_of(layer).apply_weights(layer, x, bias)
    [call] = fp4_routes_stub.FI_W4A16_CALLS
    assert call["backend"] == case[3]
    assert call["b"].data_ptr() == layer.weight.data_ptr()
    assert call["b_descale"].data_ptr() == layer.weight_scale.data_ptr()
    assert call["alpha"] is layer._nvfp4_sm120_fi_alpha
    # The fake computes the reference itself, so the plumbing must reproduce it exactly; the bias goes onto
    # FlashInfer's bf16 output (mm_bf16_fp4 has no bias epilogue).
    expected = linear_w4a16_ref(x.reshape(-1, k), layer.codes_before, layer.scales_before, layer.weight_global_scale)
    expected = (expected + bias).reshape(*lead, n)
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_empty_batch(built, fake_flashinfer):
    layer = built[CASES[0]]
    out = NL.kernel_of(layer).apply_weights(layer, torch.empty(0, NL.HIDDEN, dtype=torch.bfloat16))
    assert out.shape == (0, layer._nvfp4_sm120_fi_n) and not fp4_routes_stub.FI_W4A16_CALLS


def test_apply_is_fullgraph_compilable(built, fake_flashinfer):
    layer = built[CASES[0]]
    kernel = NL.kernel_of(layer)
    fn = torch.compile(lambda x: kernel.apply_weights(layer, x), fullgraph=True, backend="aot_eager", dynamic=True)
    for t in (3, 40):
        x = torch.randn(t, NL.HIDDEN, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        torch.testing.assert_close(fn(x), kernel.apply_weights(layer, x), rtol=0, atol=0)


def test_fake_tensor_shapes(built):
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = built[CASES[0]]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.empty(5, 7, NL.HIDDEN, dtype=torch.bfloat16))
        out = NL.kernel_of(layer).apply_weights(layer, x)
    assert out.shape == (5, 7, layer._nvfp4_sm120_fi_n) and out.dtype == torch.bfloat16


# ---- refusals: one log line, vLLM's selection (our Triton route on sm_120) takes the layer --------------------

REFUSALS = {
    "fp16": (dict(kind="gate_up64", dtype=torch.float16), None, "takes bfloat16 activations only"),
    "n-not-64": (dict(kind="qkv"), None, "N = 160 is not a multiple of 64"),
    "part-globals": (dict(kind="gate_up64", part_decs=[1e-4, 2e-4]), None, "fused parts have different weight global"),
    "bad-backend": (dict(kind="gate_up64"), "marlin", "VLLM_NVFP4_SM120_FI_W4A16_BACKEND='marlin' is not one of"),
}


@pytest.mark.parametrize("what", REFUSALS)
def test_refused_layers_fall_back_with_one_line(fake_platform, plugin_log, monkeypatch, what):
    spec, backend, reason = REFUSALS[what]
    spec = dict(spec)
    part_decs = spec.pop("part_decs", None)
    monkeypatch.setattr(glue_log_state, "_logged", set())
    fake_platform((12, 0))
    fp4_routes_stub.install_flashinfer_w4a16(monkeypatch)
    if backend is not None:
        monkeypatch.setenv(ours.FI_W4A16_BACKEND_ENV, backend)
    for i in range(2):
        with set_current_vllm_config(vllm_config(linear_backend=NAME)):
            layer = build_layer("modelopt", "w4a4", layer_idx=i, **spec)
            load(layer, "modelopt", seed=i, part_decs=part_decs)
            layer.quant_method.process_weights_after_loading(layer)
        kernel = NL.kernel_of(layer)
        assert type(kernel) is FI and type(kernel._fallback) is ours.Sm120TritonNvFp4LinearKernel
        assert torch.equal(layer.weight.data, layer.codes_before)  # nothing prepared
    msgs = [r.getMessage() for r in plugin_log.records if "cannot take" in r.getMessage()]
    assert len(msgs) == 1 and reason in msgs[0] and "model.layers.0." in msgs[0], msgs
    x = torch.randn(3, NL.HIDDEN, generator=torch.Generator().manual_seed(0)).to(spec.get("dtype", torch.bfloat16))
    assert kernel.apply_weights(layer, x).shape == (3, layer.weight_scale.shape[0])
