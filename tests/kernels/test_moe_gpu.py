"""MoE kernels on a CUDA GPU (the H200 runs sm_90: W4A4 ``dot_scaled`` is Triton's exact emulation there) on the
shapes of real checkpoints, against format.moe_ref; the W4A4 layer in the steps of ``moe_gpu_common``.
"""

from dataclasses import replace

import pytest
import torch
from moe_gpu_common import SHAPES, assert_moe_close, layer, routing, w4a4_reference, w4a4_scales

from vllm_nvfp4_sm120.dispatch.linear import act_quant_config
from vllm_nvfp4_sm120.dispatch.moe_flow import nvfp4_moe, plan_for
from vllm_nvfp4_sm120.format import moe_ref, quantize_nvfp4
from vllm_nvfp4_sm120.kernels.moe_align import moe_align, moe_sum
from vllm_nvfp4_sm120.kernels.moe_w4a4 import moe_quant_input, moe_w4a4_down, moe_w4a4_gate_up

pytestmark = pytest.mark.gpu

TOKENS = [0, 1, 3, 16, 64, 512, 4096]


@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_w4a16_layer(name, t, skewed):
    h, i, e, k, w13, d13, w2, d2 = layer(name)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = routing(t, e, k, skewed)
    out = nvfp4_moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti)
    assert_moe_close(out, moe_ref(x, w13, d13, w2, d2, tw, ti))


@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_w4a4_layer(name, t, skewed, decode=False, activation="silu", dtype=torch.bfloat16, integer_e4m3=False):
    h, i, e, k, w13, d13, w2, d2 = layer(name)
    x = torch.randn(t, h, device="cuda", dtype=dtype)
    tw, ti = routing(t, e, k, skewed)
    a13, a2 = w4a4_scales(x)
    plan = plan_for(x, w13.codes, w2.codes, ti, w4a4=True)
    out = nvfp4_moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, a13_enc=a13.enc.reshape(1),
                    a2_enc=a2.enc.reshape(1), activation=activation, plan=replace(plan, decode=decode or plan.decode))
    if plan.kernel == "w4a16" or t == 0:  # below W4A4_MIN_TOKENS_PER_EXPERT: the W4A16 kernels
        assert_moe_close(out, moe_ref(x, w13, d13, w2, d2, tw, ti, activation=activation))
        return
    plan = replace(plan, decode=decode or plan.decode)
    align = moe_align(ti, e, plan.block_m)
    ac, asf = moe_quant_input(x, a13.enc, **act_quant_config(t, h))
    xq = quantize_nvfp4(x.cpu(), a13)  # on the CPU: IEEE divisions by construction
    torch.testing.assert_close(ac.cpu(), xq.codes, rtol=0, atol=0)
    torch.testing.assert_close(asf.cpu().view(torch.uint8), xq.scales.view(torch.uint8), rtol=0, atol=0)
    ic, isf = moe_w4a4_gate_up(ac, asf, w13.codes, w13.scales, d13, a13.enc, a2.enc, align,
                               activation=activation, **plan.gate_up_kwargs())
    if integer_e4m3:  # the epilogue's integer e4m3 rounding (the interpreter's) agrees with the hardware convert
        ic2, isf2 = moe_w4a4_gate_up(ac, asf, w13.codes, w13.scales, d13, a13.enc, a2.enc, align,
                                     activation=activation, native_e4m3=False, **plan.gate_up_kwargs())
        assert torch.equal(ic2, ic) and torch.equal(isf2, isf)
    # Reference intermediate (fp32, before quantization) and the down GEMM of the kernel's own intermediate.
    ref_out, _ = w4a4_reference(ac, asf, w13, d13, w2, d2, tw, ti, ic, isf, a13, a2, activation)
    assert_moe_close(out, ref_out.to(dtype))
    acc = torch.zeros(t * k, h, device="cuda")
    moe_w4a4_down(ic, isf, w2.codes, w2.scales, d2, a2.enc, tw, align, acc, deterministic=True,
                  **plan.down_kwargs())
    det = moe_sum(acc, k, torch.empty_like(x))
    assert_moe_close(det, ref_out.to(dtype))


@pytest.mark.parametrize("name,t", [("qwen3-30b-a3b", 512), ("odd", 64)])
def test_w4a4_self_decode_gelu_fp16(name, t):
    # The same source with the MMA swapped for the exact self-decode (what sm_120's OMMA is checked against).
    test_w4a4_layer(name, t, False, decode=True, activation="gelu_tanh", dtype=torch.float16, integer_e4m3=True)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "odd"])
def test_deterministic_and_expert_map(name):
    h, i, e, k, w13, d13, w2, d2 = layer(name)
    t = 512
    x = torch.randn(t + 7, h + 64, device="cuda", dtype=torch.float16)[:t, :h]  # row-strided input
    tw, ti = routing(t, 2 * e, k, False)
    expert_map = torch.full((2 * e,), -1, dtype=torch.int32, device="cuda")
    expert_map[1::2] = torch.arange(e, dtype=torch.int32, device="cuda")  # this rank holds the odd experts
    args = (x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti)
    a = nvfp4_moe(*args, expert_map=expert_map, deterministic=True, activation="gelu_tanh")
    b = nvfp4_moe(*args, expert_map=expert_map, deterministic=True, activation="gelu_tanh")
    assert torch.equal(a, b)
    assert_moe_close(a, moe_ref(x, w13, d13, w2, d2, tw, ti, expert_map=expert_map, activation="gelu_tanh"))


def test_cuda_graph_capture():
    h, i, e, k, w13, d13, w2, d2 = layer("qwen3-30b-a3b")
    x = torch.randn(64, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = routing(64, e, k, False)
    a13, a2 = w4a4_scales(x)
    kw = dict(a13_enc=a13.enc.reshape(1), a2_enc=a2.enc.reshape(1))
    args = (x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti)
    eager = nvfp4_moe(*args, deterministic=True, **kw)
    out = torch.empty_like(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nvfp4_moe(*args, deterministic=True, out=out, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
