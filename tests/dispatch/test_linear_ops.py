"""``torch.ops.nvfp4_sm120.linear``: the op the vLLM glue calls, through the dispatch table, against the
reference of the plan it picks; fake implementation under torch.compile; CUDA-graph capture on a GPU."""

import pytest
import torch

from vllm_nvfp4_sm120.dispatch import configs, linear_call, registry
from vllm_nvfp4_sm120.dispatch import ops  # noqa: F401  (registers the op)
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


def test_registered_like_vllm_ops():
    """Library define + impl (CPU and CUDA) + fake, not ``torch.library.custom_op`` (whose wrapper costs host time
    per call)."""
    from torch._library.custom_ops import _maybe_get_opdef

    for name in ("linear", "flashinfer_w4a16", "moe"):
        if name == "moe":
            from vllm_nvfp4_sm120.dispatch import moe_ops  # noqa: F401
        qualname = f"nvfp4_sm120::{name}"
        assert _maybe_get_opdef(qualname) is None
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key), (qualname, key)
    assert "!) out) -> ()" in str(torch.ops.nvfp4_sm120.moe.default._schema)  # out is declared mutated


def test_cache_one_entry_per_signature(gen, monkeypatch):
    """Calls with the same metadata share one entry; a new T, a new weight shape or a selector variable make
    another; configs.clear_cache forgets them."""
    linear_call.clear()
    p, q = make_linear(48, 64, gen=gen), make_linear(32, 64, gen=gen)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    first = torch.ops.nvfp4_sm120.linear(x, *_args(p, "cpu"), None, "triton")
    again = torch.ops.nvfp4_sm120.linear(torch.randn(3, 64, generator=gen).to(torch.bfloat16), *_args(p, "cpu"),
                                         None, "triton")
    assert len(linear_call._CACHE) == 1 and first.shape == again.shape == (3, 48)
    torch.ops.nvfp4_sm120.linear(x[:2], *_args(p, "cpu"), None, "triton")
    torch.ops.nvfp4_sm120.linear(x, *_args(q, "cpu"), None, "triton")
    assert len(linear_call._CACHE) == 3
    monkeypatch.setenv(linear_call.SELECTOR_ENV[0], "1")
    torch.ops.nvfp4_sm120.linear(x, *_args(p, "cpu"), None, "triton")
    assert len(linear_call._CACHE) == 4
    configs.clear_cache()
    assert not linear_call._CACHE


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
@pytest.mark.parametrize("t", [2, 8])
def test_gpu_k_tail_through_the_op(t, gen):
    """K not a multiple of 128 at decode sizes: the streaming kernel's K-tail variant on the dispatch's uncapped tile
    (dispatch.linear.k_tail_stream) against the reference."""
    from vllm_nvfp4_sm120.dispatch.hw import capability_of
    from vllm_nvfp4_sm120.dispatch.linear import select_linear

    n, k = 384, 1040
    plan = select_linear(capability_of(torch.device("cuda")), "w4a16", t, n, k)
    assert plan.kernel != "gluon_gemv_stream" or "max_regs" not in plan.kwargs, plan
    p = make_linear(n, k, gen=gen)
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16)
    out = torch.ops.nvfp4_sm120.linear(x.cuda(), *_args(p, "cuda"), None, "w4a16")
    ref = _expected("w4a16", x, p)
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2**-6, atol=2e-3 * ref.float().abs().max().item())


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


# ---- bad inputs: one named error, the same on CPU and on a GPU, before anything is sliced -------------------------

N, K = 48, 64


def _good(gen):
    p = make_linear(N, K, gen=gen)
    x = torch.randn(5, K, generator=gen).to(torch.bfloat16)
    codes, scales, dec, swz, in_enc, alpha = _args(p, "cpu")
    return dict(x=x, w_codes=codes, w_scales=scales, w_dec_rows=dec, w_scales_swizzled=swz, in_enc=in_enc,
                alpha=alpha, bias=torch.zeros(N, dtype=torch.bfloat16), route="triton")


def _with(**changes):
    return lambda a: {**a, **{k: v(a) if callable(v) else v for k, v in changes.items()}}


def _dev(a):
    return a["x"].device


