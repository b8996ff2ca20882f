"""Activation quantizer: bit-exact codes and scale bytes against ``format.quantize_nvfp4``.

CPU: the kernel runs in the Triton interpreter (tiny shapes, the exact integer e4m3 rounding).
GPU (H200): real shapes, both e4m3 roundings (native ``cvt.rn.satfinite.e4m3x2`` and the integer one).
Compile: the dispatch's tiles for sm_120 (and the e4m3 convert instruction they use).
"""

import re

import pytest
import torch
import triton
import triton.language as tl

from vllm_nvfp4_sm120.dispatch.linear import act_quant_config
from vllm_nvfp4_sm120.format import GlobalScale, quantize_nvfp4, round_to_e2m1, swizzle_128x4, swizzled_shape
from vllm_nvfp4_sm120.format.e2m1 import E2M1_MAGNITUDES
from vllm_nvfp4_sm120.kernels.act_quant import (
    ACT_QUANT_DIVISIBLE,
    ACT_QUANT_SIGNATURE,
    _e2m1_codes,
    _e4m3_rne,
    quantize_act_nvfp4,
)

KERNEL = "vllm_nvfp4_sm120.kernels.act_quant:_act_quant_kernel"
DTYPES = [torch.bfloat16, torch.float16]
TILE = dict(block_t=1, block_k=256, num_warps=1)  # for the checks that never reach a launch


