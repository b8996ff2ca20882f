"""W4A16 linears on the checkpoint's NVFP4 weight (``kernels/w4a16_linear.py``) against ``format.linear_w4a16_ref``.

CPU: the interpreter runs both kernels on tiny odd shapes (fp16 only, pure-``tl`` decode); every listed config is
compiled for sm_120.  GPU (``-m gpu``, the H200): real checkpoint shapes, bf16 and fp16, fast decode on and off.

Tolerance: kernel and reference both sum exact products (e2m1 x e4m3 x 16-bit activation) in fp32, in different
orders, then round to the 16-bit output.  So ``|out - ref| <= 2 * K * 2^-24 * sum|x||w| * |dec|`` (the fp32
summation bound for two orders) ``+ 1 ulp of the output dtype at |ref|`` — see ``_assert_w4a16_close``.
"""

import functools

import pytest
import torch

from vllm_nvfp4_sm120.format import linear_w4a16_ref, make_linear, unit_values
from vllm_nvfp4_sm120.kernels.aot import compile_kernel
from vllm_nvfp4_sm120.kernels.w4a16_linear import (
    FINISH_BLOCK_N,
    W4A16_FINISH_DIVISIBLE,
    W4A16_FINISH_SIGNATURE,
    W4A16_GEMM_DIVISIBLE,
    W4A16_GEMM_SIGNATURE,
    W4A16_GEMV_DIVISIBLE,
    W4A16_GEMV_SIGNATURE,
    w4a16_gemm,
    w4a16_gemv,
)

# The tiles and their rules live in the dispatch.
from vllm_nvfp4_sm120.dispatch.hw import Capability, Family  # noqa: E402
from vllm_nvfp4_sm120.dispatch.linear import (  # noqa: E402
    W4A16_GEMM_CONFIGS_SM90,
    W4A16_GEMV_CONFIGS,
    W4A16_GEMV_MAX_T,
    gemv_split_k,
    w4a16_configs,
    w4a16_plan,
)


def suggest_w4a16_config(t, n, k, sm_count, cc_major):
    plan = w4a16_plan(Capability(cc_major * 10, sm_count), t, n, k, small=True)
    return plan.kernel.removeprefix("w4a16_"), plan.kwargs


ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
MODULE = "vllm_nvfp4_sm120.kernels.w4a16_linear"
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # relative spacing at the top of a binade


def _part_decs(p) -> torch.Tensor:
    return torch.stack([g.dec for g in p.part_globals])


def _assert_w4a16_close(out, ref, x, codes, scales, dec_rows):
    """``out`` within the summation-order bound of ``ref`` (see the module docstring); reports the worst element."""
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if out.numel() == 0:
        return
    k = x.shape[1]
    mag = (x.float().abs() @ unit_values(codes, scales).abs().t()) * dec_rows.abs()[None, :]
    allowed = 2 * k * 2.0**-24 * mag + ULP[out.dtype] * ref.float().abs()
    err = (out.float() - ref.float()).abs()
    bad = err > allowed
    if bool(bad.any()):
        i = int(torch.argmax((err - allowed).flatten()))
        t, n = divmod(i, out.shape[1])
        raise AssertionError(
            f"{int(bad.sum())} of {out.numel()} elements out of bound; worst [{t}, {n}]: out {float(out[t, n])}, "
            f"ref {float(ref[t, n])}, err {float(err[t, n]):.3g} > allowed {float(allowed[t, n]):.3g}"
        )


def _x(t, k, dtype, gen, *, row_pad=0):
    """Activations ``[t, k]``; with ``row_pad`` a row-strided view into a wider buffer."""
    buf = torch.randn(t, k + row_pad, generator=gen).to(dtype)
    return buf[:, :k].to(DEVICE)


# ---------------------------------------------------------------------------------------------------------------
# Small odd shapes: the interpreter on CPU (fp16, pure-tl decode); compiled on a GPU.
# ---------------------------------------------------------------------------------------------------------------