BAD_INPUTS = [
    # K of x against the weight's: a plausible wrong result if the weight were sliced to x's K.
    ("x-K-short", _with(x=lambda a: a["x"][:, :48].contiguous()), ValueError,
     r"w_codes: expected shape \[48, 24\] for N = 48 .* K = 48"),
    ("x-K-long", _with(x=lambda a: torch.zeros(5, 80, dtype=torch.bfloat16, device=_dev(a))), ValueError,
     r"w_codes: expected shape"),
    ("x-K-not-16", _with(x=lambda a: torch.zeros(5, 40, dtype=torch.bfloat16, device=_dev(a))), ValueError,
     r"x: K = 40 .* multiple of 16"),
    # N: len(w_dec_rows) against the codes' rows (the op used to slice the codes to it).
    ("dec-rows-short", _with(w_dec_rows=lambda a: a["w_dec_rows"][:40].contiguous()), ValueError,
     r"w_codes: expected shape \[40, 32\] .* got \[48, 32\]"),
    ("dec-rows-long", _with(w_dec_rows=lambda a: torch.ones(64, device=_dev(a))), ValueError,
     r"w_codes: expected shape \[64, 32\]"),
    ("scales-K", _with(w_scales=lambda a: a["w_scales"][:, :2].contiguous()), ValueError,
     r"w_scales: expected shape \[48, 4\] .* got \[48, 2\]"),
    ("scales-N", _with(w_scales=lambda a: a["w_scales"][:40].contiguous()), ValueError,
     r"w_scales: expected shape \[48, 4\]"),
    ("x-1d", _with(x=lambda a: a["x"][0].contiguous()), ValueError, r"x: expected 2-D tensor, got shape \(64,\)"),
    ("x-3d", _with(x=lambda a: a["x"].reshape(5, 1, K)), ValueError, r"x: expected 2-D tensor, got shape \(5, 1, 64\)"),
    ("x-fp32", _with(x=lambda a: a["x"].float()), TypeError, r"x: expected dtype bfloat16 or float16, got float32"),
    ("x-strided-K", _with(x=lambda a: torch.zeros(5, 2 * K, dtype=torch.bfloat16, device=_dev(a))[:, ::2]), ValueError,
     r"x: the last dimension must be contiguous"),
    ("dec-rows-0d", _with(w_dec_rows=lambda a: torch.tensor(1.0, device=_dev(a))), ValueError,
     r"w_dec_rows: expected 1-D tensor, got shape \(\)"),
    ("dec-rows-fp16", _with(w_dec_rows=lambda a: a["w_dec_rows"].half()), TypeError,
     r"w_dec_rows: expected dtype float32, got float16"),
    ("codes-dtype", _with(w_codes=lambda a: a["w_codes"].to(torch.int8)), TypeError,
     r"w_codes: expected dtype uint8, got int8"),
    ("scales-dtype", _with(w_scales=lambda a: a["w_scales"].float()), TypeError, r"w_scales: expected dtype"),
    ("bias-length", _with(bias=lambda a: torch.zeros(N + 1, dtype=torch.bfloat16, device=_dev(a))), ValueError,
     r"bias: expected shape \[48\], got \[49\]"),
    ("bias-dtype", _with(bias=lambda a: torch.zeros(N, device=_dev(a))), TypeError,
     r"bias: expected dtype bfloat16, got float32"),
    ("alpha-length", _with(alpha=lambda a: torch.ones(2, device=_dev(a))), ValueError,
     r"alpha: expected one fp32 value \(0-d or \[1\]\), got shape \[2\]"),
    ("in-enc-length", _with(in_enc=lambda a: torch.ones(N, device=_dev(a))), ValueError,
     r"in_enc: expected one fp32 value"),
    ("in-enc-dtype", _with(in_enc=lambda a: torch.ones(1, dtype=torch.float16, device=_dev(a))), TypeError,
     r"in_enc: expected dtype"),
    ("route", _with(route="fastest"), ValueError, r"route: expected one of"),
    ("route-fi", _with(route="flashinfer_w4a16"), ValueError, r"call torch.ops.nvfp4_sm120.flashinfer_w4a16"),
    ("cublas-no-swizzled", _with(route="cublas"), TypeError,
     r"w_scales_swizzled \(route 'cublas'.*\): expected a torch.Tensor, got NoneType"),
    ("swizzled-shape", _with(w_scales_swizzled=lambda a: torch.zeros(48, 4, dtype=torch.uint8, device=_dev(a))),
     ValueError, r"w_scales_swizzled .*expected shape \[128, 4\], got \[48, 4\]"),
]


def _call(a):
    return torch.ops.nvfp4_sm120.linear(a["x"], a["w_codes"], a["w_scales"], a["w_dec_rows"], a["w_scales_swizzled"],
                                        a["in_enc"], a["alpha"], a["bias"], a["route"])


def _to(a, device):
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in a.items()}


