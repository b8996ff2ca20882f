"""W4A16 prefill as dequantize + cuBLAS (``kernels/w4a16_dequant.py``).

Two claims, tested separately so a failure says which one broke:
1. the dequant kernel is **bit-exact** against ``format.dequantize_nvfp4`` (each fused part with its own global),
   in bf16 and fp16, including round-to-nearest-even ties and fp16 subnormals;
2. ``w4a16_dequant_mm`` is that 16-bit weight times ``x`` with fp32 accumulation: against
   ``(x.float() @ w16.float().T + bias).to(dtype)`` within the fp32 summation-order bound of two orders,
   ``2 * K * 2^-24 * sum|x||w16|``, plus 1 ulp of the output dtype at ``|ref|`` (the bound the W4A16 GEMM tests use).
Against ``linear_w4a16_ref`` (exact ``e2m1 x e4m3`` products, global applied after the sum) the difference also
contains the weight's rounding to 16 bits, at most half an ulp per weight: ``+ ULP/2 * sum|x||w|`` (plus the fp16
subnormal spacing, ``2^-25 * sum|x|``).  The fp32 bound alone does not cover it: on random weights at K = 5120 in
bf16 that rounding reaches ~0.8x of ``2 * K * 2^-24 * sum|x||w|``, so without the extra term the check would be a
coin toss over 10^8 outputs rather than a proof.

CPU: the interpreter runs the dequant kernel (pure-``tl`` decode and integer bf16 rounding; the interpreter's own
fp32 -> bf16 cast truncates) and torch's CPU matmul does the GEMMs.  GPU (``-m gpu``, the H200): the real shapes of
the benchmarked models at T = 256 and 2048, fast decode on and off, with cuBLAS's reduced-precision split-K
reductions disabled (torch allows them by default; they would add bf16/fp16 roundings of partial sums that no fp32
bound covers).
"""

import functools

import pytest
import torch

from vllm_nvfp4_sm120.dispatch.linear import dequant_mm_chunk_n
from vllm_nvfp4_sm120.format import GlobalScale, dequantize_nvfp4, linear_w4a16_ref, make_linear, unit_values
from vllm_nvfp4_sm120.kernels.aot import compile_kernel
from vllm_nvfp4_sm120.kernels.w4a16_dequant import (
    DEQUANT_BLOCK_K,
    DEQUANT_BLOCK_R,
    DEQUANT_NUM_WARPS,
    NVFP4_DEQUANT_DIVISIBLE,
    NVFP4_DEQUANT_SIGNATURE,
    dequantize_rows,
    w4a16_dequant_mm,
)

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
MODULE = "vllm_nvfp4_sm120.kernels.w4a16_dequant"
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}  # relative spacing at the top of a binade
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Decode globals whose products land exactly on bf16 / fp16 rounding ties: m * (1 + 2^-8) for a 1-bit m has its
# 9th significant bit set and nothing below, the midpoint between two bf16 values (2^-11: between fp16 values).
TIE_BF16 = (1 + 2.0**-8) / 256
TIE_FP16 = (1 + 2.0**-11) / 256


def _reference_dequant(codes, scales, dec_rows, dtype):
    """``format.dequantize_nvfp4`` on each run of rows that shares a decode global (one per fused part)."""
    decs, counts = torch.unique_consecutive(dec_rows.cpu(), return_counts=True)
    out, row = [], 0
    for dec, count in zip(decs, counts.tolist()):
        out.append(dequantize_nvfp4(codes[row:row + count], scales[row:row + count], GlobalScale.from_decode(dec),
                                    dtype))
        row += count
    return torch.cat(out) if out else torch.empty(0, codes.shape[1] * 2, dtype=dtype, device=codes.device)


def _assert_bits_equal(got, ref):
    assert got.shape == ref.shape and got.dtype == ref.dtype
    same = got.view(torch.int16) == ref.view(torch.int16)
    if not bool(same.all()):
        r, c = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{int((~same).sum())} of {got.numel()} values differ; first [{r}, {c}]: "
                             f"got {float(got[r, c])!r}, reference {float(ref[r, c])!r}")