def _device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def _activations(t: int, k: int, dtype, gen, *, strided: bool = False) -> torch.Tensor:
    """Blocks of very different magnitudes (sub-normal e4m3 scales up to large ones), an all-zero row, -0.0."""
    mag = 10.0 ** (torch.rand(t, k // 16, 1, generator=gen) * 6 - 4)
    x = (torch.randn(t, k // 16, 16, generator=gen) * mag).reshape(t, k)
    if t > 1:
        x[1] = 0.0
        x[1, ::3] = -0.0
    if strided:  # a row-strided view, as vLLM passes slices of a fused buffer
        x = torch.cat([x, torch.randn(t, 32, generator=gen)], dim=1)[:, :k]
    return x.to(dtype)


def _enc(x: torch.Tensor, factor: float = 1.0) -> GlobalScale:
    return GlobalScale.from_encode(GlobalScale.of(x).enc * factor)


def _swizzle(scales: torch.Tensor) -> torch.Tensor:
    # format.swizzle_128x4 cannot reshape an empty [0, Kb] tensor (reported); T = 0 swizzles to [0, round_up(Kb, 4)].
    if scales.shape[0] == 0:
        return scales.new_zeros(swizzled_shape(0, scales.shape[1]))
    return swizzle_128x4(scales)


def _check(x, gs, *, swizzled, **kw):
    """The kernel on the dispatch's tile for x's shape, or on the tile fields given in ``kw``."""
    t, k = x.shape
    tile = {k_: kw.pop(k_, v) for k_, v in act_quant_config(t, k, swizzled).items()}
    codes, scales = quantize_act_nvfp4(x, gs.enc.reshape(1).to(x.device), swizzled=swizzled, **tile, **kw)
    ref = quantize_nvfp4(x.cpu(), gs)
    assert codes.shape == (t, k // 2) and codes.dtype == torch.uint8
    assert scales.dtype == torch.float8_e4m3fn
    torch.testing.assert_close(codes.cpu(), ref.codes, rtol=0, atol=0)
    want = _swizzle(ref.scales) if swizzled else ref.scales
    assert scales.shape == want.shape
    torch.testing.assert_close(scales.cpu().view(torch.uint8), want.view(torch.uint8), rtol=0, atol=0)
    return codes, scales


# ---------------------------------------------------------------------------------------------------------------
# CPU: the interpreter


@pytest.mark.parametrize("t,k", [(0, 64), (1, 16), (1, 256), (3, 48), (3, 64), (130, 48)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("swizzled", [False, True], ids=["linear", "swizzled"])
@pytest.mark.parametrize("strided", [False, True], ids=["contig", "strided"])
def test_matches_reference(t, k, dtype, swizzled, strided, gen):
    x = _activations(t, k, dtype, gen, strided=strided)
    _check(x.to(_device()), _enc(x), swizzled=swizzled)


@pytest.mark.parametrize("swizzled", [False, True], ids=["linear", "swizzled"])
def test_saturating_global(swizzled, gen):
    # A global 64x too large: most block scales clamp at 448 and most codes saturate at +-6.
    x = _activations(5, 64, torch.bfloat16, gen)
    _check(x.to(_device()), _enc(x, 64.0), swizzled=swizzled)


def test_ties_and_signs():
    # enc = 1 and a block amax of 6 make the block scale exactly 1: the values below are the e2m1 midpoints,
    # their neighbours, and negatives rounding to -0 (code 8).
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    row = [6.0] + mids + [-m for m in mids] + [-0.0]
    x = torch.tensor([row, [-v for v in row], [0.1, -0.1] * 8], dtype=torch.bfloat16)
    _check(x.to(_device()), GlobalScale.from_encode(1.0), swizzled=False)


def test_swizzled_padding_is_written(gen):
    # The padding of the 128x4 layout must come out zero even in a buffer full of garbage.
    x = _activations(3, 48, torch.bfloat16, gen).to(_device())
    buf = torch.full(swizzled_shape(3, 3), 0x55, dtype=torch.uint8, device=x.device)
    _, scales = _check(x, _enc(x), swizzled=True, out_scales=buf)
    assert scales.data_ptr() == buf.data_ptr()


def test_into_padded_code_buffer(gen):
    # The b12x route writes codes into a K-padded buffer: a row-strided out_codes view.
    x = _activations(4, 48, torch.float16, gen).to(_device())
    buf = torch.zeros(4, 32, dtype=torch.uint8, device=x.device)
    codes, _ = _check(x, _enc(x), swizzled=True, out_codes=buf[:, :24])
    assert codes.data_ptr() == buf.data_ptr() and not buf[:, 24:].any()


@pytest.mark.parametrize("tile", [dict(block_t=1, block_k=16), dict(block_t=4, block_k=64),
                                  dict(block_t=2, block_k=512)])
def test_other_tiles(tile, gen):
    x = _activations(5, 96, torch.bfloat16, gen)
    _check(x.to(_device()), _enc(x), swizzled=True, **tile)


@triton.jit
def _rounding_probe(v_ptr, code_ptr, byte_ptr, val_ptr, N, NATIVE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    v = tl.load(v_ptr + offs, mask=ok, other=0.0)
    tl.store(code_ptr + offs, _e2m1_codes(v), mask=ok)
    byte, val = _e4m3_rne(tl.minimum(tl.abs(v), 448.0), NATIVE)
    tl.store(byte_ptr + offs, byte, mask=ok)
    tl.store(val_ptr + offs, val, mask=ok)


def _probe_values() -> torch.Tensor:
    """Every e2m1 and e4m3 value and midpoint, one fp32 ulp either side, signs, zero, out-of-range values."""
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    grids = [torch.tensor(E2M1_MAGNITUDES), e4m3]
    pts = [torch.tensor([0.0, 1e-30, 1e-8, 7.0, 100.0, 448.0, 460.0, 1e6])]
    for g in grids:
        pts += [g, (g[1:] + g[:-1]) / 2]
    base = torch.cat(pts)
    near = torch.cat([base, torch.nextafter(base, torch.tensor(0.0)), torch.nextafter(base, torch.tensor(1e9))])
    near = near[near >= 0]
    return torch.cat([near, -near])


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["exact", "native"])
def test_rounding_helpers_exhaustive(native):
    v = _probe_values().to(_device())
    n = v.numel()
    code = torch.empty(n, dtype=torch.int32, device=v.device)
    byte = torch.empty_like(code)
    val = torch.empty(n, dtype=torch.float32, device=v.device)
    _rounding_probe[(triton.cdiv(n, 256),)](v, code, byte, val, n, NATIVE=native, BLOCK=256)
    vc = v.cpu()
    torch.testing.assert_close(code.cpu(), round_to_e2m1(vc.clamp(-6, 6)).to(torch.int32), rtol=0, atol=0)
    want = vc.abs().clamp(max=448.0).to(torch.float8_e4m3fn)
    torch.testing.assert_close(byte.cpu(), want.view(torch.uint8).to(torch.int32), rtol=0, atol=0)
    torch.testing.assert_close(val.cpu(), want.to(torch.float32), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------------
# Bad input


def _ok():
    x = torch.zeros(2, 32, dtype=torch.bfloat16, device=_device())
    return x, torch.ones(1, dtype=torch.float32, device=x.device)


@pytest.mark.parametrize(
    "change,error,match",
    [
        (lambda x, e: (x.float(), e), TypeError, r"x: expected dtype bfloat16 or float16"),
        (lambda x, e: (x[:, :24], e), ValueError, r"x: K = 24 .* multiple of 16"),
        (lambda x, e: (x[0], e), ValueError, r"x: expected 2-D"),
        (lambda x, e: (x.t(), e), ValueError, r"x: expected 2-D|x: the last dimension must be contiguous"),
        (lambda x, e: (x, e.double()), TypeError, r"in_enc: expected dtype float32"),
        (lambda x, e: (x, e.expand(2)), ValueError, r"in_enc: expected one fp32 encode global"),
        (lambda x, e: (x, 1.0), TypeError, r"in_enc: expected a torch.Tensor"),
    ],
)
def test_bad_input(change, error, match):
    x, e = change(*_ok())
    with pytest.raises(error, match=match):
        quantize_act_nvfp4(x, e, **TILE)


def test_bad_output_buffers():
    x, e = _ok()
    with pytest.raises(ValueError, match=r"out_codes: expected shape \[2, 16\]"):
        quantize_act_nvfp4(x, e, out_codes=torch.empty(2, 8, dtype=torch.uint8, device=x.device), **TILE)
    with pytest.raises(ValueError, match=r"out_scales \(128x4-swizzled e4m3 scales\): expected shape \[128, 4\]"):
        quantize_act_nvfp4(x, e, swizzled=True, out_scales=torch.empty(2, 2, dtype=torch.uint8, device=x.device),
                           **TILE)
    with pytest.raises(TypeError, match=r"out_scales: expected dtype"):
        quantize_act_nvfp4(x, e, out_scales=torch.empty(2, 2, dtype=torch.float16, device=x.device), **TILE)


# ---------------------------------------------------------------------------------------------------------------
# sm_120 compile check (each distinct tile once)

# (SWIZZLED, block_t, block_k, num_warps): the tiles act_quant_config returns.
_TILES = sorted({(sw, c["block_t"], c["block_k"], c["num_warps"])
                 for t in (1, 16, 256, 2048) for k in (5120, 8192, 25600, 28672) for sw in (False, True)
                 for c in [act_quant_config(t, k, sw)]})


@pytest.fixture(scope="module")
def compiled():
    from vllm_nvfp4_sm120.kernels.aot import compile_kernel

    # What sm_120 runs: both hardware converts (the launcher's default there).
    return {
        tile: compile_kernel(KERNEL, ACT_QUANT_SIGNATURE,
                             dict(SWIZZLED=tile[0], NATIVE_E4M3=True, NATIVE_E2M1=True, BLOCK_T=tile[1],
                                  BLOCK_K=tile[2]),
                             num_warps=tile[3], divisible=ACT_QUANT_DIVISIBLE)
        for tile in _TILES
    }


@pytest.mark.compile
@pytest.mark.parametrize("tile", _TILES, ids=lambda t: f"{'swz' if t[0] else 'lin'}-{t[1]}x{t[2]}-w{t[3]}")
def test_compiles_for_sm120(compiled, tile):
    rep = compiled[tile]
    rep.require_no_local().require_smem()
    # fp32 -> e4m3 is the RNE hardware convert, two per instruction.
    rep.require_ptx(r"cvt\.rn\.satfinite\.e4m3x2\.f32").require_sass(r"F2FP\.SATFINITE\.E4M3\.F32")
    # fp32 -> e2m1 is the hardware convert too, two values per instruction (one per output byte).
    rep.require_ptx(r"cvt\.rn\.satfinite\.e2m1x2\.f32").require_sass(r"F2FP\.SATFINITE\.E2M1\.F32")
    assert len(re.findall(r"cvt\.rn\.satfinite\.e2m1x2\.f32", rep.ptx)) * 2 * 32 * tile[3] == tile[1] * tile[2]
    # 16-byte activation loads with the evict_last hint.
    rep.require_ptx(r"ld\.global\.L1::evict_last[.\w:]*\.v4\.b32").require_sass(r"LDG\.E\.EL\.128")
    assert "sm_120a" in rep.ptx


@pytest.mark.compile
def test_arithmetic_e2m1_compiles_for_sm90():
    # What the H200 runs (its GPU tests check it bit-exact): the exact e2m1 arithmetic, no fp4 convert (sm_90 has
    # none).  The hardware convert's numerics await an sm_120 run (selftest's activation-quant check).
    from vllm_nvfp4_sm120.kernels.aot import compile_kernel

    rep = compile_kernel(KERNEL, ACT_QUANT_SIGNATURE,
                         dict(SWIZZLED=False, NATIVE_E4M3=True, NATIVE_E2M1=False, BLOCK_T=8, BLOCK_K=1024),
                         num_warps=4, divisible=ACT_QUANT_DIVISIBLE, arch=90)
    rep.require_no_local().require_ptx(r"cvt\.rn\.satfinite\.e4m3x2\.f32")
    assert not re.search(r"e2m1", rep.ptx)


# ---------------------------------------------------------------------------------------------------------------
# GPU (H200): real shapes


@pytest.mark.gpu
@pytest.mark.parametrize("k", [5120, 8192, 25600, 28672])
@pytest.mark.parametrize("t", [1, 16, 256, 2048])
def test_real_shapes_gpu(t, k):
    gen = torch.Generator().manual_seed(t * 100003 + k)
    x = _activations(t, k, torch.bfloat16, gen, strided=t == 16)
    gs = _enc(x)
    ref = quantize_nvfp4(x, gs)  # on the CPU: exact IEEE division, no fast-math
    xd = x.cuda()
    for native in (True, False):
        for swizzled in (False, True):
            codes, scales = quantize_act_nvfp4(xd, gs.enc.reshape(1).cuda(), swizzled=swizzled, native_e4m3=native,
                                               **act_quant_config(t, k, swizzled))
            torch.testing.assert_close(codes.cpu(), ref.codes, rtol=0, atol=0)
            want = swizzle_128x4(ref.scales) if swizzled else ref.scales
            torch.testing.assert_close(scales.cpu().view(torch.uint8), want.view(torch.uint8), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_small_and_saturating_gpu(dtype):
    gen = torch.Generator().manual_seed(7)
    for t, k in [(0, 64), (1, 16), (3, 48), (130, 256), (257, 4096)]:
        x = _activations(t, k, dtype, gen, strided=True)
        for factor in (1.0, 64.0):
            for swizzled in (False, True):
                _check(x.cuda(), _enc(x, factor), swizzled=swizzled)


@pytest.mark.gpu
def test_cuda_graph_replay():
    # Captured once, replayed with new activations and a new global: nothing is baked in at capture time.
    gen = torch.Generator().manual_seed(3)
    x = _activations(40, 512, torch.bfloat16, gen).cuda()
    enc = torch.ones(1, dtype=torch.float32, device="cuda")
    codes = torch.empty(40, 256, dtype=torch.uint8, device="cuda")
    scales = torch.empty(128, 32, dtype=torch.float8_e4m3fn, device="cuda")
    tile = act_quant_config(40, 512, swizzled=True)
    quantize_act_nvfp4(x, enc, swizzled=True, out_codes=codes, out_scales=scales, **tile)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantize_act_nvfp4(x, enc, swizzled=True, out_codes=codes, out_scales=scales, **tile)
    x2 = _activations(40, 512, torch.bfloat16, gen)
    gs = _enc(x2)
    x.copy_(x2)
    enc.copy_(gs.enc.reshape(1))
    scales.view(torch.uint8).fill_(0x55)
    graph.replay()
    ref = quantize_nvfp4(x2, gs)
    torch.testing.assert_close(codes.cpu(), ref.codes, rtol=0, atol=0)
    want = swizzle_128x4(ref.scales).view(torch.uint8)
    torch.testing.assert_close(scales.cpu().view(torch.uint8), want, rtol=0, atol=0)


# Every e2m1 rounding midpoint (ties to even), saturation, -0 and tiny negatives, with block scale exactly 1
# (amax 6, encode global 1): where a hardware convert would disagree with the reference, if anywhere.
EDGE_BLOCK = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.1, -0.0, 0.0, -6.0, 0.5, 3.0, -5.0]


@pytest.mark.sm120
@pytest.mark.parametrize("swizzled", [False, True])
def test_native_e2m1_convert_sm120(swizzled):
    gen = torch.Generator().manual_seed(11)
    x = torch.cat([torch.tensor(EDGE_BLOCK).repeat(4, 8), _activations(4, 128, torch.float32, gen)])
    x = x.to(torch.bfloat16)
    for gs in (GlobalScale.from_encode(1.0), _enc(x)):
        ref = quantize_nvfp4(x, gs)
        codes, scales = quantize_act_nvfp4(x.cuda(), gs.enc.reshape(1).cuda(), swizzled=swizzled, native_e2m1=True,
                                           **act_quant_config(*x.shape, swizzled))
        torch.testing.assert_close(codes.cpu(), ref.codes, rtol=0, atol=0)
        want = swizzle_128x4(ref.scales) if swizzled else ref.scales
        torch.testing.assert_close(scales.cpu().view(torch.uint8), want.view(torch.uint8), rtol=0, atol=0)
