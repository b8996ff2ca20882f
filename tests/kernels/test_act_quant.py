"""Activation quantizer: bit-exact codes and scale bytes against ``format.quantize_nvfp4``.

CPU: the kernel runs in the Triton interpreter (tiny shapes, the exact integer e4m3 rounding, the pure-Triton
e2m1 rounding and packing); the rounding helpers on every bf16 value and on dense fp32 windows around the e2m1
grid.
GPU (H200): real shapes, both e4m3 roundings (native ``cvt.rn.satfinite.e4m3x2`` and the integer one), the PTX
packing, bf16x2 amax and ``rcp.rn`` the GPU build uses (every fp32 bit pattern through the packing), non-finite
inputs, encode globals over 200 binades.
Compile: the dispatch's tiles for sm_120 (and the convert instructions they use); sm_90's instruction count per
element as a regression bound.
"""

import itertools
import re

import pytest
import torch
import triton
import triton.language as tl

from vllm_nvfp4_sm120.dispatch.linear import act_quant_config
from vllm_nvfp4_sm120.format import GlobalScale, quantize_nvfp4, round_to_e2m1, swizzle_128x4, swizzled_shape
from vllm_nvfp4_sm120.format.e2m1 import E2M1_MAGNITUDES, pack_e2m1, unpack_e2m1
from vllm_nvfp4_sm120.kernels.act_quant import (
    ACT_QUANT_DIVISIBLE,
    ACT_QUANT_SIGNATURE,
    _e2m1_codes,
    _e2m1x8_pack_ptx,
    _e4m3_rne,
    has_native_e2m1,
    prepare_act_quant,
    quantize_act_nvfp4,
)
from vllm_nvfp4_sm120.kernels.sass_stats import main_path

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


@pytest.mark.parametrize("t,k", [(0, 64), (1, 16), (1, 256), (3, 48), (3, 64), (5, 80), (130, 48)])
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


def _run_probe(v: torch.Tensor, native: bool = False):
    n = v.numel()
    code = torch.empty(n, dtype=torch.int32, device=v.device)
    byte = torch.empty_like(code)
    val = torch.empty(n, dtype=torch.float32, device=v.device)
    _rounding_probe[(triton.cdiv(n, 1024),)](v, code, byte, val, n, NATIVE=native, BLOCK=1024)
    return code, byte, val


def _e2m1_ref(v: torch.Tensor) -> torch.Tensor:
    return round_to_e2m1(v.clamp(-6, 6)).to(torch.int32)


def test_e2m1_every_bf16_value():
    # Every bf16 bit pattern but the NaNs (the activations the kernel sees at block scale 1), both signs.
    v = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    v = v[~v.isnan()].to(_device())
    code, byte, val = _run_probe(v)
    torch.testing.assert_close(code.cpu(), _e2m1_ref(v.cpu()), rtol=0, atol=0)
    want = v.cpu().abs().clamp(max=448.0).to(torch.float8_e4m3fn)
    torch.testing.assert_close(byte.cpu(), want.view(torch.uint8).to(torch.int32), rtol=0, atol=0)


def test_e2m1_dense_around_the_grid():
    # Every fp32 value within 4096 ulps of each e2m1 value and midpoint (and of 6 * 2^k, the saturation edge
    # seen from other binades), both signs: the ties, their neighbours and the binade edges of the lines.
    grid = torch.tensor(E2M1_MAGNITUDES)
    pts = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([6.0 * 2.0**k for k in range(-3, 4)])])
    bits = pts.view(torch.int32)[:, None] + torch.arange(-4096, 4097, dtype=torch.int32)[None, :]
    v = bits[bits >= 0].view(torch.float32)
    v = torch.cat([v, -v, torch.tensor([float("inf"), float("-inf"), 1e-45, -1e-45])]).to(_device())
    code, _, _ = _run_probe(v)
    torch.testing.assert_close(code.cpu(), _e2m1_ref(v.cpu()), rtol=0, atol=0)