SMALL_SHAPES = [(24, 64), (40, 160), (40, 96)]
# Tiles small enough for tiny shapes, so row, K and token tails are all exercised.
SMALL_GEMV = dict(block_n=16, block_k=64, num_warps=4, num_stages=2)
SMALL_GEMM = dict(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2)
SMALL_TILE = {w4a16_gemv: dict(SMALL_GEMV, split_k=1), w4a16_gemm: SMALL_GEMM}
# A split-K decode tile of the dispatch's (64-row tiles: the medium-N one).
GEMV_TILE = W4A16_GEMV_CONFIGS[1]


def _small_problem(n, k, gen, widths=None):
    p = make_linear(n, k, gen=gen, logical_widths=widths)
    return p.codes.to(DEVICE), p.scales.to(DEVICE), p.dec_rows.to(DEVICE), p


@pytest.mark.parametrize("n,k", SMALL_SHAPES)
@pytest.mark.parametrize("t", [0, 1, 3, 8, 16, 17])
@pytest.mark.parametrize("split_k", [1, 2])
def test_gemv_small(t, n, k, split_k, gen):
    codes, scales, dec_rows, p = _small_problem(n, k, gen)
    x = _x(t, k, torch.float16, gen)
    out = w4a16_gemv(x, codes, scales, dec_rows, split_k=split_k, **SMALL_GEMV)
    ref = linear_w4a16_ref(x.cpu(), p.codes, p.scales, _part_decs(p), logical_widths=p.logical_widths)
    _assert_w4a16_close(out.cpu(), ref, x.cpu(), p.codes, p.scales, p.dec_rows)


@pytest.mark.parametrize("n,k", SMALL_SHAPES)
@pytest.mark.parametrize("t", [0, 1, 2, 17, 48])
def test_gemm_small(t, n, k, gen):
    codes, scales, dec_rows, p = _small_problem(n, k, gen)
    x = _x(t, k, torch.float16, gen)
    out = w4a16_gemm(x, codes, scales, dec_rows, **SMALL_GEMM)
    ref = linear_w4a16_ref(x.cpu(), p.codes, p.scales, _part_decs(p), logical_widths=p.logical_widths)
    _assert_w4a16_close(out.cpu(), ref, x.cpu(), p.codes, p.scales, p.dec_rows)


@pytest.mark.parametrize("kernel", ["gemv", "gemm"])
@pytest.mark.parametrize("swap_ab", [False, True])
def test_fused_parts_bias_strided_x(kernel, swap_ab, gen):
    """qkv-style fused weight with a different global per part, a bias, and a row-strided x."""
    if kernel == "gemv" and swap_ab:
        pytest.skip("swap_ab is a GEMM option")
    n, k, t = 40, 160, 3 if kernel == "gemv" else 20
    codes, scales, dec_rows, p = _small_problem(n, k, gen, widths=[8, 16, 16])
    assert len(set(_part_decs(p).tolist())) == 3
    x = _x(t, k, torch.float16, gen, row_pad=32)
    assert x.stride(0) == k + 32
    bias = torch.randn(n, generator=gen).to(torch.float16).to(DEVICE)
    if kernel == "gemv":
        out = w4a16_gemv(x, codes, scales, dec_rows, bias, split_k=2, **SMALL_GEMV)
    else:
        out = w4a16_gemm(x, codes, scales, dec_rows, bias, swap_ab=swap_ab, **SMALL_GEMM)
    ref = linear_w4a16_ref(x.cpu(), p.codes, p.scales, _part_decs(p), logical_widths=p.logical_widths, bias=bias.cpu())
    _assert_w4a16_close(out.cpu(), ref, x.cpu(), p.codes, p.scales, p.dec_rows)