@pytest.mark.parametrize("case", [pytest.param(c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_input_named_error_cpu(case, gen):
    change, exc, match = case
    good = _good(gen)
    _call(good)  # the good call caches its signature; a bad one differs in metadata and is checked in full
    with pytest.raises(exc, match=match):
        _call(change(good))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [pytest.param(c[1:], id=c[0]) for c in BAD_INPUTS])
def test_bad_input_named_error_gpu(case, gen):
    change, exc, match = case
    good = _to(_good(gen), "cuda")
    _call(good)
    with pytest.raises(exc, match=match):
        _call(change(good))


@pytest.mark.gpu
def test_weight_on_another_device(gen):
    a = _good(gen)
    a = {**_to(a, "cuda"), "w_scales": a["w_scales"]}
    with pytest.raises(ValueError, match=r"w_scales: expected a tensor on cuda"):
        _call(a)


def test_b12x_padded_codes_accepted_only_on_b12x(gen):
    """Route b12x pads the codes to multiples of 32 in place; the other routes take the checkpoint's shape only."""
    p = make_linear(40, 48, gen=gen)
    codes, scales, dec, _, in_enc, alpha = _args(p, "cpu")
    padded = torch.nn.functional.pad(codes, (0, 8, 0, 24))  # [64, 32]: N, K rounded up to 32
    x = torch.randn(3, 48, generator=gen).to(torch.bfloat16)
    from vllm_nvfp4_sm120.format.swizzle import swizzle_128x4

    swz = swizzle_128x4(scales)
    out = torch.ops.nvfp4_sm120.linear(x, padded, scales, dec, swz, in_enc, alpha, None, "b12x")
    torch.testing.assert_close(out, torch.ops.nvfp4_sm120.linear(x, codes, scales, dec, swz, in_enc, alpha, None,
                                                                 "b12x"), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"w_codes: expected shape \[40, 24\]"):
        torch.ops.nvfp4_sm120.linear(x, padded, scales, dec, None, in_enc, alpha, None, "triton")


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


# ---- ready launchers (what the op caches) against the validating launchers, in the interpreter on CPU -------------

READY_PLANS = [
    ("w4a16_gemv", dict(block_n=32, block_k=64, split_k=1, num_warps=4, num_stages=1)),
    ("w4a16_gemv", dict(block_n=32, block_k=64, split_k=2, num_warps=4, num_stages=1)),  # split-K + finish kernel
    ("w4a16_gemm", dict(block_m=16, block_n=32, block_k=64, group_m=8, num_warps=4, num_stages=1, swap_ab=False)),
    ("w4a4_triton", dict(block_m=16, block_n=32, block_k=64, group_m=8, num_warps=4, num_stages=1)),
    ("w4a16_dequant_mm", dict(chunk_n=32)),  # chunks of 32 and 16 rows
    ("w4a16_dequant_mm", dict(chunk_n=64)),  # one chunk
]


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter check (the GPU tests run the op itself)")
@pytest.mark.parametrize("padded", [False, True], ids=["codes", "padded-codes"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("kernel, tile", READY_PLANS, ids=[f"{k}-{i}" for i, (k, _) in enumerate(READY_PLANS)])
def test_ready_launcher_matches_validating_launcher(kernel, tile, bias, padded, gen):
    from vllm_nvfp4_sm120.dispatch.linear import LinearPlan

    p = make_linear(48, 128, gen=gen)
    t, n, k = 3, 48, 128
    x = torch.randn(t, k, generator=gen).half()
    codes, scales, dec, _, in_enc, alpha = _args(p, "cpu")
    b = torch.randn(n, generator=gen).half() if bias else None
    if padded:  # a route's padded copy (b12x pads N and K to 32): the kernels must read the first N rows, K columns
        codes = torch.nn.functional.pad(codes, (0, 16, 0, 16))
    plan = LinearPlan(LinearKernel(kernel), tuple(sorted(tile.items())))
    ready = registry.prepare_linear(plan, registry.Ready(t, n, k, x.device, x.dtype, bias, codes_padded=padded))
    got = ready(x, codes, scales, dec, None, in_enc, alpha, b)
    want = registry.LINEAR_KERNELS[plan.kernel](x, codes, scales, dec, None, in_enc, alpha, b, **tile)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if kernel != "w4a4_triton":  # NVFP4 dot_scaled is wrong in the interpreter; the W4A16 kernels are exact there
        ref = linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows, bias=b)
        torch.testing.assert_close(got.float(), ref.float(), rtol=2**-8, atol=2e-3 * ref.float().abs().max().item())
