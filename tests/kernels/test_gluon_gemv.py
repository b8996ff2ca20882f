"""Gluon gemv_fma / gemv_mma: decode tables, the k permutation, sm_120 compiles of every tile, and (GPU) numerics.

Gluon cannot run in the interpreter, so the CPU part proves what it can without running the kernels: the inline
PTX decode tables bit-exactly through a small PTX model, the gemv_mma index arithmetic (warp K slices, the k
permutation, tails) through a torch model of the kernel, and every tile through an sm_120 compile.  The GPU tests
(H200, Triton 3.8) run every tile against the dequant reference with the portable decode.
"""

from __future__ import annotations

import re

import pytest
import torch

from vllm_nvfp4_sm120.dispatch.linear import FMA_TILES, MMA_TILES, all_gemv_tiles, gluon_gemv_tile
from vllm_nvfp4_sm120.format import linear_w4a16_ref, make_linear, unit_values
from vllm_nvfp4_sm120.kernels import gluon_common as gc
from vllm_nvfp4_sm120.kernels import gluon_gemv as gg
from vllm_nvfp4_sm120.kernels.aot import compile_kernel

# ------------------------------------------------------------------------------------------------------------
# 1. The decode asm, bit-exact on all 256 bytes, through a model of the PTX it uses.
# ------------------------------------------------------------------------------------------------------------
E2M1_ABS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _half_bits(code: int, fmt: str) -> int:
    """16-bit pattern of e2m1 ``code`` in fp16 / bf16 (code 8 is -0.0)."""
    mag = torch.tensor(E2M1_ABS[code & 7], dtype=torch.float16 if fmt == "f16" else torch.bfloat16)
    return (int(mag.view(torch.int16)) & 0x7FFF) | ((code >> 3) << 15)