def test_out_argument_is_written(gen):
    codes, scales, dec_rows, p = _small_problem(24, 64, gen)
    x = _x(2, 64, torch.float16, gen)
    out = torch.full((2, 24), float("nan"), dtype=torch.float16, device=DEVICE)
    got = w4a16_gemv(x, codes, scales, dec_rows, out=out, split_k=1, **SMALL_GEMV)
    assert got is out and bool(torch.isfinite(out).all())


def test_t_zero_launches_nothing(gen):
    codes, scales, dec_rows, _ = _small_problem(24, 64, gen)
    x = torch.empty(0, 64, dtype=torch.float16, device=DEVICE)
    assert w4a16_gemv(x, codes, scales, dec_rows, **SMALL_TILE[w4a16_gemv]).shape == (0, 24)
    assert w4a16_gemm(x, codes, scales, dec_rows, **SMALL_TILE[w4a16_gemm]).shape == (0, 24)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: clear errors naming the tensor
# ---------------------------------------------------------------------------------------------------------------


def _good(gen):
    codes, scales, dec_rows, _ = _small_problem(24, 64, gen)
    return dict(x=_x(2, 64, torch.float16, gen), w_codes=codes, w_scales=scales, w_dec_rows=dec_rows)


@pytest.mark.parametrize("fn", [w4a16_gemv, w4a16_gemm])
@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: a.update(x=a["x"].float()), TypeError, r"^x: expected dtype bfloat16 or float16"),
        (lambda a: a.update(x=a["x"].t().contiguous().t()), ValueError, r"^x: the last dimension must be contiguous"),
        (lambda a: a.update(x=a["x"][:, :48], w_codes=a["w_codes"][:, :24], w_scales=a["w_scales"][:, :3]),
         ValueError, None),  # K = 48 is fine; checked separately below
        (lambda a: a.update(x=a["x"][:, :56]), ValueError, r"K = 56 must be a multiple of 16"),
        (lambda a: a.update(w_codes=a["w_codes"].view(torch.int8)), TypeError, r"^w_codes: expected dtype uint8"),
        (lambda a: a.update(w_codes=a["w_codes"][:, :16]), ValueError, r"^w_codes: expected shape \[24, 32\]"),
        (lambda a: a.update(w_scales=a["w_scales"][:, :2]), ValueError, r"^w_scales: expected shape \[24, 4\]"),
        (lambda a: a.update(w_scales=a["w_scales"].float()), TypeError, r"^w_scales: expected dtype"),
        (lambda a: a.update(w_dec_rows=a["w_dec_rows"][:3]), ValueError, r"^w_dec_rows: expected shape \[24\]"),
        (lambda a: a.update(w_dec_rows=a["w_dec_rows"].half()), TypeError, r"^w_dec_rows: expected dtype float32"),
        (lambda a: a.update(bias=torch.zeros(23, device=DEVICE)), ValueError, r"^bias: expected shape \[24\]"),
        (lambda a: a.update(out=torch.empty(2, 24, dtype=torch.bfloat16, device=DEVICE)), TypeError, r"^out: expected dtype float16"),
    ],
    ids=["x-dtype", "x-layout", "k48-ok", "k-not-16", "codes-dtype", "codes-shape", "scales-shape", "scales-dtype",
         "dec-shape", "dec-dtype", "bias-shape", "out-dtype"],
)
def test_bad_input_names_the_tensor(fn, change, error, match, gen):
    args = _good(gen)
    change(args)
    if match is None:
        assert fn(**args, **SMALL_TILE[fn]).shape == (2, 24)
        return
    with pytest.raises(error, match=match):
        fn(**args, **SMALL_TILE[fn])


# ---------------------------------------------------------------------------------------------------------------
# Configurations and the suggestion function
# ---------------------------------------------------------------------------------------------------------------

REAL_SHAPES = {  # name: (N, K)
    "qwen3-32b-qkv": (10240, 5120),
    "qwen3-32b-o": (5120, 8192),
    "qwen3-32b-gate_up": (51200, 5120),
    "qwen3-32b-down": (5120, 25600),
    "llama-3.3-70b-gate_up": (57344, 8192),
    "llama-3.3-70b-down": (8192, 28672),
}


