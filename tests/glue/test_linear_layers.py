"""Layers built by vLLM (create_weights → checkpoint tensors → process_weights_after_loading) with our kernels.

Globals as vLLM normalizes them, the fused-part spread warning, and ``apply_weights`` on CPU (the op's torch
reference) against vLLM's ``EmulationNvFp4LinearKernel`` on the same layer.  Layers are built once per module.
"""

from __future__ import annotations

import pytest
import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig
from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

import fp4_routes_stub
import nvfp4_layers as NL
from vllm_nvfp4_sm120.dispatch.hw import SM120_REFERENCE
from vllm_nvfp4_sm120.dispatch.linear import small_t_threshold
from vllm_nvfp4_sm120.vllm import linear as ours
from vllm_platform import fake_cuda, vllm_config
import vllm_nvfp4_sm120.vllm.log as glue_log_state  # noqa: E402

pytestmark = pytest.mark.usefixtures("registered", "tp_group")

# (format, activation, layer kind, --linear-backend)
CASES = [
    ("modelopt", "w4a4", "qkv", "auto"),
    ("ct", "w4a4", "gate_up", "auto"),
    ("modelopt", "w4a4", "down", "auto"),
    ("modelopt", "w4a4", "qkv", "nvfp4_sm120_cublas"),
    ("modelopt", "w4a4", "qkv", "nvfp4_sm120_b12x"),
    ("modelopt", "w4a16", "gate_up", "nvfp4_sm120"),
    ("ct", "w4a16", "qkv", "nvfp4_sm120_w4a16"),
]
PREFILL_T = 40  # above every route's W4A16 threshold on sm_120
SMALL_T = 3


@pytest.fixture(scope="module")
def built(registered, tp_group):
    """Each case's layer, loaded from the same problem per (format, kind), processed under a faked sm_120."""
    layers, problems, emulated = {}, {}, {}
    with pytest.MonkeyPatch.context() as mp:
        fake_cuda(mp, (12, 0))
        fp4_routes_stub.install(mp)
        for fmt, act, kind, backend in CASES:
            with set_current_vllm_config(vllm_config(linear_backend=backend)):
                layer = NL.build_layer(NL.quant_config(fmt, act), kind)
                key = (fmt, act, kind)
                problems.setdefault(key, NL.problem_for(layer, torch.Generator().manual_seed(hash(key) % 2**31)))
                NL.load_checkpoint(layer, fmt, problems[key])
                codes = layer.weight if fmt == "modelopt" else layer.weight_packed
                layer.weight_before = codes.data.clone()  # to check the codes are never copied
                layer.quant_method.process_weights_after_loading(layer)
                layers[(fmt, act, kind, backend)] = layer
    # vLLM's emulation kernel runs on the real platform (under the fake it takes a CUDA-only Triton path)
    em = EmulationNvFp4LinearKernel(NvFp4LinearLayerConfig())
    for case, layer in layers.items():
        if case[1] == "w4a4" and case[3] == "auto":
            em.process_weights_after_loading(layer)
            emulated[case[:3]] = lambda x, layer=layer: em.apply_weights(layer, x)
    return layers, problems, emulated


def _case_id(case):
    return "-".join(case)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_and_globals(built, case):
    layers, problems, _ = built
    layer, prob = layers[case], problems[case[:3]]
    fmt, act, kind, backend = case
    kernel = NL.kernel_of(layer)
    assert isinstance(kernel, ours.Sm120NvFp4LinearKernel) and kernel._fallback is None
    parts = NL.part_decodes(prob)
    # vLLM's merge: ModelOpt keeps the largest decode, compressed-tensors the largest encode (smallest decode)
    merged = parts.max() if fmt == "modelopt" else 1.0 / (1.0 / parts).max()
    torch.testing.assert_close(layer.weight_global_scale.float(), merged, rtol=0, atol=0)
    rows = layer._nvfp4_sm120_w_dec_rows
    if act == "w4a4":
        torch.testing.assert_close(layer.alpha, layer.input_global_scale * layer.weight_global_scale)
        torch.testing.assert_close(rows, merged.expand(rows.shape[0]), rtol=0, atol=0)
    else:
        expected = torch.repeat_interleave(parts if fmt == "modelopt" else 1.0 / (1.0 / parts),
                                           torch.tensor(layer.logical_widths))
        torch.testing.assert_close(rows, expected, rtol=1e-7, atol=0)
    assert not hasattr(layer, "_nvfp4_sm120_part_dec")