def _assert_mm_close(out, x, w16, bias=None):
    """``out`` within the fp32 summation-order bound of ``x @ w16^T (+ bias)`` (see the module docstring)."""
    ref = x.float() @ w16.float().t()
    if bias is not None:
        ref = ref + bias.float()
    ref = ref.to(out.dtype).float()
    mag = x.float().abs() @ w16.float().abs().t()
    allowed = 2 * x.shape[1] * 2.0**-24 * mag + ULP[out.dtype] * ref.abs()
    err = (out.float() - ref).abs()
    if bool((err > allowed).any()):
        i = int(torch.argmax((err - allowed).flatten()))
        t, n = divmod(i, out.shape[1])
        raise AssertionError(f"{int((err > allowed).sum())} of {out.numel()} out of bound; worst [{t}, {n}]: "
                             f"out {float(out[t, n])}, ref {float(ref[t, n])}, allowed {float(allowed[t, n]):.3g}")


def _assert_w4a16_ref_close(out, x, codes, scales, dec_rows, bias=None):
    """``out`` against ``linear_w4a16_ref``: the fp32 bound plus the weight's rounding to 16 bits (docstring)."""
    ref = linear_w4a16_ref(x, codes, scales, dec_rows, bias=bias).float()
    mag = (x.float().abs() @ unit_values(codes, scales).abs().t()) * dec_rows.abs()
    allowed = (2 * x.shape[1] * 2.0**-24 + ULP[out.dtype] / 2) * mag + ULP[out.dtype] * ref.abs()
    if out.dtype == torch.float16:
        allowed += 2.0**-25 * x.float().abs().sum(1, keepdim=True)
    excess = float(((out.float() - ref).abs() - allowed).max()) if out.numel() else 0.0
    assert excess <= 0, f"vs linear_w4a16_ref: max excess over the bound {excess:.3g}"


def _x(t, k, dtype, gen, *, row_pad=0):
    """Activations ``[t, k]``; with ``row_pad`` a row-strided view into a wider buffer."""
    return torch.randn(t, k + row_pad, generator=gen).to(dtype)[:, :k].to(DEVICE)