@triton.jit
def _pack_probe(v_ptr, out_ptr, N, BLOCK: tl.constexpr):
    # fp32 [N, 16] → the PTX packing's bytes [N, 8] (GPU only).
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    v = tl.load(v_ptr + offs[:, None] * 16 + tl.arange(0, 16)[None, :], mask=ok[:, None], other=0.0)
    lo, hi = tl.split(tl.reshape(v, (BLOCK, 8, 2)))
    tl.store(out_ptr + offs[:, None] * 8 + tl.arange(0, 8)[None, :], _e2m1x8_pack_ptx(lo, hi), mask=ok[:, None])


def _run_ptx(asm: str, args: list[torch.Tensor]) -> torch.Tensor:
    """A CPU model of the PTX subset the packing uses (mad.lo/add/and/or .u32/.b32, prmt.b32 default mode) on
    int64 tensors holding 32-bit values; ``args`` are $1.., the result is $0."""
    regs = {f"${i + 1}": a.to(torch.int64) & 0xFFFFFFFF for i, a in enumerate(args)}

    def val(tok):
        tok = tok.strip()
        return regs[tok] if tok in regs else int(tok, 0)

    for line in asm.replace("{", "").replace("}", "").split(";"):
        line = line.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        d, *src = [t.strip() for t in rest.split(",")]
        a = [val(t) for t in src]
        if op == "mad.lo.u32":
            r = a[0] * a[1] + a[2]
        elif op == "add.u32":
            r = a[0] + a[1]
        elif op == "and.b32":
            r = a[0] & a[1]
        elif op == "or.b32":
            r = a[0] | a[1]
        elif op == "prmt.b32":
            pool = [(a[0] >> (8 * i)) & 0xFF for i in range(4)] + [(a[1] >> (8 * i)) & 0xFF for i in range(4)]
            r = 0
            for k in range(4):
                sel = (a[2] >> (4 * k)) & 0xF
                byte = pool[sel & 7]
                if sel & 8:  # replicate the selected byte's sign bit
                    byte = torch.where(byte >= 128, 0xFF, 0) if torch.is_tensor(byte) else (0xFF if byte >= 128 else 0)
                r = r | (byte << (8 * k))
        else:
            raise AssertionError(f"unmodelled PTX instruction {op}")
        regs[d] = torch.as_tensor(r) & 0xFFFFFFFF
    return regs["$0"]


def test_ptx_packing_string_model(gen):
    # The packing's PTX text, run by a CPU model of its instructions, against the reference bytes: fp32 values at
    # the e2m1 grid, midpoints and their neighbours, random magnitudes, ±0, ±inf, signs in every position.
    from vllm_nvfp4_sm120.kernels.act_quant import _PACK_E2M1X8

    grid = torch.tensor(E2M1_MAGNITUDES + (7.0, 1e30, float("inf")))
    pts = torch.cat([grid, (grid[1:8] + grid[:7]) / 2])
    pts = torch.cat([pts, torch.nextafter(pts, torch.zeros(1)), torch.nextafter(pts, torch.full((1,), 1e38))])
    v = torch.cat([pts, torch.randn(4000, generator=gen) * 4, torch.tensor([0.0, 1e-45])])
    v = torch.cat([v, -v])[torch.randperm(2 * v.numel(), generator=gen)]
    v = v[: v.numel() // 8 * 8].view(-1, 4, 2)
    lo, hi = v[..., 0], v[..., 1]
    mags = [(torch.minimum(torch.minimum(a * 2 + 2.0**23, a + (2.0**23 + 2)), a * 0.5 + (2.0**23 + 4))).view(torch.int32)
            for a in (lo.abs().clamp(max=6.0), hi.abs().clamp(max=6.0))]
    words = _run_ptx(_PACK_E2M1X8.value, [*mags[0].unbind(1), *mags[1].unbind(1),
                                          *lo.view(torch.int32).unbind(1), *hi.view(torch.int32).unbind(1)])
    got = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=1).to(torch.uint8)
    torch.testing.assert_close(got, pack_e2m1(round_to_e2m1(v.reshape(-1, 8).clamp(-6, 6))), rtol=0, atol=0)