@pytest.mark.parametrize("sm_count,cc_major", [(132, 9), (170, 12), (188, 12), (84, 12)])
@pytest.mark.parametrize("n,k", REAL_SHAPES.values(), ids=REAL_SHAPES.keys())
@pytest.mark.parametrize("t", [1, 2, 3, 8, 16, 17, 48, 256, 2048, 8192])
def test_suggestions_are_listed_configs(t, n, k, sm_count, cc_major):
    kind, cfg = suggest_w4a16_config(t, n, k, sm_count, cc_major)
    assert kind == ("gemv" if t <= W4A16_GEMV_MAX_T else "gemm")
    listed = [c for kk, c in w4a16_configs(Family.SM90 if cc_major == 9 else Family.SM120) if kk == kind]
    assert {kk: v for kk, v in cfg.items() if kk != "split_k"} in listed
    if kind == "gemv":
        split = cfg["split_k"]
        k_split = -(-k // split)
        assert 1 <= split and k_split >= cfg["block_k"]
        assert split == gemv_split_k(n, k, cfg["block_n"], cfg["block_k"], sm_count, t)


# ---------------------------------------------------------------------------------------------------------------
# sm_120 compile checks of every listed config (bf16, fast decode: what runs on sm_120)
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def _compiled(kernel: str, cfg_items: tuple, dtype: str = "bf16", arch: int = 120):
    cfg = dict(cfg_items)
    num_warps, num_stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    if kernel == "gemv":
        sig, div = W4A16_GEMV_SIGNATURE, W4A16_GEMV_DIVISIBLE
        consts = dict(HAS_BIAS=True, SPLIT=False, EVEN_K=True, FAST_DECODE=True, BLOCK_N=cfg["block_n"],
                      BLOCK_K=cfg["block_k"], BLOCK_T=16)
    else:
        sig, div = W4A16_GEMM_SIGNATURE, W4A16_GEMM_DIVISIBLE
        consts = dict(HAS_BIAS=True, EVEN_K=True, FAST_DECODE=True, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
                      BLOCK_K=cfg["block_k"], GROUP_M=cfg["group_m"], SWAP_AB=cfg["swap_ab"])
    sig = {a: (f"*{dtype}" if v == "*bf16" else v) for a, v in sig.items()}
    return compile_kernel(f"{MODULE}:_w4a16_{kernel}_kernel", sig, consts, num_warps=num_warps,
                          num_stages=num_stages, divisible=div, arch=arch)


def _config_id(kind, cfg):
    return f"{kind}-" + "-".join(f"{k}{v}" for k, v in cfg.items())


SM120_CONFIGS = w4a16_configs(Family.SM120)
ALL_CONFIGS = w4a16_configs(Family.SM90)  # the sm_120 list plus the Hopper-only tile: everything runs on the H200
assert all(c in ALL_CONFIGS for c in SM120_CONFIGS)


@pytest.mark.compile
@pytest.mark.parametrize("kind,cfg", SM120_CONFIGS, ids=[_config_id(*c) for c in SM120_CONFIGS])
def test_config_compiles_for_sm120(kind, cfg):
    rep = _compiled(kind, tuple(cfg.items()))
    print(f"\n{kind} {cfg}: {rep.summary()}")
    rep.require_no_local().require_smem()
    rep.require_ptx(r"prmt\.b32").require_sass(r"\bPRMT\b")  # the fast decode
    rep.require_sass(r"HMMA\.16816\.F32\.BF16")  # 16-bit tensor-core MMA with fp32 accumulation
    rep.require_sass(r"LDGSTS")  # the loads are pipelined with cp.async
    assert "sm_120a" in rep.ptx


@pytest.mark.compile
@pytest.mark.parametrize("cfg", W4A16_GEMM_CONFIGS_SM90, ids=[_config_id("gemm", c) for c in W4A16_GEMM_CONFIGS_SM90])
def test_hopper_config_compiles_for_sm90(cfg):
    rep = _compiled("gemm", tuple(cfg.items()), arch=90)
    print(f"\ngemm {cfg}: {rep.summary()}")
    rep.require_no_local().require_smem(227 * 1024)
    rep.require_sass(r"HGMMA\.\w+\.F32\.BF16")  # wgmma; the decoded weight feeds it from registers
    assert "local_alloc" not in rep.ttgir[rep.ttgir.find("scf.for"):rep.ttgir.find("scf.yield")]


@pytest.mark.compile
def test_fp16_gemv_compiles_for_sm120():
    rep = _compiled("gemv", tuple(W4A16_GEMV_CONFIGS[1].items()), "fp16")
    rep.require_no_local().require_smem().require_sass(r"HMMA\.16816\.F32(\.F16)?\b")
    rep.require_ptx(r"0x46444240")  # the fp16 table, not the bf16 one


@pytest.mark.compile
def test_finish_kernel_compiles_for_sm120():
    rep = compile_kernel(f"{MODULE}:_w4a16_splitk_finish_kernel", W4A16_FINISH_SIGNATURE,
                         dict(HAS_BIAS=True, BLOCK_N=FINISH_BLOCK_N), divisible=W4A16_FINISH_DIVISIBLE)
    rep.require_no_local().require_smem()


# ---------------------------------------------------------------------------------------------------------------
# GPU: real checkpoint shapes (the H200 runs these; the same source as sm_120 with the fast decode on or off)
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def _real_weight(n: int, k: int):
    """Random codes (every byte value) and e4m3 scales around 2^-4..2^2, two fused parts with their own globals."""
    g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    codes = torch.randint(0, 256, (n, k // 2), generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)
    scales = torch.exp2(torch.rand(n, k // 16, generator=g, device="cuda") * 6 - 4).to(torch.float8_e4m3fn)
    widths = [n // 4, n - n // 4]
    decs = torch.tensor([0.01, 0.003])  # per-part globals (the reference takes them on the CPU)
    dec_rows = torch.repeat_interleave(decs, torch.tensor(widths)).cuda()
    w_unit = unit_values(codes, scales)  # fp32 [N, K], exact
    return codes, scales, decs, widths, dec_rows, w_unit


def _check_real(out, x, n, k, bias=None):
    codes, scales, decs, widths, dec_rows, w_unit = _real_weight(n, k)
    assert not torch.backends.cuda.matmul.allow_tf32, "the fp32 reference must not use TF32"
    ref = linear_w4a16_ref(x, codes, scales, decs, logical_widths=widths, bias=bias)
    mag = (x.float().abs() @ w_unit.abs().t()) * dec_rows[None, :]
    allowed = 2 * k * 2.0**-24 * mag + ULP[out.dtype] * ref.float().abs()
    err = (out.float() - ref.float()).abs()
    assert bool((err <= allowed).all()), f"max excess {float((err - allowed).max()):.3g}, max err {float(err.max()):.3g}"


GPU_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "tl-decode"])
@pytest.mark.parametrize("dtype", GPU_DTYPES.values(), ids=GPU_DTYPES.keys())
@pytest.mark.parametrize("n,k", REAL_SHAPES.values(), ids=REAL_SHAPES.keys())
def test_real_shapes_decode(n, k, dtype, fast):
    """T = 1..16 through the suggested decode config (split-K or not, as the H200's SM count gives)."""
    codes, scales, _, _, dec_rows, _ = _real_weight(n, k)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    for t in (1, 2, 3, 8, 16):
        kind, cfg = suggest_w4a16_config(t, n, k, sm, torch.cuda.get_device_capability()[0])
        x = _x(t, k, dtype, gen, row_pad=64)
        out = w4a16_gemv(x, codes, scales, dec_rows, fast_decode=fast, **cfg)
        _check_real(out, x, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "tl-decode"])
@pytest.mark.parametrize("dtype", GPU_DTYPES.values(), ids=GPU_DTYPES.keys())
@pytest.mark.parametrize("n,k", REAL_SHAPES.values(), ids=REAL_SHAPES.keys())
def test_real_shapes_prefill(n, k, dtype, fast):
    """T = 17, 48, 256, 2048 through the suggested GEMM config."""
    codes, scales, _, _, dec_rows, _ = _real_weight(n, k)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(1)
    for t in (17, 48, 256, 2048):
        kind, cfg = suggest_w4a16_config(t, n, k, sm, torch.cuda.get_device_capability()[0])
        x = _x(t, k, dtype, gen)
        out = w4a16_gemm(x, codes, scales, dec_rows, fast_decode=fast, **cfg)
        _check_real(out, x, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,cfg", ALL_CONFIGS, ids=[_config_id(*c) for c in ALL_CONFIGS])
@pytest.mark.parametrize("dtype", GPU_DTYPES.values(), ids=GPU_DTYPES.keys())
def test_every_config_on_gpu(kind, cfg, dtype):
    """Each listed config (whatever the suggestion picks here), with bias, on one real shape and one odd one."""
    cfg = dict(cfg)
    gen = torch.Generator().manual_seed(2)
    for n, k in [(5120, 8192), (40, 160)]:
        if (n, k) == (40, 160):
            p = make_linear(n, k, gen=gen, logical_widths=[16, 24])
            codes, scales, decs, widths = p.codes.cuda(), p.scales.cuda(), _part_decs(p), p.logical_widths
            dec_rows = p.dec_rows.cuda()
        else:
            codes, scales, decs, widths, dec_rows, _ = _real_weight(n, k)
        bias = torch.randn(n, generator=gen).to(dtype).cuda()
        for t in ((1, 3, 16) if kind == "gemv" else (17, 300)):
            x = _x(t, k, dtype, gen, row_pad=16)
            if kind == "gemv":
                out = w4a16_gemv(x, codes, scales, dec_rows, bias, split_k=3, **cfg)
            else:
                out = w4a16_gemm(x, codes, scales, dec_rows, bias, **cfg)
            ref = linear_w4a16_ref(x, codes, scales, decs, logical_widths=widths, bias=bias)
            mag = (x.float().abs() @ unit_values(codes, scales).abs().t()) * dec_rows[None, :]
            allowed = 2 * k * 2.0**-24 * mag + ULP[dtype] * ref.float().abs()
            err = (out.float() - ref.float()).abs()
            assert bool((err <= allowed).all()), f"{(n, k, t)}: max excess {float((err - allowed).max()):.3g}"


@pytest.mark.gpu
def test_split_k_is_deterministic():
    codes, scales, _, _, dec_rows, _ = _real_weight(5120, 25600)
    x = _x(8, 25600, torch.bfloat16, torch.Generator().manual_seed(3))
    a = w4a16_gemv(x, codes, scales, dec_rows, split_k=8, **GEMV_TILE)
    b = w4a16_gemv(x, codes, scales, dec_rows, split_k=8, **GEMV_TILE)
    assert torch.equal(a, b)


@pytest.mark.gpu
def test_gemv_under_cuda_graph():
    """No host sync, shape-only allocation: capture once, replay with new activations."""
    codes, scales, _, _, dec_rows, _ = _real_weight(10240, 5120)
    x = _x(4, 5120, torch.bfloat16, torch.Generator().manual_seed(4)).contiguous()
    w4a16_gemv(x, codes, scales, dec_rows, split_k=4, **GEMV_TILE)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16_gemv(x, codes, scales, dec_rows, split_k=4, **GEMV_TILE)
    x.copy_(torch.randn(x.shape, device="cuda").to(x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    _check_real(out, x, 10240, 5120)