def _random_weight(n, k, gen, decs, device=DEVICE):
    """Random codes (every byte) and e4m3 scales 2^-9 .. 2^2 (e4m3 subnormals too; with the small globals, fp16
    subnormal weights), one fused part per decode global in ``decs``."""
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.exp2(torch.rand(n, k // 16, generator=gen) * 11 - 9).to(torch.float8_e4m3fn)
    widths = [n // len(decs)] * (len(decs) - 1)
    widths.append(n - sum(widths))
    dec_rows = torch.repeat_interleave(torch.tensor(decs, dtype=torch.float32), torch.tensor(widths))
    return codes.to(device), scales.to(device), dec_rows.to(device)


# ---------------------------------------------------------------------------------------------------------------
# The dequant kernel: bit-exact (interpreter on CPU; the compiled kernel on a GPU)
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("n,k", [(37, 64), (16, 272), (5, 512)])  # ragged rows; K tails (272, 64 < BLOCK_K)
def test_dequant_bit_exact(n, k, dtype, gen):
    codes, scales, dec_rows = _random_weight(n, k, gen, [0.0123457, TIE_BF16, TIE_FP16, 3.0])
    got = dequantize_rows(codes, scales, dec_rows, dtype)
    _assert_bits_equal(got.cpu(), _reference_dequant(codes.cpu(), scales.cpu(), dec_rows.cpu(), dtype))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_dequant_hits_rounding_ties(dtype, gen):
    """The tie globals really produce ties (else the bit-exact test above would not cover RNE)."""
    codes, scales, dec_rows = _random_weight(16, 256, gen, [TIE_BF16 if dtype == torch.bfloat16 else TIE_FP16])
    f32 = _reference_dequant(codes.cpu(), scales.cpu(), dec_rows.cpu(), torch.float32)
    low = 16 if dtype == torch.bfloat16 else 13  # fp32 bits below the 16-bit mantissa
    ties = (f32.view(torch.int32) & ((1 << low) - 1)) == (1 << (low - 1))
    assert int(ties.sum()) > 100
    _assert_bits_equal(dequantize_rows(codes, scales, dec_rows, dtype).cpu(),
                       _reference_dequant(codes.cpu(), scales.cpu(), dec_rows.cpu(), dtype))


def test_dequant_strided_rows_and_out(gen):
    """Codes/scales with padded rows (a route may pad the weight in place) and an ``out`` with a row stride."""
    codes, scales, dec_rows = _random_weight(24, 320, gen, [0.01, 0.003])
    padded_c = torch.zeros(24, 160 + 32, dtype=torch.uint8, device=DEVICE)
    padded_s = torch.zeros(24, 20 + 12, dtype=torch.uint8, device=DEVICE)
    padded_c[:, :160], padded_s[:, :20] = codes, scales.view(torch.uint8)
    out_buf = torch.full((24, 320 + 64), float("nan"), dtype=torch.float16, device=DEVICE)
    got = dequantize_rows(padded_c[:, :160], padded_s[:, :20], dec_rows, torch.float16, out=out_buf[:, :320])
    assert got.data_ptr() == out_buf.data_ptr()
    _assert_bits_equal(got.cpu(), _reference_dequant(codes.cpu(), scales.cpu(), dec_rows.cpu(), torch.float16))
    assert bool(out_buf[:, 320:].isnan().all())  # nothing written past K


# ---------------------------------------------------------------------------------------------------------------
# w4a16_dequant_mm on tiny shapes: chunking, ragged last chunk, per-part globals, bias, T = 0, strided x
# ---------------------------------------------------------------------------------------------------------------


def _small_problem(n, k, gen, widths=None):
    p = make_linear(n, k, gen=gen, logical_widths=widths)
    return p.codes.to(DEVICE), p.scales.to(DEVICE), p.dec_rows.to(DEVICE), p


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("chunk_n", [1, 16, 24, 40, 128])  # 24: ragged last chunk of 16 rows; 128 > N
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_dequant_mm_small(chunk_n, dtype, with_bias, gen):
    codes, scales, dec_rows, p = _small_problem(40, 160, gen, widths=[8, 16, 16])
    x = _x(5, 160, dtype, gen, row_pad=32)
    assert x.stride(0) == 192
    bias = torch.randn(40, generator=gen).to(dtype).to(DEVICE) if with_bias else None
    out = w4a16_dequant_mm(x, codes, scales, dec_rows, bias, chunk_n=chunk_n)
    w16 = _reference_dequant(p.codes, p.scales, p.dec_rows, dtype)
    _assert_mm_close(out.cpu(), x.cpu(), w16, None if bias is None else bias.cpu())


@pytest.mark.parametrize("t", [0, 1, 17, 300])
def test_dequant_mm_token_counts(t, gen):
    codes, scales, dec_rows, p = _small_problem(24, 64, gen)
    x = _x(t, 64, torch.float16, gen)
    out = w4a16_dequant_mm(x, codes, scales, dec_rows, chunk_n=16)
    assert out.shape == (t, 24) and out.dtype == torch.float16
    _assert_mm_close(out.cpu(), x.cpu(), _reference_dequant(p.codes, p.scales, p.dec_rows, torch.float16))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_dequant_mm_against_w4a16_reference(dtype, gen):
    codes, scales, dec_rows, p = _small_problem(40, 160, gen, widths=[8, 16, 16])
    x = _x(20, 160, dtype, gen)
    bias = torch.randn(40, generator=gen).to(dtype)
    out = w4a16_dequant_mm(x, codes, scales, dec_rows, bias.to(DEVICE), chunk_n=16).cpu()
    _assert_w4a16_ref_close(out, x.cpu(), p.codes, p.scales, p.dec_rows, bias)


def test_out_argument_is_written(gen):
    codes, scales, dec_rows, _ = _small_problem(40, 64, gen)
    x = _x(3, 64, torch.float16, gen)
    out = torch.full((3, 40), float("nan"), dtype=torch.float16, device=DEVICE)
    got = w4a16_dequant_mm(x, codes, scales, dec_rows, out=out, chunk_n=16)
    assert got is out and bool(torch.isfinite(out).all())
    torch.testing.assert_close(out, w4a16_dequant_mm(x, codes, scales, dec_rows, chunk_n=40), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Bad input: clear errors naming the tensor
# ---------------------------------------------------------------------------------------------------------------


def _good(gen):
    codes, scales, dec_rows, _ = _small_problem(24, 64, gen)
    return dict(x=_x(2, 64, torch.float16, gen), w_codes=codes, w_scales=scales, w_dec_rows=dec_rows, chunk_n=16)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: a.update(x=a["x"].float()), TypeError, r"^x: expected dtype bfloat16 or float16"),
        (lambda a: a.update(x=a["x"].t().contiguous().t()), ValueError, r"^x: the last dimension must be contiguous"),
        (lambda a: a.update(x=a["x"][:, :56]), ValueError, r"K = 56 must be a multiple of 16"),
        (lambda a: a.update(w_codes=a["w_codes"].view(torch.int8)), TypeError, r"^w_codes: expected dtype uint8"),
        (lambda a: a.update(w_codes=a["w_codes"][:, :16]), ValueError, r"^w_codes: expected shape \[24, 32\]"),
        (lambda a: a.update(w_scales=a["w_scales"][:, :2]), ValueError, r"^w_scales: expected shape \[24, 4\]"),
        (lambda a: a.update(w_scales=a["w_scales"].float()), TypeError, r"^w_scales: expected dtype"),
        (lambda a: a.update(w_dec_rows=a["w_dec_rows"][:3]), ValueError, r"^w_dec_rows: expected shape \[24\]"),
        (lambda a: a.update(w_dec_rows=a["w_dec_rows"].half()), TypeError, r"^w_dec_rows: expected dtype float32"),
        (lambda a: a.update(bias=torch.zeros(23, device=DEVICE)), ValueError, r"^bias: expected shape \[24\]"),
        (lambda a: a.update(out=torch.empty(2, 24, dtype=torch.bfloat16, device=DEVICE)), TypeError,
         r"^out: expected dtype float16"),
        (lambda a: a.update(chunk_n=0), ValueError, r"chunk_n must be a positive int, got 0"),
        (lambda a: a.update(chunk_n=2.5), ValueError, r"chunk_n must be a positive int, got 2.5"),
    ],
    ids=["x-dtype", "x-layout", "k-not-16", "codes-dtype", "codes-shape", "scales-shape", "scales-dtype",
         "dec-shape", "dec-dtype", "bias-shape", "out-dtype", "chunk-zero", "chunk-float"],
)
def test_bad_input_names_the_tensor(change, error, match, gen):
    args = _good(gen)
    change(args)
    with pytest.raises(error, match=match):
        w4a16_dequant_mm(**args)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda a: a.update(dtype=torch.float32), TypeError, r"^dtype: expected bfloat16 or float16, got float32"),
        (lambda a: a.update(codes=a["codes"][:, :28]), ValueError, r"^codes: K = 56 \(2 x last dimension\) must be"),
        (lambda a: a.update(codes=a["codes"].float()), TypeError, r"^codes: expected dtype uint8"),
        (lambda a: a.update(scales=a["scales"][:5]), ValueError, r"^scales: expected shape \[24, 4\]"),
        (lambda a: a.update(w_dec_rows=a["w_dec_rows"][:5]), ValueError, r"^w_dec_rows: expected shape \[24\]"),
        (lambda a: a.update(out=torch.empty(24, 32, dtype=torch.float16, device=DEVICE)), ValueError,
         r"^out: expected shape \[24, 64\]"),
    ],
    ids=["dtype", "k-not-16", "codes-dtype", "scales-shape", "dec-shape", "out-shape"],
)
def test_dequantize_rows_bad_input(change, error, match, gen):
    codes, scales, dec_rows, _ = _small_problem(24, 64, gen)
    args = dict(codes=codes, scales=scales, w_dec_rows=dec_rows, dtype=torch.float16)
    change(args)
    with pytest.raises(error, match=match):
        dequantize_rows(**args)