def _prmt(a: int, b: int, c: int) -> int:
    src = (b << 32) | a
    out = 0
    for i in range(4):
        sel = (c >> (4 * i)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:  # sign-replicate mode: the decode tables must never use it
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def run_ptx_model(asm: str, x: int) -> list[int]:
    """Run the subset of PTX the decode strings use on the 32-bit input ``$4``; returns ``$0..$3``."""
    regs: dict[str, int] = {"$4": x}
    body = asm.strip().removeprefix("{").removesuffix("}")
    for stmt in filter(None, (s.strip() for s in body.split(";"))):
        op, _, rest = stmt.partition(" ")
        if op == ".reg":
            continue
        if op == "mov.b32" and rest.startswith("{"):  # unpack a register into 4 bytes
            names, src = rest.split("},")
            for i, name in enumerate(n.strip() for n in names.strip("{ ").split(",")):
                regs[name] = (regs[src.strip()] >> (8 * i)) & 0xFF
            continue
        args = [a.strip() for a in rest.split(",")]
        val = [regs[a] if a in regs else int(a, 0) & 0xFFFFFFFF for a in args[1:]]
        if op == "and.b32":
            r = val[0] & val[1]
        elif op == "or.b32":
            r = val[0] | val[1]
        elif op == "shr.u32":
            r = val[0] >> val[1]
        elif op == "prmt.b32":
            r = _prmt(*val)
        elif op.startswith("cvt.rn.") and op.endswith(".e2m1x2"):  # PTX: high nibble -> high half
            fmt = op.split(".")[2].removesuffix("x2")
            r = _half_bits(val[0] & 15, fmt) | (_half_bits(val[0] >> 4, fmt) << 16)
        else:
            raise NotImplementedError(f"PTX model: {op}")
        regs[args[0]] = r & 0xFFFFFFFF
    return [regs[f"${i}"] for i in range(4)]


@pytest.mark.parametrize("key", sorted(gc.E2M1_ASM))
def test_decode_asm_is_exact_for_every_byte(key):
    _, fmt = key
    for v in range(256):
        word_bytes = [v, v ^ 0x5A, (v * 7 + 3) & 0xFF, 255 - v]  # a different byte in every position
        out = run_ptx_model(gc.E2M1_ASM[key], sum(b << (8 * i) for i, b in enumerate(word_bytes)))
        for i, byte in enumerate(word_bytes):
            want = _half_bits(byte & 15, fmt) | (_half_bits(byte >> 4, fmt) << 16)
            assert out[i] == want, f"{key}: byte {byte:#04x} in position {i}: got {out[i]:#010x}, want {want:#010x}"


def test_decode_asm_shape():
    assert gc.E2M1_ASM_CONSTRAINTS == "=r,=r,=r,=r,r"
    assert "cvt.rn.f16x2.e2m1x2" in gc.E2M1_ASM[("cvt", "f16")]
    assert "cvt.rn.bf16x2.e2m1x2" in gc.E2M1_ASM[("cvt", "bf16")]
    assert all("cvt" not in gc.E2M1_ASM[("portable", f)] for f in ("f16", "bf16"))


# ------------------------------------------------------------------------------------------------------------
# 2. gemv_mma's k permutation and index arithmetic, modelled in torch.
# ------------------------------------------------------------------------------------------------------------
def mma_perm(kp: torch.Tensor) -> torch.Tensor:
    """Memory k (within a 128-block) held at MMA operand index k' = 32c + 8t + j: 32t + 8c + j."""
    c, t, j = kp // 32, (kp // 8) % 4, kp % 8
    return 32 * t + 8 * c + j


def test_permutation_is_an_involution():
    k = torch.arange(128)
    assert torch.equal(torch.sort(mma_perm(k)).values, k)
    assert torch.equal(mma_perm(mma_perm(k)), k)


def test_permutation_lands_contiguous_loads_in_mma_fragments():
    # mma_v2 operand layout with k_width = 8 (Triton's ampereDotToLinearLayout): lane 4g + t holds, in register
    # order, k' = 8t + j (j = 0..7), then + 32, + 64, + 96.  Under the permutation these are memory
    # [32t, 32t + 32) in order: 16 code bytes (one 16-byte load) and 32 activations (64 bytes).
    for t in range(4):
        held = torch.tensor([32 * c + 8 * t + j for c in range(4) for j in range(8)])
        assert torch.equal(mma_perm(held), torch.arange(32 * t, 32 * t + 32))


def mma_kernel_model(x, codes, scales, dec_rows, warps: int, bias=None):
    """What _gemv_mma_kernel computes, step by step: warp w takes block i * warps + w; permuted dots; warp sum."""
    t, k = x.shape
    n = codes.shape[0]
    kb = 128
    iters = -(-k // (kb * warps))
    w_all = unit_values(codes, scales)  # exact e2m1 x e4m3, [N, K]
    part = torch.zeros(warps, n, t, dtype=torch.float64)
    kp = torch.arange(kb)
    for i in range(iters):
        for w in range(warps):
            k0 = (i * warps + w) * kb
            mem = k0 + mma_perm(kp)  # memory k of each operand index
            ok = mem < k  # the tail: masked loads give 0
            a = torch.where(ok, w_all[:, mem.clamp(max=k - 1)], 0.0).double()
            b = torch.where(ok, x.double()[:, mem.clamp(max=k - 1)], 0.0)
            part[w] += a @ b.t()
    y = part.sum(0).t() * dec_rows.double()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


@pytest.mark.parametrize("n,k", [(16, 128), (37, 1040), (5, 16), (24, 4096 + 48)])
@pytest.mark.parametrize("warps", [4, 8])
def test_mma_kernel_model_matches_reference(gen, n, k, warps):
    p = make_linear(n, k, gen=gen, logical_widths=[n - n // 3, n // 3] if n > 3 else None)
    x = torch.randn(5, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    got = mma_kernel_model(x, p.codes, p.scales, p.dec_rows, warps, bias)
    want = linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows, bias=bias)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# 3. Which tile serves which shape: tests/dispatch/test_linear_dispatch.py (the dispatch chooses it)
# ------------------------------------------------------------------------------------------------------------
SHAPES = [(10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600), (57344, 8192), (8192, 28672)]


# ------------------------------------------------------------------------------------------------------------
# 4. Launcher checks (no GPU needed: they fail or return before any launch)
# ------------------------------------------------------------------------------------------------------------
TILE = {gg.gemv_fma: FMA_TILES[0], gg.gemv_mma: MMA_TILES[0]}


@pytest.mark.parametrize("fn", [gg.gemv_fma, gg.gemv_mma])
def test_empty_batch_needs_no_launch(gen, fn):
    p = make_linear(8, 64, gen=gen)
    out = fn(torch.empty(0, 64, dtype=torch.bfloat16), p.codes, p.scales, p.dec_rows, tile=TILE[fn])
    assert out.shape == (0, 8) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("fn", [gg.gemv_fma, gg.gemv_mma])
def test_bad_input_names_the_tensor(gen, fn):
    p = make_linear(8, 64, gen=gen)
    x = torch.zeros(0, 64, dtype=torch.bfloat16)
    tile = TILE[fn]
    with pytest.raises(TypeError, match="x: expected dtype"):
        fn(x.float(), p.codes, p.scales, p.dec_rows, tile=tile)
    with pytest.raises(ValueError, match="w_scales: expected shape"):
        fn(x, p.codes, p.scales[:, :2], p.dec_rows, tile=tile)
    with pytest.raises(ValueError, match="w_codes: expected shape"):
        fn(torch.zeros(0, 128, dtype=torch.bfloat16), p.codes, p.scales, p.dec_rows, tile=tile)
    with pytest.raises(ValueError, match="multiple of 16"):
        fn(torch.zeros(0, 24, dtype=torch.bfloat16), p.codes[:, :12], p.scales[:, :1], p.dec_rows, tile=tile)
    with pytest.raises(TypeError, match="w_dec_rows: expected dtype"):
        fn(x, p.codes, p.scales, p.dec_rows.half(), tile=tile)
    with pytest.raises(ValueError, match="bias: expected shape"):
        fn(x, p.codes, p.scales, p.dec_rows, bias=torch.zeros(7, dtype=torch.bfloat16), tile=tile)


# ------------------------------------------------------------------------------------------------------------
# 5. sm_120 compiles: every tile, both kernels (one compile per distinct kernel configuration)
# ------------------------------------------------------------------------------------------------------------
FMA = "vllm_nvfp4_sm120.kernels.gluon_gemv:_gemv_fma_kernel"
MMA = "vllm_nvfp4_sm120.kernels.gluon_gemv:_gemv_mma_kernel"
SASS_E2M1 = {"f16": r"F2FP\.F16\.E2M1\.UNPACK_B", "bf16": r"F2FP\.BF16\.E2M1\.UNPACK_B"}
_compiled: dict = {}


def _compile(kind, tile, k=5120, dtype="bf16", arch=120, decode=gg.DECODE_CVT):
    key = (kind, tile, k, dtype, arch, decode)
    if key not in _compiled:
        sig = dict(gg.GEMV_FMA_SIGNATURE if kind == "fma" else gg.GEMV_MMA_SIGNATURE)
        for a in ("x_ptr", "bias_ptr", "out_ptr"):
            sig[a] = f"*{dtype}"
        consts = dict(K=k, HAS_BIAS=True, DECODE=decode, BLOCK_T=tile.block_t, WARPS=tile.num_warps)
        if kind == "fma":
            consts["ROWS_PER_WARP"] = tile.rows_per_warp
        _compiled[key] = compile_kernel(FMA if kind == "fma" else MMA, sig, consts, arch=arch,
                                        num_warps=tile.num_warps, divisible=gg.GEMV_FMA_DIVISIBLE, gluon=True)
    return _compiled[key]


def _count(pattern, text):
    return len(re.findall(pattern, text))


@pytest.mark.compile
@pytest.mark.parametrize("kind,tile", all_gemv_tiles(), ids=str)
def test_every_tile_compiles_for_sm120(kind, tile):
    rep = _compile(kind, tile)
    rep.require_no_local().require_smem()
    assert "sm_120a" in rep.ptx
    fmt = "f16" if kind == "fma" else "bf16"  # gemv_fma decodes to fp16 then fp32; gemv_mma to the MMA type
    rep.require_ptx(rf"cvt\.rn\.{fmt}x2\.e2m1x2").require_sass(SASS_E2M1[fmt])
    # One 16-byte load per 16 code bytes and lane: the K = 5120 loop reads every code byte exactly once.
    rows = tile.rows_per_warp if kind == "fma" else 2
    steps = 5 if kind == "fma" else 5120 // (128 * tile.num_warps)
    assert _count(r"LDG\.E\.128\b", rep.sass) == rows * steps, rep.summary()
    assert _count(r"LDG\.E\.EL\.128\b", rep.sass) > 0  # activations: 16-byte evict_last loads
    if kind == "fma":
        assert rep.shared_bytes == 0 and not rep.has_sass(r"\bHMMA\b")
    else:
        n_tiles = tile.block_t // 8
        assert _count(r"HMMA\.16816\.F32\.BF16", rep.sass) == steps * 8 * n_tiles
    print(rep.summary())


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["fma", "mma"])
def test_fp16_tail_and_portable_variants_compile(kind):
    tile = FMA_TILES[1] if kind == "fma" else MMA_TILES[2]
    f16 = _compile(kind, tile, dtype="fp16").require_no_local().require_smem()
    f16.require_ptx(r"cvt\.rn\.f16x2\.e2m1x2")
    if kind == "mma":
        f16.require_sass(r"HMMA\.16816\.F32\b(?!\.BF16)")
    tail = _compile(kind, tile, k=1040).require_no_local().require_smem()  # K % 1024 and K % 512 != 0
    assert tail.has_ptx(r"cvt\.rn\.\w+\.e2m1x2")
    # The H200 runs the same source with the portable table: no sm_100+ instruction may remain.
    sm90 = _compile(kind, tile, arch=90, decode=gg.DECODE_PORTABLE).require_no_local()
    assert not sm90.has_ptx("e2m1") and sm90.has_ptx(r"prmt\.b32")


# ------------------------------------------------------------------------------------------------------------
# 6. GPU: every tile against the dequant reference (H200: portable decode; sm_100+/sm_120: native cvt)
# ------------------------------------------------------------------------------------------------------------
SMALL = [(1, 16), (37, 1040), (200, 144), (24, 4096 + 48)]


def _run(kind, tile, x, p, bias=None, decode=None):
    fn = gg.gemv_fma if kind == "fma" else gg.gemv_mma
    return fn(x, p.codes, p.scales, p.dec_rows, bias=bias, tile=tile, decode=decode)


def _check(kind, tile, t, n, k, dtype, gen, strided=False, bias=False):
    dev = "cuda"
    p = make_linear(n, k, gen=gen, logical_widths=[n - n // 4, n // 4] if n >= 4 else None).to(dev)
    x = torch.randn(t, k + (64 if strided else 0), generator=gen).to(dtype).to(dev)[:, :k]
    b = torch.randn(n, generator=gen).to(dtype).to(dev) if bias else None
    got = _run(kind, tile, x, p, bias=b)
    want = linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows, bias=b)
    # The only difference is fp32 summation order (products are exact), then one rounding to bf16/fp16.
    torch.testing.assert_close(got, want, rtol=1.6e-2 if dtype == torch.bfloat16 else 2e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,tile", all_gemv_tiles(), ids=str)
@pytest.mark.parametrize("n,k", SMALL)
def test_gpu_every_tile_small_shapes(gen, kind, tile, n, k):
    for t in sorted({1, tile.block_t, tile.block_t + 1}):
        _check(kind, tile, t, n, k, torch.bfloat16, gen, strided=True, bias=True)


@pytest.mark.gpu
@pytest.mark.parametrize("kind,tile", all_gemv_tiles(), ids=str)
def test_gpu_every_tile_fp16_and_real_k(gen, kind, tile):
    _check(kind, tile, min(tile.block_t, 3), 272, 5120, torch.float16, gen, bias=True)


# K is a constexpr and the K loop unrolled: K = 25600 / 28672 compiles take ~30-70 s per tile, so those two
# shapes run two batch sizes (one per kernel) and the others five.
REAL_CASES = [(n, k, t) for n, k in SHAPES for t in ((1, 2, 5, 16, 32) if k <= 8192 else (1, 16))]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,t", REAL_CASES, ids=lambda v: str(v))
def test_gpu_real_shapes_with_the_configured_tile(gen, n, k, t):
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    kind, tile = gluon_gemv_tile(t, n, k, sm)
    _check(kind, tile, t, n, k, torch.bfloat16, gen, strided=(t == 5))


@pytest.mark.gpu
def test_gpu_empty_batch_and_dispatcher(gen):
    from vllm_nvfp4_sm120.dispatch.registry import gemv

    p = make_linear(64, 256, gen=gen).to("cuda")
    empty = torch.empty(0, 256, dtype=torch.bfloat16, device="cuda")
    assert gemv(empty, p.codes, p.scales, p.dec_rows).shape == (0, 64)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16).cuda()
    torch.testing.assert_close(gemv(x, p.codes, p.scales, p.dec_rows),
                               linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows), rtol=1.6e-2, atol=1e-4)
