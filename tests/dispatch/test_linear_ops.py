"""``torch.ops.nvfp4_sm120.linear``: the op the vLLM glue calls, through the dispatch table, against the
reference of the plan it picks; fake implementation under torch.compile; CUDA-graph capture on a GPU."""

import pytest
import torch

from vllm_nvfp4_sm120.dispatch import ops  # noqa: F401  (registers the op)
from vllm_nvfp4_sm120.dispatch import registry
from vllm_nvfp4_sm120.dispatch.hw import SM120_REFERENCE
from vllm_nvfp4_sm120.dispatch.linear import LinearKernel, select_linear
from vllm_nvfp4_sm120.format import linear_w4a4_ref, linear_w4a16_ref, make_linear


def _args(p, device):
    alpha = (p.input_gs.dec * p.weight_gs.dec).to(device)
    return (p.codes.to(device), p.scales.to(device), p.dec_rows.to(device), None, p.input_gs.enc.to(device), alpha)


def _expected(route, x, p):
    plan = select_linear(SM120_REFERENCE, route, x.shape[0], p.codes.shape[0], x.shape[1])
    if plan.is_w4a4:
        return linear_w4a4_ref(x, p.codes, p.scales, p.weight_gs, p.input_gs)
    return linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows)


@pytest.mark.parametrize("route", ["triton", "w4a16"])
@pytest.mark.parametrize("t", [0, 1, 16, 17, 40])
def test_cpu_follows_the_plan(route, t, gen):
    p = make_linear(48, 64, gen=gen, logical_widths=[16, 32])
    x = torch.randn(t, 64, generator=gen).to(torch.bfloat16)
    out = torch.ops.nvfp4_sm120.linear(x, *_args(p, "cpu"), None, route)
    torch.testing.assert_close(out, _expected(route, x, p), rtol=0, atol=0)


def test_w4a4_plan_needs_scales(gen):
    p = make_linear(16, 64, gen=gen)
    x = torch.randn(40, 64, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="in_enc and alpha are required"):
        torch.ops.nvfp4_sm120.linear(x, p.codes, p.scales, p.dec_rows, None, None, None, None, "triton")


def test_compiles_fullgraph_with_fake_impl(gen):
    p = make_linear(48, 64, gen=gen)
    a = _args(p, "cpu")
    f = torch.compile(lambda x: torch.ops.nvfp4_sm120.linear(x, *a, None, "triton"), fullgraph=True)
    x = torch.randn(20, 64, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(f(x), torch.ops.nvfp4_sm120.linear(x, *a, None, "triton"), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["triton", "w4a16"])
@pytest.mark.parametrize("t", [0, 1, 8, 16, 17, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernels_match_reference(route, t, dtype, gen):
    p = make_linear(384, 1024, gen=gen, logical_widths=[128, 128, 128])
    x = torch.randn(t, 1024, generator=gen).to(dtype)
    bias = torch.randn(384, generator=gen).to(dtype)
    out = torch.ops.nvfp4_sm120.linear(x.cuda(), *_args(p, "cuda"), bias.cuda(), route)
    ref = _expected(route, x, p) + bias  # the reference adds bias in fp32 before rounding; allow that rounding
    scale = ref.float().abs().max().item() if t else 1.0
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2**-6, atol=2e-3 * scale)


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["triton", "w4a16"])
def test_cuda_graph_replay_matches_eager(route, gen):
    p = make_linear(256, 512, gen=gen)
    a = _args(p, "cuda")
    for t in (1, 48):
        x = torch.randn(t, 512, generator=gen).to(torch.bfloat16).cuda()
        eager = torch.ops.nvfp4_sm120.linear(x, *a, None, route)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = torch.ops.nvfp4_sm120.linear(x, *a, None, route)
        x.copy_(torch.randn(t, 512, generator=gen).to(torch.bfloat16))
        eager = torch.ops.nvfp4_sm120.linear(x, *a, None, route)
        g.replay()
        torch.testing.assert_close(out, eager, rtol=0, atol=0)


# ---- route flashinfer_w4a16: its own op (FlashInfer's prepared weight); numerics only on sm_100/sm_12x -------------


def test_flashinfer_w4a16_op_has_no_cpu_path():
    """The op refuses CPU tensors instead of computing something else (no reference reads a repacked weight)."""
    from vllm_nvfp4_sm120.kernels.fp4_routes import Fp4RouteUnavailable

    x = torch.randn(2, 32).to(torch.bfloat16)
    b, sf, alpha = torch.zeros(64, 16, dtype=torch.uint8), torch.zeros(128, 4, dtype=torch.uint8), torch.ones(1)
    with pytest.raises(Fp4RouteUnavailable, match="needs CUDA tensors"):
        torch.ops.nvfp4_sm120.flashinfer_w4a16(x, b, sf, alpha, None, 64, "cute-dsl")


def test_flashinfer_w4a16_fake_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.empty(5, 32, dtype=torch.bfloat16))
        b = mode.from_tensor(torch.empty(2, 128, dtype=torch.int32))  # cute-dsl: (K/16, 2N)
        sf = mode.from_tensor(torch.empty(2, 64, dtype=torch.uint8))
        out = torch.ops.nvfp4_sm120.flashinfer_w4a16(x, b, sf, mode.from_tensor(torch.ones(1)), None, 64, "cute-dsl")
    assert out.shape == (5, 64) and out.dtype == torch.bfloat16


def test_fi_w4a16_plan_runs_the_same_op(monkeypatch):
    """The table's ``fi_w4a16`` plan, through the linear op's slots, reaches that op with the default backend."""
    seen = {}
    monkeypatch.setattr(registry, "run_flashinfer_w4a16", lambda *args: seen.setdefault("args", args))
    x, b, sf, alpha = (torch.empty(0) for _ in range(4))
    registry.LINEAR_KERNELS[LinearKernel.FI_W4A16](x, b, sf, torch.empty(48), None, None, alpha, None)
    assert seen["args"] == (x, b, sf, alpha, None, 48, "cute-dsl")