# ---------------------------------------------------------------------------------------------------------------
# sm_120 compile check (what runs on sm_120: fast decode, hardware rounding)
# ---------------------------------------------------------------------------------------------------------------


@functools.cache
def _compiled(dtype: str, even_k: bool = True):
    sig = {a: (f"*{dtype}" if v == "*bf16" else v) for a, v in NVFP4_DEQUANT_SIGNATURE.items()}
    consts = dict(EVEN_K=even_k, FAST_DECODE=True, BLOCK_R=DEQUANT_BLOCK_R, BLOCK_K=DEQUANT_BLOCK_K)
    return compile_kernel(f"{MODULE}:_nvfp4_dequant_kernel", sig, consts, num_warps=DEQUANT_NUM_WARPS,
                          divisible=NVFP4_DEQUANT_DIVISIBLE)


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_dequant_compiles_for_sm120(dtype):
    rep = _compiled(dtype)
    print(f"\n{dtype}: {rep.summary()}")
    rep.require_no_local().require_smem()
    assert "sm_120a" in rep.ptx
    # The fast decode: lop3 (sign/magnitude masks) + prmt table lookups, not the arithmetic decode.
    rep.require_ptx(r"and\.b32\s+\S+, \S+, 0x77777777").require_sass(r"\bPRMT\b").require_sass(r"\bLOP3\.LUT\b")
    rep.require_ptx(r"0x46444240" if dtype == "fp16" else r"0xC0804000")  # that dtype's table
    rep.require_ptx(rf"cvt\.rn\.{'bf16x2' if dtype == 'bf16' else 'f16x2'}\.f32")  # hardware round-to-nearest-even
    rep.require_sass(r"STG\.E\.128").require_sass(r"LDG\.E\.EF\.128")  # 16-byte stores; codes read evict-first