def _every_fp32_value(device, chunk: int = 1 << 26):
    """``(first bit pattern, values)`` over every fp32 bit pattern but the NaNs, in chunks of ``chunk`` patterns."""
    for start in range(0, 1 << 32, chunk):
        v = torch.arange(start, start + chunk, dtype=torch.int64, device=device).to(torch.int32).view(torch.float32)
        yield start, v[~v.isnan()]


@pytest.mark.gpu
def test_ptx_packing_every_fp32_value():
    # The packing the GPU build runs (Horner's rule on the magnitude words, permuted sign bytes) on every fp32
    # bit pattern but the NaNs, each value once in every nibble position of the word.
    for start, v in _every_fp32_value("cuda"):
        v = v[: v.numel() // 16 * 16]
        for shift in (0, 5):  # a second arrangement puts each value in another nibble
            blocks = torch.roll(v, shift).view(-1, 16).contiguous()
            out = torch.empty(blocks.shape[0], 8, dtype=torch.uint8, device="cuda")
            _pack_probe[(triton.cdiv(blocks.shape[0], 64),)](blocks, out, blocks.shape[0], BLOCK=64)
            want = pack_e2m1(round_to_e2m1(blocks.clamp(-6, 6)))
            assert torch.equal(out, want), f"chunk at {start:#x}, shift {shift}"


@pytest.mark.gpu
def test_e2m1_every_fp32_value_gpu():
    # The pure-Triton rounding helper (the interpreter's and the MoE epilogues' path) on every fp32 bit pattern.
    for start, v in _every_fp32_value("cuda"):
        code, _, _ = _run_probe(v)
        assert torch.equal(code, _e2m1_ref(v)), f"chunk at {start:#x}"


# ---------------------------------------------------------------------------------------------------------------
# Non-finite inputs: what the kernel does with them (the reference rejects them)


def _with_nonfinite(dtype, gen):
    x = _activations(4, 64, torch.float32, gen)
    x[0, 3], x[1, 17], x[2, 40] = float("inf"), float("-inf"), float("inf")
    x[3, 5], x[3, 21], x[2, 44] = float("nan"), -float("nan"), float("nan")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_infinities(dtype, gen):
    # An infinity makes its block's amax infinite: the scale saturates at 448 and the infinity becomes ±6, as
    # for the largest finite fp32 value in its place.
    x = _with_nonfinite(dtype, gen)
    x[x.isnan()] = 0.0
    gs = GlobalScale.from_encode(1.0)
    codes, scales = quantize_act_nvfp4(x.to(_device()), gs.enc.reshape(1).to(_device()),
                                       **act_quant_config(*x.shape, False))
    ref = quantize_nvfp4(x.float().nan_to_num(posinf=3.4e38, neginf=-3.4e38), gs)
    torch.testing.assert_close(codes.cpu(), ref.codes, rtol=0, atol=0)
    torch.testing.assert_close(scales.cpu().view(torch.uint8), ref.scales.view(torch.uint8), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_subnormal_activations(dtype, gen):
    # Blocks of bf16/fp16 subnormals, alone and next to normal values (the bf16 ones go through the packed bf16x2
    # amax on the GPU).
    tiny = torch.finfo(dtype).tiny
    x = (torch.randn(4, 64, generator=gen) * tiny * 0.4).to(dtype)
    x[0, :16] = tiny * 0.01
    x[1, 16:32] = -tiny * 0.999
    x[2, 5], x[3, 40] = 3.0, -1e-3
    for gs in (GlobalScale.from_encode(2.0**110), GlobalScale.from_encode(1.0), _enc(x)):
        _check(x.to(_device()), gs, swizzled=False)
    # An encode global of 2^126 gives the subnormal blocks non-zero scales; their reciprocal then overflows to inf,
    # and the kernel's codes for 0 * inf differ from the reference's (NaN), so only the scales are compared.
    gs = GlobalScale.from_encode(2.0**126)
    _, scales = quantize_act_nvfp4(x.to(_device()), gs.enc.reshape(1).to(_device()), **act_quant_config(4, 64))
    want = quantize_nvfp4(x, gs).scales.view(torch.uint8)
    assert want.any()
    torch.testing.assert_close(scales.cpu().view(torch.uint8), want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_nans_gpu(dtype, gen):
    # The block amax skips a NaN (maximum keeps the other operand); the NaN itself becomes +6 (code 7) whatever its
    # sign: the GPU's fp32 multiply returns the positive canonical NaN.  (The interpreter keeps NaN signs.)
    x = _with_nonfinite(dtype, gen)
    x[x.isinf()] = 0.0
    gs = GlobalScale.from_encode(1.0)
    for native in (True, False):
        codes, scales = quantize_act_nvfp4(x.cuda(), gs.enc.reshape(1).cuda(), native_e4m3=native,
                                           **act_quant_config(*x.shape, False))
        nan = x.isnan()
        ref = quantize_nvfp4(x.float().nan_to_num(nan=0.0), gs)
        want = unpack_e2m1(ref.codes)
        want[nan] = 7
        torch.testing.assert_close(unpack_e2m1(codes.cpu()), want, rtol=0, atol=0)
        torch.testing.assert_close(scales.cpu().view(torch.uint8), ref.scales.view(torch.uint8), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_encode_globals_over_200_binades_gpu(dtype):
    # Encode globals from 2^-100 to 2^100 times the data's own: all-zero, subnormal and saturated scales, block
    # reciprocals (rcp.rn on the GPU) over 200 binades.
    gen = torch.Generator().manual_seed(5)
    x = _activations(33, 512, dtype, gen, strided=True)
    for e in range(-100, 101, 10):
        _check(x.cuda(), _enc(x, 2.0**e), swizzled=e % 20 == 0)


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


@pytest.mark.parametrize("ready", [False, True])
def test_bf16_rows_off_4_byte_boundaries_are_copied_not_refused(ready):
    """bf16 rows are read as 32-bit pairs; a view with an odd row stride or an odd start is quantized from a
    contiguous copy, with the same result as the contiguous input (activations arrive as vLLM hands them over)."""
    gen = torch.Generator().manual_seed(3)
    buf = torch.randn(4 * 33 + 1, generator=gen).to(torch.bfloat16).to(_device())
    e = torch.ones(1, dtype=torch.float32, device=buf.device)
    for x in (buf[: 4 * 33].view(4, 33)[:, :32], buf[1:129].view(4, 32)):
        assert x.stride(0) % 2 or x.data_ptr() % 4
        got = prepare_act_quant(4, 32, x.device, **TILE)(x, e) if ready else quantize_act_nvfp4(x, e, **TILE)
        want = quantize_act_nvfp4(x.clone(memory_format=torch.contiguous_format), e, **TILE)
        torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
        torch.testing.assert_close(got[1].view(torch.uint8), want[1].view(torch.uint8), atol=0, rtol=0)
    # fp16 is read as 16-bit values: any row stride works as it is.
    x16 = torch.randn(4 * 33, generator=torch.Generator().manual_seed(2)).to(torch.float16).view(4, 33)[:, :32]
    _check(x16.to(_device()), _enc(x16), swizzled=False)


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
                 for t in (1, 16, 256, 2048) for k in (16, 48, 5120, 8192, 25600, 28672) for sw in (False, True)
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
    assert "sm_120a" in rep.ptx
    if tile[1] * tile[2] < 16 * 32 * tile[3]:
        return  # a small-K tile (K = 16, 48) has fewer scale blocks than threads: lanes replicate, loads are narrow
    assert len(re.findall(r"cvt\.rn\.satfinite\.e2m1x2\.f32", rep.ptx)) * 2 * 32 * tile[3] == tile[1] * tile[2]
    # 16-byte activation loads with the evict_last hint.
    rep.require_ptx(r"ld\.global\.L1::evict_last[.\w:]*\.v4\.b32").require_sass(r"LDG\.E\.EL\.128")


# The opcodes of the H200's half-rate pipe for compares, selects, min/max, logic, shifts and byte permutes: the
# quantizer's limit there.
_COMPARE_LOGIC = r"(LOP3|SHF|FMNMX|HMNMX2|PRMT|ISETP|FSETP|FSEL|SEL|IADD3|LEA|SGXT|P2R|R2P)(\..*)?"


def _per_element(rep, block_t, block_k, num_warps):
    """Static instructions per activation element on the kernel's main path (the slow-path subroutines of the
    reciprocal after the last EXIT excluded, their call stubs included): (all, compare/logic class)."""
    path = main_path(rep.sass)
    per_thread = block_t * block_k / (32 * num_warps)
    return path.total / per_thread, path.count(_COMPARE_LOGIC) / per_thread, path


@pytest.mark.compile
def test_arithmetic_e2m1_compiles_for_sm90():
    # What the H200 runs (its GPU tests check it bit-exact): the e2m1 rounding in fp32 arithmetic, the packing in
    # PTX (integer multiply-adds and byte permutes), no fp4 convert (sm_90 has none).  The hardware convert's
    # numerics await an sm_120 run (selftest's activation-quant check).
    from vllm_nvfp4_sm120.kernels.aot import compile_kernel

    rep = compile_kernel(KERNEL, ACT_QUANT_SIGNATURE,
                         dict(SWIZZLED=False, NATIVE_E4M3=True, NATIVE_E2M1=False, BLOCK_T=8, BLOCK_K=1024),
                         num_warps=4, divisible=ACT_QUANT_DIVISIBLE, arch=90)
    rep.require_no_local().require_ptx(r"cvt\.rn\.satfinite\.e4m3x2\.f32")
    assert not re.search(r"e2m1", rep.ptx)
    # One scale block per thread: no shuffle; the block amax as packed bf16 maxima (7 per block), the
    # reciprocal by rcp.rn, two 16-byte loads per block and one 8-byte store of its codes.
    assert not rep.has_sass(r"\bSHFL\b")
    blocks = 8 * 1024 // 16 // 128
    path = main_path(rep.sass)
    assert path.count(r"HMNMX2(\..*)?") == 7 * blocks, path.ops
    assert path.count(r"LDG\.E\.EL\.128") == 2 * blocks and path.count(r"STG\.E\.64") == blocks, path.ops
    rep.require_ptx(r"rcp\.rn\.f32").require_ptx(r"max\.xorsign\.abs\.bf16x2")
    # The scale bytes go straight from registers to memory (no staging through shared memory).
    assert not rep.has_sass(r"\bBAR\b") and not rep.has_sass(r"\bSTS\b"), "scale bytes staged in shared memory"
    # Regression bound on the instruction count: 19.6 per element (11.3 of the compare/logic class) before the
    # fp32-line rounding, the one-block-per-thread tile and the PTX packing; 14.5 (6.1) now.
    total, compare_logic, path = _per_element(rep, 8, 1024, 4)
    print(rep.summary(), f"{total:.2f} instructions per element, {compare_logic:.2f} compare/logic")
    assert total <= 14.8 and compare_logic <= 6.4, (total, compare_logic, path.by_class())


@pytest.mark.compile
def test_native_e2m1_instruction_count_sm120():
    # The large-T tile on sm_120 (hardware e2m1 and e4m3 converts): 11.3 per element before this layout, 7.0 now.
    from vllm_nvfp4_sm120.kernels.aot import compile_kernel

    rep = compile_kernel(KERNEL, ACT_QUANT_SIGNATURE,
                         dict(SWIZZLED=False, NATIVE_E4M3=True, NATIVE_E2M1=True, BLOCK_T=8, BLOCK_K=1024),
                         num_warps=4, divisible=ACT_QUANT_DIVISIBLE, arch=120)
    total, compare_logic, path = _per_element(rep, 8, 1024, 4)
    print(rep.summary(), f"{total:.2f} instructions per element, {compare_logic:.2f} compare/logic")
    assert total <= 7.2, (total, path.by_class())


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
    # The portable e2m1 path (fp32 lines, PTX packing) on every GPU, the hardware convert too where it exists.
    e2m1_paths = (False, True) if has_native_e2m1(xd.device) else (False,)
    for native, e2m1 in itertools.product((True, False), e2m1_paths):
        for swizzled in (False, True):
            codes, scales = quantize_act_nvfp4(xd, gs.enc.reshape(1).cuda(), swizzled=swizzled, native_e4m3=native,
                                               native_e2m1=e2m1, **act_quant_config(t, k, swizzled))
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