@pytest.mark.parametrize("case", [c for c in CASES if c[3] in ("nvfp4_sm120_cublas", "nvfp4_sm120_b12x")], ids=_case_id)
def test_swizzled_scales_and_padding(built, case):
    layer = built[0][case]
    n, k = layer.weight_scale.shape[0], layer.weight_scale.shape[1] * 16
    sw = layer._nvfp4_sm120_w_scales_swizzled
    assert sw is not None and sw.dtype == torch.float8_e4m3fn
    codes = [p for p in layer.parameters() if p.dtype == torch.uint8]
    assert len(codes) == 1, "one copy of the codes"
    if case[3] == "nvfp4_sm120_b12x":
        assert layer.weight.shape == (-(-n // 32) * 32, -(-k // 32) * 16)
    assert torch.equal(layer.weight[:n, : k // 2], layer.weight_before)


@pytest.mark.parametrize("case", [c for c in CASES if c[1] == "w4a4"], ids=_case_id)
@pytest.mark.parametrize("lead", [(PREFILL_T,), (2, PREFILL_T // 2)])
def test_w4a4_prefill_matches_vllm_emulation(built, case, lead):
    layers, _, emulated = built
    layer = layers[case]
    reference = emulated[case[:3]]  # emulation on the auto layer of the same checkpoint
    k = layer.weight_scale.shape[1] * 16
    x = torch.randn(*lead, k, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    ours_out = NL.kernel_of(layer).apply_weights(layer, x)
    theirs = reference(x.reshape(-1, k)).reshape(*lead, -1)
    assert ours_out.shape == theirs.shape and ours_out.dtype == torch.bfloat16
    # Same quantized operands; vLLM rounds each dequantized operand to bf16 and multiplies in bf16.
    scale = theirs.float().abs().max().item()
    torch.testing.assert_close(ours_out.float(), theirs.float(), rtol=2e-2, atol=2e-2 * scale)


def _dequantized(layer, part_decs=None):
    """vLLM's own dequantization of the layer's weight, each fused part with its decode global, fp32."""
    n, k = layer.weight_scale.shape[0], layer.weight_scale.shape[1] * 16
    codes, scales = layer.weight.data[:n, : k // 2], layer.weight_scale.data
    if part_decs is None:
        return dequantize_to_dtype(codes, scales, layer.weight_global_scale, torch.float32, swizzle=False)
    out, row = [], 0
    for width, dec in zip(layer.logical_widths, part_decs):
        out.append(dequantize_to_dtype(codes[row:row + width], scales[row:row + width], dec, torch.float32,
                                       swizzle=False))
        row += width
    return torch.cat(out)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_small_t_and_w4a16_match_vllm_dequantized_weight(built, case):
    """At decode sizes (and always for W4A16 layers) the weight-only kernel runs: x @ dequant(W).T."""
    layers, problems, _ = built
    layer = layers[case]
    t = SMALL_T if case[1] == "w4a4" else PREFILL_T
    if case[1] == "w4a4":
        assert t <= small_t_threshold(SM120_REFERENCE, NL.kernel_of(layer).route)
    x = torch.randn(t, layer.weight_scale.shape[1] * 16, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    bias = torch.randn(layer.weight_scale.shape[0], generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    got = NL.kernel_of(layer).apply_weights(layer, x, bias)
    w = _dequantized(layer, None if case[1] == "w4a4" else NL.part_decodes(problems[case[:3]]))
    expected = (x.float() @ w.t() + bias.float()).to(torch.bfloat16)
    torch.testing.assert_close(got, expected, rtol=1.6e-2, atol=1e-2 * expected.float().abs().max().item())


def test_apply_is_fullgraph_compilable(built):
    """torch.compile traces through apply_weights (the op is opaque, with a fake implementation): no graph break."""
    layer = built[0][("modelopt", "w4a4", "qkv", "auto")]
    kernel = NL.kernel_of(layer)
    fn = torch.compile(lambda x: kernel.apply_weights(layer, x), fullgraph=True, backend="aot_eager", dynamic=True)
    for t in (PREFILL_T, SMALL_T):
        x = torch.randn(t, NL.HIDDEN, generator=torch.Generator().manual_seed(t)).to(torch.bfloat16)
        torch.testing.assert_close(fn(x), kernel.apply_weights(layer, x), rtol=0, atol=0)


def test_fake_tensor_shapes(built):
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = built[0][("ct", "w4a4", "gate_up", "auto")]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.empty(5, 7, NL.HIDDEN, dtype=torch.bfloat16))
        out = NL.kernel_of(layer).apply_weights(layer, x)
    assert out.shape == (5, 7, 2 * NL.INTERMEDIATE) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("spread, warns", [(0.06, True), (0.04, False), (0.0, False)])
def test_fused_part_spread_warning(fake_platform, plugin_log, spread, warns):
    fake_platform((12, 0))
    with set_current_vllm_config(vllm_config()):
        layer = NL.build_layer(NL.quant_config("modelopt", "w4a4"), "gate_up", layer_idx=7)
        prob = NL.problem_for(layer, torch.Generator().manual_seed(0))
        NL.load_checkpoint(layer, "modelopt", prob, part_decs=[1e-4, 1e-4 * (1 + spread)])
        layer.quant_method.process_weights_after_loading(layer)
    msgs = [r.getMessage() for r in plugin_log.records if "fused parts differ" in r.getMessage()]
    assert len(msgs) == int(warns)
    if warns:
        assert "model.layers.7.mlp.gate_up_proj" in msgs[0] and "6.0%" in msgs[0]
    torch.testing.assert_close(layer.weight_global_scale, torch.tensor(1e-4 * (1 + spread)))


def test_one_info_line_per_layer_kind(fake_platform, plugin_log, monkeypatch):
    monkeypatch.setattr(glue_log_state, "_logged", set())
    fake_platform((12, 0))
    with set_current_vllm_config(vllm_config()):
        for i in range(3):
            layer = NL.build_layer(NL.quant_config("ct", "w4a4"), "down", layer_idx=i)
            NL.load_checkpoint(layer, "ct", NL.problem_for(layer, torch.Generator().manual_seed(i)))
            layer.quant_method.process_weights_after_loading(layer)
    msgs = [r.getMessage() for r in plugin_log.records if "layers use" in r.getMessage()]
    assert msgs == ["nvfp4_sm120: NVFP4 RowParallelLinear W4A4 layers use Sm120TritonNvFp4LinearKernel (route triton)"]


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64])
def test_cuda_graph_capture_and_replay(registered, tp_group, t):
    """On a GPU with vLLM installed: the layer's apply captured in a CUDA graph replays like eager."""
    with set_current_vllm_config(vllm_config(linear_backend="nvfp4_sm120")), torch.device("cuda"):
        layer = NL.build_layer(NL.quant_config("modelopt", "w4a4"), "qkv")
        NL.load_checkpoint(layer, "modelopt", NL.problem_for(layer, torch.Generator().manual_seed(0)).to("cuda"))
        layer.quant_method.process_weights_after_loading(layer)
    kernel = NL.kernel_of(layer)
    assert isinstance(kernel, ours.Sm120NvFp4LinearKernel)
    x = torch.randn(t, NL.HIDDEN, device="cuda", dtype=torch.bfloat16)
    eager = kernel.apply_weights(layer, x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        kernel.apply_weights(layer, x)  # warm-up (Triton compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel.apply_weights(layer, x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, kernel.apply_weights(layer, x), rtol=0, atol=0)
    assert not torch.equal(out, eager)