@pytest.mark.compile
def test_dequant_k_tail_compiles_for_sm120():
    _compiled("bf16", even_k=False).require_no_local().require_smem()


# ---------------------------------------------------------------------------------------------------------------
# GPU: the real shapes of the benchmarked models (the H200 runs these)
# ---------------------------------------------------------------------------------------------------------------

REAL_SHAPES = {  # name: (N, K)
    "qwen3-32b-qkv": (10240, 5120),
    "qwen3-32b-o": (5120, 8192),
    "qwen3-32b-gate_up": (51200, 5120),
    "qwen3-32b-down": (5120, 25600),
    "llama-3.3-70b-gate_up": (57344, 8192),
    "llama-3.3-70b-down": (8192, 28672),
}
CHECK_ROWS = 4096  # the references are computed in row blocks to keep GPU memory small


@pytest.fixture
def exact_cublas_reductions():
    """Disallow cuBLAS's reduced-precision (16-bit) split-K reductions for the test, restoring torch's defaults."""
    m = torch.backends.cuda.matmul
    saved = (m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction)
    m.allow_bf16_reduced_precision_reduction = m.allow_fp16_reduced_precision_reduction = False
    assert not m.allow_tf32, "the fp32 references must not use TF32"
    yield
    m.allow_bf16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction = saved


