"""MoE kernels on a CUDA GPU (the H200 runs sm_90: W4A4 ``dot_scaled`` is Triton's exact emulation there) on the
shapes of real checkpoints, against format.moe_ref.  Weights are random codes and random valid e4m3 scales made
on the GPU (the CPU quantizer loop would take minutes at these sizes).

W4A4: the input quantization (``quantize_act_nvfp4``) is bit-exact with ``quantize_nvfp4`` (checked against the
CPU reference).  The intermediate is quantized by the same exact quantizer, but from fp32 values that differ from
the reference's in the last ulps (summation order, ``exp``), so a code may round the other way where the value
sits on a rounding midpoint.  The W4A4 check is therefore in steps: the input quantization bit-exact, the
intermediate equal to ``quantize_nvfp4(reference intermediate)`` except at such midpoints (each mismatch is
explained, and rare), and the output equal to the down GEMM of the kernel's own intermediate.
Runs on torch 2.11 (the H200 image) as well as 2.14.
"""

from dataclasses import replace

import pytest
import torch

from vllm_nvfp4_sm120.dispatch.moe_flow import nvfp4_moe, plan_for
from vllm_nvfp4_sm120.format import GlobalScale, NvFp4, moe_ref, quantize_nvfp4, unit_values
from vllm_nvfp4_sm120.format.reference import gated_activation
from vllm_nvfp4_sm120.kernels.moe_align import moe_align, moe_sum
from vllm_nvfp4_sm120.kernels.moe_w4a4 import moe_quant_input, moe_w4a4_down, moe_w4a4_gate_up

pytestmark = pytest.mark.gpu

SHAPES = {  # name: (H, I, E, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "qwen3-next-80b": (2048, 512, 512, 10),
    "odd": (336, 80, 6, 3),  # H, I not multiples of 256 (no TMA), I not a multiple of the tile
}
TOKENS = [0, 1, 3, 16, 64, 512, 4096]
_BANKS = {}


def bank(e, rows, k, seed):
    key = (e, rows, k, seed)
    if key not in _BANKS:
        g = torch.Generator(device="cuda").manual_seed(seed)
        codes = torch.randint(0, 256, (e, rows, k // 2), generator=g, device="cuda", dtype=torch.uint8)
        scales = (0.25 + 1.75 * torch.rand(e, rows, k // 16, generator=g, device="cuda")).to(torch.float8_e4m3fn)
        dec = 0.004 + 0.004 * torch.rand(e, generator=g, device="cuda")
        _BANKS.clear() if len(_BANKS) > 4 else None
        _BANKS[key] = (NvFp4(codes, scales), dec)
    return _BANKS[key]


def layer(name):
    h, i, e, k = SHAPES[name]
    w13, d13 = bank(e, 2 * i, h, 1)
    w2, d2 = bank(e, h, i, 2)
    return h, i, e, k, w13, d13, w2, d2


def routing(t, e, k, skewed, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(t, e, generator=g, device="cuda")
    if skewed:  # every token on experts 0..k-1
        logits[:, :k] += 100.0
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32)


def assert_moe_close(out, ref):
    # Differences are fp32 summation order and last-bit rounding of the 16-bit intermediate that follows from
    # it: absolute in the sums, so the floor scales with the output; plus one bf16 ulp of the output itself.
    atol = 2.0**-8 * float(ref.float().abs().max()) if ref.numel() else 0.0
    torch.testing.assert_close(out, ref, atol=atol, rtol=2.0**-7)


_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def assert_fp4_matches(codes, scales, ref_values, gs: GlobalScale):
    """Kernel NVFP4 ``(codes, scales)`` vs ``quantize_nvfp4(ref_values)``, up to explained midpoint flips."""
    q = quantize_nvfp4(ref_values, gs)
    sf_kernel, sf_ref = scales.view(torch.uint8), q.scales.view(torch.uint8)
    bad_sf = sf_kernel != sf_ref
    assert int(bad_sf.sum()) <= max(2, bad_sf.numel() // 10000), f"{int(bad_sf.sum())} block scales differ"
    if bad_sf.any():  # (no ``Tensor.max(initial=...)`` on torch 2.11)
        steps = (sf_kernel.int() - sf_ref.int())[bad_sf].abs()
        assert int(steps.max()) <= 1, f"a block scale is {int(steps.max())} e4m3 steps off"
    # Codes in blocks with equal scales: a mismatch must sit within fp32 jitter of an e2m1 rounding midpoint.
    enc = gs.enc.to(ref_values.device)
    scaled = ref_values.float().unflatten(-1, (-1, 16)) / (q.scales.float() / enc).unsqueeze(-1)
    lo, hi = codes & 15, codes >> 4
    kernel_codes = torch.stack((lo, hi), -1).flatten(-2).unflatten(-1, (-1, 16))
    ref_codes = torch.stack((q.codes & 15, q.codes >> 4), -1).flatten(-2).unflatten(-1, (-1, 16))
    diff = (kernel_codes != ref_codes) & ~bad_sf.unsqueeze(-1)
    if diff.any():
        dist = (scaled[diff].abs().unsqueeze(-1) - _MIDPOINTS.to(scaled.device)).abs().min(-1).values
        assert float(dist.max()) < 1e-3, f"code mismatch {float(dist.max())} away from any rounding midpoint"
        assert int(diff.sum()) <= max(4, diff.numel() // 10000), f"{int(diff.sum())} codes differ"


def w4a4_scales(x):
    a13 = GlobalScale.of(x) if x.numel() else GlobalScale.from_encode(1.0)
    return a13.to("cuda"), GlobalScale.from_amax(24.0).to("cuda")


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
    ac, asf = moe_quant_input(x, a13.enc)
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
    x_in = unit_values(ac, asf)  # = the reference's quantized input (checked above)
    ref_out = torch.zeros(t, h, device="cuda")
    routes = ti.reshape(-1).long()
    for ex in range(e):
        r = (routes == ex).nonzero().flatten()
        if r.numel() == 0:
            continue
        hh = (x_in[r // k] @ unit_values(w13.codes[ex], w13.scales[ex]).t()) * (d13[ex] * a13.dec)
        assert_fp4_matches(ic[r], isf[r], gated_activation(hh, activation), a2)
        y = (unit_values(ic[r], isf[r].view(torch.float8_e4m3fn)) @ unit_values(w2.codes[ex], w2.scales[ex]).t())
        ref_out.index_add_(0, r // k, y * (d2[ex] * a2.dec) * tw.reshape(-1)[r, None])
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