@functools.cache
def _real_weight(n: int, k: int):
    """Two fused parts with their own globals (one of them a rounding-tie global), drawn on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(n * 7 + k)
    codes = torch.randint(0, 256, (n, k // 2), generator=g, device="cuda", dtype=torch.int32).to(torch.uint8)
    scales = torch.exp2(torch.rand(n, k // 16, generator=g, device="cuda") * 11 - 9).to(torch.float8_e4m3fn)
    dec_rows = torch.repeat_interleave(torch.tensor([0.01, TIE_BF16], device="cuda"),
                                       torch.tensor([n // 4, n - n // 4], device="cuda"))
    return codes, scales, dec_rows


def _check_real(out, x, codes, scales, dec_rows, bias=None, *, fast=True):
    """Block by block of weight rows: the dequantized block bit-exact, ``out`` within the fp32 bound of it, and
    within the bound of ``linear_w4a16_ref`` (see the module docstring)."""
    for r0 in range(0, codes.shape[0], CHECK_ROWS):
        rows = slice(r0, r0 + CHECK_ROWS)
        w16 = dequantize_rows(codes[rows], scales[rows], dec_rows[rows], x.dtype, fast_decode=fast)
        _assert_bits_equal(w16, _reference_dequant(codes[rows], scales[rows], dec_rows[rows], x.dtype))
        b = None if bias is None else bias[rows]
        _assert_mm_close(out[:, rows], x, w16, b)
        _assert_w4a16_ref_close(out[:, rows], x, codes[rows], scales[rows], dec_rows[rows], b)


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "tl-decode"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("n,k", REAL_SHAPES.values(), ids=REAL_SHAPES.keys())
def test_real_shapes(n, k, dtype, fast, exact_cublas_reductions):
    """T = 256 and 2048 with the dispatch table's chunk for this GPU's SM count; bias and a row-strided x at 256."""
    codes, scales, dec_rows = _real_weight(n, k)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(1)
    for t in (256, 2048):
        x = _x(t, k, dtype, gen, row_pad=64 if t == 256 else 0)
        bias = torch.randn(n, generator=gen).to(dtype).cuda() if t == 256 else None
        out = w4a16_dequant_mm(x, codes, scales, dec_rows, bias, chunk_n=dequant_mm_chunk_n(t, n, k, sm),
                               fast_decode=fast)
        _check_real(out, x, codes, scales, dec_rows, bias, fast=fast)


@pytest.mark.gpu
def test_column_slices_are_written_in_place():
    """torch.mm into ``out[:, n0:n0 + rows]`` launches only our dequant kernel and cuBLAS: no copy kernels."""
    codes, scales, dec_rows = _real_weight(5120, 8192)
    x = _x(256, 8192, torch.bfloat16, torch.Generator().manual_seed(2))
    w4a16_dequant_mm(x, codes, scales, dec_rows, chunk_n=1024)  # compile outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        w4a16_dequant_mm(x, codes, scales, dec_rows, chunk_n=1024)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("_nvfp4_dequant_kernel" in name for name in kernels) == 5, kernels
    copies = [name for name in kernels if any(s in name.lower() for s in ("copy", "memcpy", "elementwise"))]
    assert not copies, copies


@pytest.mark.gpu
def test_dequant_mm_under_cuda_graph(exact_cublas_reductions):
    """No host sync, shape-only allocation: capture once, replay with new activations."""
    codes, scales, dec_rows = _real_weight(10240, 5120)
    gen = torch.Generator().manual_seed(3)
    x = _x(512, 5120, torch.bfloat16, gen).contiguous()
    bias = torch.randn(10240, generator=gen).to(torch.bfloat16).cuda()
    chunk = dequant_mm_chunk_n(512, 10240, 5120, torch.cuda.get_device_properties(0).multi_processor_count)
    w4a16_dequant_mm(x, codes, scales, dec_rows, bias, chunk_n=chunk)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w4a16_dequant_mm(x, codes, scales, dec_rows, bias, chunk_n=chunk)
    x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, w4a16_dequant_mm(x, codes, scales, dec_rows, bias, chunk_n=chunk), rtol=0, atol=0)
