"""Streaming W4A16 decode kernel (kernels/gluon_gemv_stream.py).

Gluon does not run in the interpreter, so the CPU part proves what it can without a GPU:
1. the fused decode + scale asm, bit-exactly for every code byte and a sweep of e4m3 scales, through a model of
   the PTX it uses (exact rational arithmetic, round-to-nearest-even);
2. the k relabelling (operand index of each memory element) against the kernel's own reshapes/permutes;
3. a torch model of the whole kernel (stream-K ranges and runs, clamped prefetches, zeroed surplus blocks, the
   partial slots, the counters and the last-arriver sum in CTA order) against the reference, for CTAs visited in
   several orders (the result must be bitwise the same);
4. every tile compiled for sm_120 (native cvt) and sm_90 (what the H200 runs), with the main loop's instruction
   mix asserted.
The GPU tests run every tile against the reference on odd and real shapes, and under CUDA-graph replay.
"""

from __future__ import annotations

import random
import re
import struct
from dataclasses import replace
from fractions import Fraction

import pytest
import torch
from test_gluon_gemv import _prmt
from test_moe_decode import load_benchmark

from vllm_nvfp4_sm120.format import linear_w4a16_ref, make_linear, unit_values
from vllm_nvfp4_sm120.kernels import gluon_gemv_stream as gs
from vllm_nvfp4_sm120.kernels.aot import compile_kernel
from vllm_nvfp4_sm120.kernels.sass_stats import main_loop

E2M1_MAG = [Fraction(v) for v in ("0", "1/2", "1", "3/2", "2", "3", "4", "6")]
FORMATS = {"bf16": (8, 7), "f16": (5, 10), "f32": (8, 23)}  # exponent bits, mantissa bits
DECODES = {"shift": gs.DECODE_SHIFT, "portable": gs.DECODE_PORTABLE, "cvt": gs.DECODE_CVT}


# ------------------------------------------------------------------------------------------------------------
# 1. Exact floats and a PTX model of the asm
# ------------------------------------------------------------------------------------------------------------
def float_of_bits(bits: int, fmt: str) -> tuple[int, Fraction]:
    """(sign, magnitude) of a bf16 / fp16 / fp32 bit pattern (finite only)."""
    e_bits, m_bits = FORMATS[fmt]
    width = 1 + e_bits + m_bits
    sign, e, m = bits >> (width - 1) & 1, bits >> m_bits & ((1 << e_bits) - 1), bits & ((1 << m_bits) - 1)
    assert e != (1 << e_bits) - 1, f"{fmt} {bits:#x} is not finite"
    bias = (1 << (e_bits - 1)) - 1
    mag = Fraction(m, 1 << m_bits) * Fraction(2) ** (1 - bias) if e == 0 else \
        (1 + Fraction(m, 1 << m_bits)) * Fraction(2) ** (e - bias)
    return sign, mag


def bits_of_float(sign: int, mag: Fraction, fmt: str) -> int:
    """Round-to-nearest-even encoding of sign * mag (no overflow allowed)."""
    e_bits, m_bits = FORMATS[fmt]
    width = 1 + e_bits + m_bits
    bias = (1 << (e_bits - 1)) - 1
    if mag == 0:
        return sign << (width - 1)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    if Fraction(2) ** e > mag:
        e -= 1
    e = max(e, 1 - bias)  # subnormals share the smallest exponent
    q = mag / Fraction(2) ** e * (1 << m_bits)
    n, rem = divmod(q.numerator, q.denominator)
    if 2 * rem > q.denominator or (2 * rem == q.denominator and n & 1):
        n += 1
    if n == 1 << (m_bits + 1):
        n, e = n >> 1, e + 1
    assert e + bias < (1 << e_bits) - 1, "overflow"
    field = 0 if n < (1 << m_bits) else e + bias
    return sign << (width - 1) | field << m_bits | (n & ((1 << m_bits) - 1))


def e4m3(byte: int) -> tuple[int, Fraction]:
    sign, e, m = byte >> 7, byte >> 3 & 15, byte & 7
    mag = Fraction(m, 8) * Fraction(2) ** -6 if e == 0 else (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7)
    return sign, mag


def run_ptx(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Run the PTX subset of the decode asm strings; ``inputs`` maps "$4", "$5", ... to 32-bit values."""
    regs = dict(inputs)
    for stmt in asm.split(";"):
        stmt = stmt.strip("{} \n")  # scope braces; a vector operand never ends a statement
        if not stmt or stmt.startswith(".reg"):
            continue
        op, _, rest = stmt.partition(" ")
        if op == "mov.b32" and rest.startswith("{"):  # unpack a register into 4 bytes or 2 halves
            names, src = rest.split("},")
            names = [n.strip() for n in names.strip("{ ").split(",")]
            width = 32 // len(names)
            for i, name in enumerate(names):
                regs[name] = (regs[src.strip()] >> (width * i)) & ((1 << width) - 1)
            continue
        if op == "mov.b32" and "{" in rest:  # pack two halves, the first in the low one
            dst, _, halves = rest.partition(",")
            lo, hi = (regs[n.strip()] for n in halves.strip("{} ").split(","))
            regs[dst.strip()] = (hi & 0xFFFF) << 16 | (lo & 0xFFFF)
            continue
        args = [a.strip() for a in rest.split(",")]
        val = [regs[a] if a in regs else int(a, 0) & 0xFFFFFFFF for a in args[1:]]
        fmt = op.split(".")[2].removesuffix("x2") if op.count(".") >= 2 else None
        if op == "mov.b32":
            r = val[0]
        elif op == "and.b32":
            r = val[0] & val[1]
        elif op == "or.b32":
            r = val[0] | val[1]
        elif op in ("shr.u32", "shr.b32"):
            r = val[0] >> val[1]
        elif op == "mul.lo.u32":
            r = val[0] * val[1]
        elif op == "mul.hi.u32":
            r = (val[0] * val[1]) >> 32
        elif op == "mad.lo.u32":
            r = val[0] * val[1] + val[2]
        elif op == "mad.hi.u32":
            r = ((val[0] * val[1]) >> 32) + val[2]
        elif op == "prmt.b32":
            r = _prmt(*val)
        elif op.startswith("cvt.rn.") and op.endswith(".e2m1x2"):  # high nibble -> high half
            r = 0
            for half, code in enumerate((val[0] & 15, val[0] >> 4)):
                r |= bits_of_float(code >> 3, E2M1_MAG[code & 7], fmt) << (16 * half)
        elif op.startswith("cvt.rn.") and op.endswith(".e4m3x2"):  # low byte -> low half
            r = 0
            for half in range(2):
                r |= bits_of_float(*e4m3(val[0] >> (8 * half) & 0xFF), fmt) << (16 * half)
        elif op.startswith("mul.rn."):  # per half, the exact product rounded once
            r = 0
            for half in range(2):
                (sa, ma), (sb, mb) = (float_of_bits(v >> (16 * half) & 0xFFFF, fmt) for v in val)
                r |= bits_of_float(sa ^ sb, ma * mb, fmt) << (16 * half)
        elif op.startswith("cvt.rn.") and op.endswith(".f32"):  # d = {cvt(a) high, cvt(b) low}
            hi, lo = (bits_of_float(*float_of_bits(v, "f32"), fmt) for v in val[:2])
            r = hi << 16 | lo
        elif op.startswith("fma.rn."):
            r = 0
            for half in range(2):
                a, b, c = (float_of_bits(v >> (16 * half) & 0xFFFF, fmt) for v in val)
                sa, ma = a
                sb, mb = b
                assert c == (1, 0), "the asm adds -0.0"
                r |= bits_of_float(sa ^ sb, ma * mb, fmt) << (16 * half)
        else:
            raise NotImplementedError(f"PTX model: {op}")
        regs[args[0]] = r & 0xFFFFFFFF
    return regs


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


# Scales: every e4m3 subnormal, the smallest normals, around 1, the largest, and a few negatives.
SCALE_BYTES = [0x01, 0x02, 0x05, 0x07, 0x08, 0x09, 0x17, 0x30, 0x38, 0x3F, 0x51, 0x66, 0x77, 0x7E, 0x81, 0xB8, 0xFE]


def expected_pair(code_lo: int, code_hi: int, scale: int, fmt: str, factor: Fraction) -> int:
    ss, sm = e4m3(scale)
    lo = bits_of_float((code_lo >> 3) ^ ss, E2M1_MAG[code_lo & 7] * sm * factor, fmt)
    hi = bits_of_float((code_hi >> 3) ^ ss, E2M1_MAG[code_hi & 7] * sm * factor, fmt)
    return hi << 16 | lo


@pytest.mark.parametrize("kind,fmt", sorted(gs.SCALED_E2M1_ASM))
def test_scaled_decode_asm_is_exact(kind, fmt):
    """The four outputs of one code word are the MMA operand pairs, scaled, bit for bit."""
    rng = random.Random(0)
    asm = gs.SCALED_E2M1_ASM[(kind, fmt)]
    pair_asm = gs.SCALE_PAIR_ASM[fmt]
    factor = Fraction(1, 2 ** gs.SHIFT_EXP) if kind == "shift" else Fraction(1)
    multiplier = gs.SHIFT_SCALE[fmt] if kind == "shift" else 1.0
    for v in range(256):
        word_bytes = [v, v ^ 0x5A, (v * 7 + 3) & 0xFF, 255 - v]  # every byte value in every position
        word = sum(b << (8 * i) for i, b in enumerate(word_bytes))
        nib = [(word >> (4 * i)) & 15 for i in range(8)]
        for scale in rng.sample(SCALE_BYTES, 4) if v % 8 else SCALE_BYTES:
            sign, mag = e4m3(scale)
            s_f32 = float(mag) * (-1 if sign else 1) * multiplier  # exact: a power-of-two multiple
            s_pair = run_ptx(pair_asm, {"$1": f32_bits(s_f32)})["$0"]
            out = run_ptx(asm, {"$4": word, "$5": s_pair})
            for j in range(4):
                lo, hi = (nib[j], nib[j + 4]) if kind == "shift" else (nib[2 * j], nib[2 * j + 1])
                want = expected_pair(lo, hi, scale, fmt, factor)
                assert out[f"${j}"] == want, (
                    f"{kind}/{fmt}: word {word:#010x} scale {scale:#04x} output {j}: got {out[f'${j}']:#010x}, "
                    f"want {want:#010x}")


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_e4m3_scale_pairs_equal_the_fp32_path(fmt):
    # DECODE_CVT's scale pairs (two scale bytes -> two (s, s) pairs by one e4m3 convert) are bit for bit the pairs
    # of the fp32 path (SCALE_PAIR_ASM, which test_scaled_decode_asm_is_exact feeds to every decode), for every finite
    # e4m3 byte in both positions.
    finite = [b for b in range(256) if b & 0x7F != 0x7F]
    for a, b in zip(finite, finite[1:] + finite[:1]):
        out = run_ptx(gs.SCALE_PAIRS_E4M3_ASM[fmt], {"$2": b << 8 | a})
        for reg, byte in (("$0", a), ("$1", b)):
            sign, mag = e4m3(byte)
            want = run_ptx(gs.SCALE_PAIR_ASM[fmt], {"$1": f32_bits(float(mag) * (-1 if sign else 1))})["$0"]
            assert out[reg] == want, f"{fmt}: scale {byte:#04x}: {out[reg]:#010x}, want {want:#010x}"


def test_shift_scale_is_exact_and_in_range():
    for fmt in ("bf16", "f16"):
        for byte in range(1, 0x7F):
            _, mag = e4m3(byte)
            scaled = mag * Fraction(gs.SHIFT_SCALE[fmt])
            assert float_of_bits(bits_of_float(0, scaled, fmt), fmt) == (0, scaled)  # fits the 16-bit format


def test_asm_strings_use_the_intended_instructions():
    assert gs.SCALED_E2M1_CONSTRAINTS == "=r,=r,=r,=r,r,r"
    assert all("fma.rn.bf16x2" in gs.SCALED_E2M1_ASM[(k, "bf16")] for k in ("shift", "portable", "cvt"))
    assert "cvt.rn.bf16x2.e2m1x2" in gs.SCALED_E2M1_ASM[("cvt", "bf16")]
    for fmt in ("bf16", "f16"):
        shift = gs.SCALED_E2M1_ASM[("shift", fmt)]
        assert "prmt" not in shift and "e2m1" not in shift and "shr" not in shift
        assert "e2m1" not in gs.SCALED_E2M1_ASM[("portable", fmt)]


# ------------------------------------------------------------------------------------------------------------
# 2. A torch model of one step, written with the kernel's own reshapes/permutes
# ------------------------------------------------------------------------------------------------------------
def decode_values(words: torch.Tensor, scale: torch.Tensor, decode: int) -> torch.Tensor:
    """[..., words] int64 code words and [...] scale values -> [..., words, 4 outputs, 2 halves] float64, the
    values the asm returns (proven bit-exact above; the shift decode's include its 2^-SHIFT_EXP)."""
    nib = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=-1)
    mag = torch.tensor([float(v) for v in E2M1_MAG], dtype=torch.float64)[nib & 7]
    vals = torch.where(nib >= 8, -mag, mag) * scale[..., None]
    if decode == gs.DECODE_SHIFT:
        vals = vals * 2.0 ** -gs.SHIFT_EXP
        return torch.stack([vals[..., :4], vals[..., 4:]], dim=-1)  # output j = (element j, element j + 4)
    return vals.reshape(*vals.shape[:-1], 4, 2)  # output j = the two nibbles of byte j


def step_model(words, sc, x, decode):
    """What _step_mma adds to acc: words [W, BMW, 16] int64, scales [W, BMW, 8] uint8, x [W, BT, 128] float64."""
    w, bmw = words.shape[:2]
    scale = sc.view(torch.float8_e4m3fn).double()[..., None].expand(w, bmw, 8, 2)
    o = decode_values(words.reshape(w, bmw, 8, 2), scale, decode)  # [W, BMW, 8, 2, j, half]
    halves = [o[..., j, :] for j in range(4)]  # _halves(o_j): [..., 2]
    e = torch.stack([torch.stack(halves[:2], -1), torch.stack(halves[2:], -1)], -1)  # the two joins
    e = e.permute(gs.PAIR_ORDER).reshape(w, bmw, 128)
    a = e.reshape(w, bmw, 4, 4, 8).permute(gs.BLOCK_ORDER).reshape(w, bmw, 128)
    bt = x.shape[1]
    if decode == gs.DECODE_SHIFT:
        xv = x.reshape(w, bt, 4, 4, 2, 4).permute(gs.X_SHIFT_ORDER).reshape(w, bt, 128)
    else:
        xv = x.reshape(w, bt, 4, 4, 8).permute(gs.BLOCK_ORDER).reshape(w, bt, 128)
    return torch.einsum("wmk,wtk->wmt", a, xv)


def memory_order_step(words, sc, x):
    """The same step computed plainly: decode every element in memory order and take the dot products."""
    w, bmw = words.shape[:2]
    scale = sc.view(torch.float8_e4m3fn).double().repeat_interleave(2, dim=-1)  # one per word
    vals = decode_values(words, scale, gs.DECODE_CVT)  # byte pairs = memory order
    return torch.einsum("wmk,wtk->wmt", vals.reshape(w, bmw, 128), x)


@pytest.mark.parametrize("decode", DECODES.values())
def test_step_model_pairs_every_weight_with_its_activation(decode):
    """The kernel's reshapes relabel k identically on both operands, so the step is the plain dot product."""
    g = torch.Generator().manual_seed(0)
    words = torch.randint(0, 2**32, (4, 16, 16), generator=g, dtype=torch.int64)
    sc = torch.randint(1, 0x7F, (4, 16, 8), generator=g, dtype=torch.int64).to(torch.uint8)
    x = torch.randn(4, 8, 128, generator=g, dtype=torch.float64)
    factor = 2.0 ** -gs.SHIFT_EXP if decode == gs.DECODE_SHIFT else 1.0
    want = memory_order_step(words, sc, x) * factor
    assert torch.allclose(step_model(words, sc, x, decode), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("decode", DECODES.values())
def test_operand_index_of_each_memory_element(decode):
    """operand_k_of_memory_k (the documented map) is where the kernel's reshapes put each decoded element."""
    ks = [gs.operand_k_of_memory_k(m, decode) for m in range(128)]
    assert sorted(ks) == list(range(128))
    for m in range(128):
        words = torch.zeros(1, 1, 16, dtype=torch.int64)
        words[0, 0, m // 8] = 2 << (4 * (m % 8))  # code 2 = 1.0 at memory element m
        scale = torch.ones(1, 1, 8, 2, dtype=torch.float64)
        o = decode_values(words.reshape(1, 1, 8, 2), scale, decode)
        halves = [o[..., j, :] for j in range(4)]
        e = torch.stack([torch.stack(halves[:2], -1), torch.stack(halves[2:], -1)], -1)
        a = e.permute(gs.PAIR_ORDER).reshape(1, 1, 4, 4, 8).permute(gs.BLOCK_ORDER).reshape(128)
        assert a.nonzero().flatten().tolist() == [ks[m]]


def test_lane_loads_land_in_its_operand_fragment():
    """mma_v2 k_width = 8: lane 4g + t holds operand indices 32c + 8t + jj; those must be its loaded memory
    [32t, 32t + 32) (one 16-byte code load, two 16-byte scale-group halves, 64 bytes of activations)."""
    for decode in DECODES.values():
        for t in range(4):
            held = {32 * c + 8 * t + jj for c in range(4) for jj in range(8)}
            assert {gs.operand_k_of_memory_k(m, decode) for m in range(32 * t, 32 * t + 32)} == held
            # every register pair (jj even, jj + 1) holds one decode output: the same code word
            for c in range(4):
                for jj in range(0, 8, 2):
                    ms = [m for m in range(128) if gs.operand_k_of_memory_k(m, decode) in (32 * c + 8 * t + jj,
                                                                                          32 * c + 8 * t + jj + 1)]
                    assert ms[0] // 8 == ms[1] // 8


# ------------------------------------------------------------------------------------------------------------
# 3. A torch model of the kernel: stream-K, runs, steps, partials, counters
# ------------------------------------------------------------------------------------------------------------
def stream_kernel_model(x, codes, scales, dec_rows, tile: gs.StreamTile, ctas: int, decode: int, bias=None,
                        cta_order=None, trace=None):
    t, k = x.shape
    n = codes.shape[0]
    grid = gs.stream_grid(t, n, k, tile, ctas)
    nb, ctas, bm, bt = grid.blocks_per_row, grid.ctas, tile.block_m, tile.block_t
    kw, rw = tile.k_warps, tile.row_warps
    bmw = bm // rw
    # Loads past K return zeros (the EVEN_K = False masks): pad every row to whole blocks.
    words = torch.zeros(n, nb * 16, dtype=torch.int64)
    words[:, : k // 8] = codes.contiguous().view(torch.int32).long() & 0xFFFFFFFF
    sc = torch.zeros(n, nb * 8, dtype=torch.uint8)
    sc[:, : k // 16] = scales.view(torch.uint8)
    xs = torch.zeros(t, nb * 128, dtype=torch.float64)
    xs[:, :k] = x.double()
    partials, counters = {}, torch.zeros(grid.tiles_t * grid.tiles_m, dtype=torch.int64)
    out = torch.full((t, n), float("nan"), dtype=torch.float64)
    order = list(range(ctas)) if cta_order is None else cta_order
    for pid_t in range(grid.tiles_t):
        toks = [min(pid_t * bt + j, t - 1) for j in range(bt)]
        for pid in order:
            b_begin, b_end = pid * grid.total_blocks // ctas, (pid + 1) * grid.total_blocks // ctas
            first_tile, b = b_begin // nb, b_begin
            while b < b_end:
                tile_m = b // nb
                run_end = min(b_end, (tile_m + 1) * nb)
                kb0, kb_last = b - tile_m * nb, run_end - tile_m * nb - 1
                last = -(-(run_end - b) // kw) - 1
                acc = torch.zeros(tile.num_warps, bmw, bt, dtype=torch.float64)
                for i in range(last + 1):
                    wv, sv, xv = [], [], []
                    for warp in range(tile.num_warps):
                        kb = kb0 + i * kw + warp // rw
                        rows = [min(tile_m * bm + (warp % rw) * bmw + r, n - 1) for r in range(bmw)]
                        kbc = min(kb, kb_last)
                        ww = words[rows, kbc * 16:(kbc + 1) * 16]
                        if i == last and kb > kb_last:
                            ww = torch.zeros_like(ww)
                        wv.append(ww)
                        sv.append(sc[rows, kbc * 8:(kbc + 1) * 8])
                        xv.append(xs[toks, kbc * 128:(kbc + 1) * 128])
                        if trace is not None:
                            trace.append((pid_t, tile_m, kb, warp, i == last and kb > kb_last))
                    acc += step_model(torch.stack(wv), torch.stack(sv), torch.stack(xv), decode)
                y = acc.reshape(kw, bm, bt).sum(0).float()  # fp32 partial, as the kernel stores it
                p_first = ((tile_m * nb + 1) * ctas - 1) // grid.total_blocks
                p_last = (((tile_m + 1) * nb) * ctas - 1) // grid.total_blocks
                done = p_first == p_last
                if not done:
                    slot = (pid_t * ctas + pid) * grid.slots_per_cta + (tile_m - first_tile)
                    assert 0 <= tile_m - first_tile < grid.slots_per_cta and slot not in partials
                    partials[slot] = y
                    cnt = pid_t * grid.tiles_m + tile_m
                    arrived = int(counters[cnt])
                    counters[cnt] += 1
                    done = arrived == p_last - p_first
                    if done:
                        y = torch.zeros(bm, bt, dtype=torch.float32)
                        for p in range(p_first, p_last + 1):
                            p_first_tile = (p * grid.total_blocks // ctas) // nb
                            y = y + partials[(pid_t * ctas + p) * grid.slots_per_cta + (tile_m - p_first_tile)]
                        counters[cnt] = 0
                if done:
                    if decode == gs.DECODE_SHIFT:
                        y = y * 2.0 ** gs.SHIFT_EXP
                    rows_o = torch.arange(tile_m * bm, tile_m * bm + bm)
                    ok = rows_o < n
                    yy = y.double()[ok] * dec_rows.double()[rows_o[ok], None]
                    if bias is not None:
                        yy = yy + bias.double()[rows_o[ok], None]
                    for j in range(bt):
                        if pid_t * bt + j < t:
                            out[pid_t * bt + j, rows_o[ok]] = yy[:, j]
                b = run_end
    assert int(counters.abs().sum()) == 0, "every counter is back at zero"
    return out.to(x.dtype)


MODEL_TILES = [gs.StreamTile(32, 8), gs.StreamTile(64, 16, 4, 2), gs.StreamTile(32, 8, 2, 1),
               gs.StreamTile(64, 8, 8, 4)]


@pytest.mark.parametrize("tile", MODEL_TILES, ids=str)
@pytest.mark.parametrize("n,k,ctas", [(37, 1040, 5), (16, 128, 3), (100, 2048, 7), (24, 4096 + 48, 11), (5, 256, 64)])
@pytest.mark.parametrize("decode", [gs.DECODE_SHIFT, gs.DECODE_CVT])
def test_stream_kernel_model_matches_reference(gen, tile, n, k, ctas, decode):
    p = make_linear(n, k, gen=gen, logical_widths=[n - n // 3, n // 3] if n > 3 else None)
    t = tile.block_t + 3  # two token tiles, the second partial
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    got = stream_kernel_model(x, p.codes, p.scales, p.dec_rows, tile, ctas, decode, bias=bias)
    want = linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows, bias=bias)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-5)


def test_stream_kernel_model_is_deterministic_in_arrival_order(gen):
    p = make_linear(40, 3072, gen=gen)
    x = torch.randn(3, 3072, generator=gen).to(torch.bfloat16)
    tile, ctas = gs.StreamTile(32, 8), 9
    runs = []
    for seed in range(3):
        order = list(range(ctas))
        random.Random(seed).shuffle(order)
        runs.append(stream_kernel_model(x, p.codes, p.scales, p.dec_rows, tile, ctas, gs.DECODE_SHIFT,
                                        cta_order=order))
    assert all(torch.equal(runs[0], r) for r in runs[1:])


@pytest.mark.parametrize("n,k,tile,ctas", [(37, 1040, gs.StreamTile(32, 8), 5), (200, 4096, gs.StreamTile(64, 8), 13),
                                           (130, 640, gs.StreamTile(128, 16, 4, 2), 400)])
def test_stream_k_covers_every_block_once(n, k, tile, ctas):
    """Every (token tile, row tile, block, row warp) is one warp-step; the surplus warp-steps are the zeroed ones."""
    t = 2 * tile.block_t
    trace = []
    p = make_linear(n, k, gen=torch.Generator().manual_seed(0))
    stream_kernel_model(torch.zeros(t, k, dtype=torch.bfloat16), p.codes, p.scales, p.dec_rows, tile, ctas,
                        gs.DECODE_SHIFT, trace=trace)
    grid = gs.stream_grid(t, n, k, tile, ctas)
    used = sorted((pt, tm, kb, warp % tile.row_warps) for pt, tm, kb, warp, zeroed in trace if not zeroed)
    assert used == [(pt, tm, kb, rw) for pt in range(grid.tiles_t) for tm in range(grid.tiles_m)
                    for kb in range(grid.blocks_per_row) for rw in range(tile.row_warps)]


def test_stream_grid_and_ranges():
    tile = gs.StreamTile(64, 8)
    g = gs.stream_grid(5, 5120, 8192, tile, 396)
    assert (g.tiles_m, g.tiles_t, g.blocks_per_row, g.ctas) == (80, 1, 64, 396)
    # ranges differ by at most one block
    sizes = {(p + 1) * g.total_blocks // g.ctas - p * g.total_blocks // g.ctas for p in range(g.ctas)}
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert gs.stream_grid(1, 16, 128, tile, 1000).ctas == 1  # never more CTAs than blocks
    assert gs.stream_grid(17, 16, 128, gs.StreamTile(32, 16), 4).tiles_t == 2
    with pytest.raises(ValueError, match="StreamTile"):
        gs.StreamTile(48, 8)
    with pytest.raises(ValueError, match="StreamTile"):
        gs.StreamTile(64, 12)


@pytest.mark.parametrize("max_regs", [60, 100, 256])
def test_register_cap_validation(max_regs):
    with pytest.raises(ValueError, match="max_regs"):
        gs.StreamTile(32, 8, max_regs=max_regs)


def test_register_cap_is_a_launch_option_and_a_plan_parameter_only_where_set():
    capped, plain = gs.StreamTile(32, 8, max_regs=128), gs.StreamTile(32, 8)
    assert capped.launch_options == {"num_warps": 4, "maxnreg": 128}
    assert plain.launch_options == {"num_warps": 4}
    assert "max_regs" not in plain.params() and capped.params()["max_regs"] == 128
    for tile in gs.STREAM_TILES:  # the parameters rebuild the tile
        assert gs.StreamTile(**tile.params()) == tile


def test_overlap_runs_is_a_compile_time_argument_and_a_plan_parameter_only_where_set():
    plain = gs.StreamTile(32, 8, max_regs=128)
    ov = replace(plain, overlap_runs=True)
    assert "overlap_runs" not in plain.params() and ov.params()["overlap_runs"] is True
    assert gs.StreamTile(**ov.params()) == ov
    assert plain.constexprs["OVERLAP_RUNS"] is False and ov.constexprs["OVERLAP_RUNS"] is True
    assert ov.launch_options == plain.launch_options


def test_prefetch_is_a_compile_time_argument_and_a_plan_parameter_only_where_deep():
    plain = gs.StreamTile(32, 8, max_regs=168)
    deep = replace(plain, prefetch=2)
    assert "prefetch" not in plain.params() and deep.params()["prefetch"] == 2
    assert gs.StreamTile(**deep.params()) == deep
    assert plain.constexprs["PREFETCH"] == 1 and deep.constexprs["PREFETCH"] == 2
    with pytest.raises(ValueError, match="prefetch"):
        gs.StreamTile(32, 8, prefetch=3)
    with pytest.raises(ValueError, match="prefetch"):  # the overlapped runs hand the loop one loaded step only
        gs.StreamTile(32, 8, overlap_runs=True, prefetch=2)


# ------------------------------------------------------------------------------------------------------------
# 4. Launcher checks (no launch on CPU: they fail or return before it)
# ------------------------------------------------------------------------------------------------------------
def test_launcher_checks(gen):
    p = make_linear(8, 64, gen=gen)
    tile = gs.STREAM_TILES[0]
    out = gs.gemv_stream(torch.empty(0, 64, dtype=torch.bfloat16), p.codes, p.scales, p.dec_rows, tile=tile, ctas=4)
    assert out.shape == (0, 8) and out.dtype == torch.bfloat16
    x = torch.zeros(0, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="x: expected dtype"):
        gs.gemv_stream(x.float(), p.codes, p.scales, p.dec_rows, tile=tile, ctas=4)
    with pytest.raises(ValueError, match="w_scales: expected shape"):
        gs.gemv_stream(x, p.codes, p.scales[:, :2], p.dec_rows, tile=tile, ctas=4)
    with pytest.raises(TypeError, match="bias: expected dtype"):
        gs.gemv_stream(x, p.codes, p.scales, p.dec_rows, tile=tile, ctas=4, bias=torch.zeros(8))
    wide = torch.zeros(8, 40, dtype=torch.uint8)[:, :32]  # row stride 40 bytes: fine; 34 is not a word multiple
    gs.gemv_stream(x, wide, p.scales, p.dec_rows, tile=tile, ctas=4)
    with pytest.raises(ValueError, match="multiple of 4"):
        gs.gemv_stream(x, torch.zeros(8, 34, dtype=torch.uint8)[:, :32], p.scales, p.dec_rows, tile=tile, ctas=4)


def test_workspace_checks():
    tile = gs.StreamTile(64, 8)
    grid = gs.stream_grid(3, 5120, 5120, tile, 100)
    ws = gs.StreamWorkspace.for_grid(grid, tile, "cpu")
    ws.check(grid, tile, torch.device("cpu"))
    assert int(ws.counters.abs().sum()) == 0
    small = gs.StreamWorkspace(ws.partials[:10], ws.counters)
    with pytest.raises(ValueError, match="workspace.partials"):
        small.check(grid, tile, torch.device("cpu"))
    with pytest.raises(TypeError, match="workspace.counters"):
        gs.StreamWorkspace(ws.partials, ws.counters.float()).check(grid, tile, torch.device("cpu"))


# ------------------------------------------------------------------------------------------------------------
# 5. Compiles: sm_120 (native cvt) and sm_90 (shift decode, what the H200 runs)
# ------------------------------------------------------------------------------------------------------------
KERNEL = "vllm_nvfp4_sm120.kernels.gluon_gemv_stream:_stream_kernel"
_compiled: dict = {}


def compile_stream(tile, arch=120, decode=gs.DECODE_CVT, dtype="bf16", even_k=True):
    key = (tile, arch, decode, dtype, even_k)
    if key not in _compiled:
        sig = dict(gs.STREAM_SIGNATURE)
        for a in ("x_ptr", "bias_ptr", "out_ptr"):
            sig[a] = f"*{dtype}"
        consts = dict(HAS_BIAS=True, DECODE=decode, EVEN_K=even_k, **tile.constexprs)
        _compiled[key] = compile_kernel(KERNEL, sig, consts, arch=arch, num_warps=tile.num_warps,
                                        divisible=gs.STREAM_DIVISIBLE, gluon=True, maxnreg=tile.max_regs)
    return _compiled[key]


def words_per_iteration(tile) -> int:
    """Code words one lane decodes per main-loop iteration: (prefetch + 1) steps (the loop is unrolled by its number
    of register buffers) x (rows per lane) x 4 words."""
    return (tile.prefetch + 1) * (tile.block_m // tile.row_warps // 8) * 4


@pytest.mark.compile
@pytest.mark.parametrize("tile", gs.STREAM_TILES, ids=str)
def test_every_tile_compiles_for_sm120(tile):
    rep = compile_stream(tile).require_no_local().require_smem()
    assert "sm_120a" in rep.ptx
    rep.require_ptx(r"cvt\.rn\.bf16x2\.e2m1x2").require_sass(r"F2FP\.BF16\.E2M1\.UNPACK_B")
    rep.require_sass(r"HMMA\.16816\.F32\.BF16").require_ptx(r"atom\.global\.gpu\.acq_rel\.add")
    loop = main_loop(rep.sass)
    words = words_per_iteration(tile)
    # One 16-byte load per row and step, the codes decoded by one cvt per byte: 4 F2FP per word; a lane's two scales
    # of a row (4 words) by one e4m3 convert, and no fp16 -> fp32 scale chain (HADD2.F32) left.
    assert loop.count(r"LDG\.E\.128") == words // 4, loop.ops
    assert loop.count(r"F2FP\.BF16\.E2M1\.UNPACK_B") == 4 * words, loop.ops
    assert 4 * loop.count(r"F2FP\.BF16\.E4M3\.UNPACK_B") == words, loop.ops
    assert loop.count(r"HADD2.*") == 0 and loop.count(r"F2FP\..*") == 4 * words + words // 4, loop.ops
    rep.require_ptx(r"cvt\.rn\.bf16x2\.e4m3x2")
    _check_occupancy_data(rep, tile, 12)
    print(rep.summary(), f"main loop {loop.total / words:.1f} instructions per code word")


def _check_occupancy_data(rep, tile, cc_major):
    """The dispatch plan sizes its one-wave grid from recorded register counts: they must give the occupancy the
    compiled kernel has."""
    from vllm_nvfp4_sm120.dispatch.gemv_stream_plan import TILE_REGISTERS, ctas_per_sm

    assert ctas_per_sm(rep.registers, tile.num_warps) == ctas_per_sm(TILE_REGISTERS[cc_major][tile], tile.num_warps), (
        f"{tile} sm_{rep.arch}: {rep.registers} registers now; update TILE_REGISTERS")


@pytest.mark.compile
@pytest.mark.parametrize("tile", gs.STREAM_TILES, ids=str)
def test_every_tile_compiles_for_sm90_with_the_shift_decode(tile):
    rep = compile_stream(tile, arch=90, decode=gs.DECODE_SHIFT).require_no_local()
    assert not rep.has_ptx("e2m1")
    loop = main_loop(rep.sass)
    words = words_per_iteration(tile)
    # The shift decode per word: 4 + 4 masks, 4 + 1 multiplies, 4 scale fma; nothing else scales with the words
    # but the activation repack (one PRMT per activation register) and the MMAs (a few LOP3 do addressing).
    assert 8 * words <= loop.count(r"LOP3\.LUT") <= 8 * words + 16, loop.ops
    assert loop.count(r"HMUL2\.BF16_V2") == 4 * words, loop.ops
    assert loop.count(r"LDG\.E\.128") == words // 4 and loop.count(r"LDG\.E\.U8") == 0, loop.ops
    assert loop.count(r"IMAD\.HI\.U32") == words, loop.ops  # the byte move of nibbles 2, 3, 6, 7
    # 4 + 1 multiplies per word, plus the per-row address of each load (an IMAD per row and step)
    assert 5 * words <= loop.count(r"IMAD(\.HI)?(\.U32)?") <= 6 * words + 8, loop.ops
    # All the rest (scales, activations, addresses, MMAs) stays below ~8 per word on every tile (23.7 for the
    # 8-token tiles, up to 28.6 for 32 rows x 16 tokens; today's gemv_mma: ~42 on sm_90).
    per_word = loop.total / words
    assert per_word < 30, (per_word, loop.ops)
    _check_occupancy_data(rep, tile, 9)
    print(rep.summary(), f"main loop {per_word:.1f} instructions per code word")


@pytest.mark.compile
@pytest.mark.parametrize("arch,decode,dtype", [(120, gs.DECODE_CVT, "fp16"), (90, gs.DECODE_SHIFT, "fp16"),
                                               (90, gs.DECODE_PORTABLE, "bf16"), (90, gs.DECODE_PORTABLE, "fp16")])
def test_other_decodes_and_fp16_compile(arch, decode, dtype):
    tile = gs.StreamTile(64, 8)
    rep = compile_stream(tile, arch=arch, decode=decode, dtype=dtype).require_no_local().require_smem()
    rep.require_sass(r"HMMA\.16816\.F32" + (r"\.BF16" if dtype == "bf16" else r"\b(?!\.BF16)"))
    if decode == gs.DECODE_CVT:
        rep.require_ptx(r"cvt\.rn\.f16x2\.e2m1x2")
    elif decode == gs.DECODE_PORTABLE:
        # the lop3/prmt table: 10 prmt per word for bf16, 8 for fp16
        assert main_loop(rep.sass).count("PRMT") >= (10 if dtype == "bf16" else 8) * words_per_iteration(tile)


@pytest.mark.compile
def test_nodecode_probe_is_the_plan_tile_without_its_decode():
    """The timing probe (DECODE_COPY) must differ from the shift decode by the decode alone, or what it measures is
    not the decode's cost: the same loads, scale multiplies, MMAs and register cap, none of the decode's masks and
    multiplies and no activation repack."""
    tile = gs.StreamTile(32, 8, max_regs=128)
    probe = compile_stream(tile, arch=90, decode=gs.DECODE_COPY).require_no_local()
    plan = compile_stream(tile, arch=90, decode=gs.DECODE_SHIFT)
    p, s = main_loop(probe.sass), main_loop(plan.sass)
    words = words_per_iteration(tile)
    for op in (r"LDG\.E.*", r"HMMA\..*", r"H(MUL|FMA)2\..*"):
        assert p.count(op) == s.count(op) > 0, (op, p.ops, s.ops)
    assert p.count(r"IMAD\.HI\.U32") == 0 and s.count(r"IMAD\.HI\.U32") == words
    assert p.count(r"LOP3\.LUT") <= 16 and p.count("PRMT") < s.count("PRMT")
    # The decode is 13 per word and the repack ~1.2; the probe's chained multiplies bring ~3.7 register moves per word
    # back (14.5 against 25.2 per word for this tile today), so it measures the plan less ~10 instructions per word.
    assert s.total - p.total >= 10 * words, (p.total / words, s.total / words)
    print(f"sm_90 main loop per code word: shift {s.total / words:.1f}, no-decode probe {p.total / words:.1f}")


@pytest.mark.compile
def test_raw_probe_keeps_the_loads_and_mmas_only():
    """The second probe (DECODE_RAW) also drops the scale arithmetic: the plan tile's loads and MMAs, no decode, no
    16-bit multiplies, no e4m3 converts; one integer add per word keeps the scale bytes loaded."""
    tile = gs.StreamTile(32, 8, max_regs=128)
    probe = compile_stream(tile, arch=90, decode=gs.DECODE_RAW).require_no_local()
    plan = compile_stream(tile, arch=90, decode=gs.DECODE_SHIFT)
    p, s = main_loop(probe.sass), main_loop(plan.sass)
    words = words_per_iteration(tile)
    for op in (r"LDG\.E.*", r"HMMA\..*"):
        assert p.count(op) == s.count(op) > 0, (op, p.ops, s.ops)
    assert p.count(r"H(MUL|FMA|ADD)2.*") == 0 and p.count(r"F2FP\..*") == 0 and p.count(r"IMAD\.HI\.U32") == 0
    # What is left per word: its share of the loads and addresses, the MMA, the scale add, and ~3.7 register moves
    # (the MMA's four operand registers each take a copy of the word): 10.5 today, against the plan's 25.2.
    assert p.total <= 11 * words, (p.total / words, p.ops)
    print(f"sm_90 main loop per code word: shift {s.total / words:.1f}, raw probe {p.total / words:.1f}")


def test_nodecode_probe_is_not_a_plan_decode():
    """Plans and configs name decodes from DECODE_NAMES; the probes are outside it, and the launchers' check takes
    them as well as the real decodes and refuses anything else."""
    assert not set(gs.PROBE_DECODE_NAMES) & set(gs.DECODE_NAMES)
    assert set(gs.PROBE_DECODE_NAMES) == {gs.DECODE_COPY, gs.DECODE_RAW}
    for d in (*gs.DECODE_NAMES, *gs.PROBE_DECODE_NAMES):
        gs.check_stream_decode(d)
    with pytest.raises(ValueError, match="decode: expected one of"):
        gs.check_stream_decode(7)


@pytest.mark.compile
@pytest.mark.parametrize("arch,decode", [(120, gs.DECODE_CVT), (90, gs.DECODE_SHIFT)])
def test_wide_step_tiles_keep_the_plan_loop(arch, decode):
    """The sweep's 8-warp tiles (a CTA step over 512 bytes of each row) are the 4-warp plan tile with twice the
    warps over K: no stack, and the same main loop per code word."""
    sweep = load_benchmark("linear_decode_sweep")
    plan = compile_stream(gs.StreamTile(32, 8, max_regs=128), arch=arch, decode=decode)
    for tile in sweep.WIDE_STEP_TILES:
        assert tile.num_warps == 8 and tile.block_t == 8
        rep = compile_stream(tile, arch=arch, decode=decode).require_no_local().require_smem()
        words = words_per_iteration(tile)
        assert main_loop(rep.sass).total / words == pytest.approx(main_loop(plan.sass).total / words, abs=0.5)
        assert sweep.ctas_per_sm(rep.registers, tile.num_warps) == 2


OVERLAP_TILES = [t for t in gs.STREAM_TILES if t.overlap_runs]


@pytest.mark.compile
@pytest.mark.parametrize("arch,decode", [(120, gs.DECODE_CVT), (90, gs.DECODE_SHIFT)])
@pytest.mark.parametrize("tile", OVERLAP_TILES, ids=str)
def test_overlapped_runs_keep_the_loop_and_the_cap(tile, arch, decode):
    """The overlapped runs' main loop has the plain tile's loads, decode and MMAs, the kernel one step's loads more
    (the next run's first step), and the tile fits its register cap without local memory."""
    ov = compile_stream(tile, arch=arch, decode=decode).require_no_local().require_smem()
    plain = compile_stream(replace(tile, overlap_runs=False), arch=arch, decode=decode)
    loop, plain_loop = main_loop(ov.sass), main_loop(plain.sass)
    for op in (r"HMMA.*", r"HMUL2.*", r"F2FP\.BF16\.E2M1.*", r"LDG.*", r"LOP3.*", r"IMAD\.HI.*"):
        assert loop.count(op) == plain_loop.count(op), (op, loop.ops, plain_loop.ops)
    ldg = lambda rep: len(re.findall(r"\bLDG\.", rep.sass))  # noqa: E731
    assert ldg(ov) == ldg(plain) + loop.count(r"LDG.*") // 2  # the main loop is two steps
    assert ov.registers <= tile.max_regs
    print(ov.summary(), f"against {plain.registers} registers without")


DEEP_TILES = list(gs.DEEP_PREFETCH_TILES)


@pytest.mark.compile
@pytest.mark.parametrize("arch,decode", [(120, gs.DECODE_CVT), (90, gs.DECODE_SHIFT)])
@pytest.mark.parametrize("tile", DEEP_TILES, ids=str)
def test_deep_prefetch_keeps_the_step_and_three_buffers(tile, arch, decode):
    """Two steps ahead: the main loop is three steps of the one-step tile's step (the same loads, decode and MMAs
    per step), and the tile fits its cap without local memory (on sm_120 the native converts)."""
    deep = compile_stream(tile, arch=arch, decode=decode).require_no_local().require_smem()
    plain = compile_stream(replace(tile, prefetch=1), arch=arch, decode=decode)
    loop, plain_loop = main_loop(deep.sass), main_loop(plain.sass)
    for op in (r"HMMA.*", r"HMUL2.*", r"F2FP\.BF16\.E2M1.*", r"LDG\.E\.128", r"IMAD\.HI.*"):
        assert 2 * loop.count(op) == 3 * plain_loop.count(op), (op, loop.ops, plain_loop.ops)
    assert loop.count(r"HMMA.*") > 0 and deep.registers <= tile.max_regs
    if arch == 120:
        deep.require_sass(r"F2FP\.BF16\.E2M1\.UNPACK_B").require_sass(r"HMMA\.16816\.F32\.BF16")
    print(deep.summary(), f"against {plain.registers} registers with one step ahead")


@pytest.mark.compile
@pytest.mark.parametrize("arch,decode", [(120, gs.DECODE_CVT), (90, gs.DECODE_SHIFT)])
@pytest.mark.parametrize("tile", [t for t in gs.STREAM_TILES if t.max_regs is None], ids=str)
def test_k_tail_variant_compiles(tile, arch, decode):
    """K not a multiple of 128 runs the uncapped tiles only (dispatch.linear.k_tail_stream: under the caps some
    tiles' K-tail variants spill); each compiles without local memory."""
    compile_stream(tile, arch=arch, decode=decode, even_k=False).require_no_local().require_smem()


# ------------------------------------------------------------------------------------------------------------
# 6. GPU: every tile against the reference
# ------------------------------------------------------------------------------------------------------------
def _gpu_decode():
    return gs.default_stream_decode(torch.device("cuda"))


def _check(tile, t, n, k, dtype, gen, *, ctas, strided=False, bias=False, decode=None, workspace=None):
    dev = "cuda"
    p = make_linear(n, k, gen=gen, logical_widths=[n - n // 4, n // 4] if n >= 4 else None).to(dev)
    x = torch.randn(t, k + (64 if strided else 0), generator=gen).to(dtype).to(dev)[:, :k]
    b = torch.randn(n, generator=gen).to(dtype).to(dev) if bias else None
    got = gs.gemv_stream(x, p.codes, p.scales, p.dec_rows, tile=tile, ctas=ctas, bias=b, decode=decode,
                         workspace=workspace)
    want = linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows, bias=b)
    # The only difference is fp32 summation order (products are exact), then one rounding to bf16/fp16.
    torch.testing.assert_close(got, want, rtol=1.6e-2 if dtype == torch.bfloat16 else 2e-3, atol=1e-4)


SMALL = [(1, 16), (37, 1040), (200, 144), (24, 4096 + 48), (130, 1280)]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", gs.STREAM_TILES, ids=str)
@pytest.mark.parametrize("n,k", SMALL)
def test_gpu_every_tile_small_shapes(gen, tile, n, k):
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    for t in sorted({1, tile.block_t, tile.block_t + 1}):
        for ctas in (1, 7, sm):
            _check(tile, t, n, k, torch.bfloat16, gen, ctas=ctas, strided=True, bias=True)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", gs.STREAM_TILES, ids=str)
def test_gpu_fp16_and_real_k(gen, tile):
    _check(tile, min(tile.block_t, 3), 272, 5120, torch.float16, gen, ctas=50, bias=True)


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [gs.DECODE_SHIFT, gs.DECODE_PORTABLE])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_decode_is_exact_for_every_code_and_scale(decode, dtype):
    """Every e4m3 scale (subnormals included) times every code byte, with one-hot activations: each output is
    one decoded weight, which must equal the reference decode exactly."""
    k = 2048
    scales = torch.arange(1, 0x7F, dtype=torch.uint8).repeat(2)[: k // 16]  # 127 distinct, then repeats
    scales = torch.stack([scales.roll(r) for r in range(16)])  # 16 rows, every scale in every group position
    codes = torch.stack([torch.arange(256, dtype=torch.uint8).repeat(k // 512).roll(r) for r in range(16)])
    dec = torch.ones(16)
    dev = "cuda"
    tile = gs.StreamTile(32, 16)
    for k0 in range(0, k, 16):  # 16 tokens per call, one-hot at k0 .. k0 + 15
        x = torch.zeros(16, k, dtype=dtype)
        x[torch.arange(16), k0 + torch.arange(16)] = 1.0
        got = gs.gemv_stream(x.to(dev), codes.to(dev), scales.view(torch.float8_e4m3fn).to(dev), dec.to(dev),
                             tile=tile, ctas=3, decode=decode)
        want = unit_values(codes, scales.view(torch.float8_e4m3fn))[:, k0:k0 + 16].t().to(dtype)
        assert torch.equal(got.cpu(), want), f"k0 = {k0}"


SHAPES = [(10240, 5120), (5120, 8192), (51200, 5120), (5120, 25600),
          (10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)]


def real_problem(n, k, gen, dev="cuda"):
    """A checkpoint-sized weight drawn directly (quantizing 470M elements on the CPU takes minutes), two fused
    parts with their own decode globals."""
    from vllm_nvfp4_sm120.format import random_nvfp4

    w = random_nvfp4((n, k), gen=gen, device=dev)
    dec_rows = torch.full((n,), 0.013, device=dev)
    dec_rows[n // 3:] = 0.021
    return w.codes, w.scales, dec_rows


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES, ids=str)
def test_gpu_real_shapes_with_the_planned_tile(gen, n, k):
    from vllm_nvfp4_sm120.dispatch.gemv_stream_plan import stream_plan

    codes, scales, dec_rows = real_problem(n, k, gen)
    props = torch.cuda.get_device_properties(0)
    for t in (1, 2, 3, 4, 8, 9, 16):
        plan = stream_plan(t, n, k, props.multi_processor_count, props.major)
        x = torch.randn(t, k + 64, generator=gen).to(torch.bfloat16).cuda()[:, :k]  # strided rows
        bias = torch.randn(n, generator=gen).to(torch.bfloat16).cuda() if t == 9 else None
        got = gs.gemv_stream(x, codes, scales, dec_rows, tile=plan.tile, ctas=plan.ctas, bias=bias)
        want = linear_w4a16_ref(x, codes, scales, dec_rows, bias=bias)
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-4, msg=lambda m: f"T = {t}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", OVERLAP_TILES, ids=str)
@pytest.mark.parametrize("n,k", SMALL + [(5120, 8192)])
def test_gpu_overlapped_runs_change_no_bit(gen, tile, n, k):
    """The overlapped runs load the same blocks earlier and reduce the same partials in the same order: the bits of
    the plain tile, on grids where CTAs cross row tiles (several runs each) and where they do not."""
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    p = make_linear(n, k, gen=gen).to("cuda")
    for t in sorted({1, tile.block_t}):
        x = torch.randn(t, k, generator=gen).to(torch.bfloat16).cuda()
        for ctas in (1, 7, sm, 3 * sm):
            got = gs.gemv_stream(x, p.codes, p.scales, p.dec_rows, tile=tile, ctas=ctas)
            plain = gs.gemv_stream(x, p.codes, p.scales, p.dec_rows, tile=replace(tile, overlap_runs=False),
                                   ctas=ctas)
            assert torch.equal(got, plain), (t, ctas)
        torch.testing.assert_close(got, linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows), rtol=1.6e-2, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", DEEP_TILES, ids=str)
@pytest.mark.parametrize("n,k", SMALL + [(5120, 8192)])
def test_gpu_deep_prefetch_changes_no_bit(gen, tile, n, k):
    """Two steps ahead decodes the same steps in the same order: the bits of the one-step tile, on grids whose runs
    have 1 to many steps (each remainder of the three-step loop)."""
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    p = make_linear(n, k, gen=gen).to("cuda")
    for t in sorted({1, tile.block_t}):
        x = torch.randn(t, k, generator=gen).to(torch.bfloat16).cuda()
        for ctas in (1, 5, 7, 13, sm, 3 * sm):
            got = gs.gemv_stream(x, p.codes, p.scales, p.dec_rows, tile=tile, ctas=ctas)
            plain = gs.gemv_stream(x, p.codes, p.scales, p.dec_rows, tile=replace(tile, prefetch=1), ctas=ctas)
            assert torch.equal(got, plain), (t, ctas)
        torch.testing.assert_close(got, linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows), rtol=1.6e-2, atol=1e-4)


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_reuse_the_counters(gen):
    dev = "cuda"
    n, k, t = 5120, 8192, 5
    tile, ctas = gs.StreamTile(64, 8), 3 * torch.cuda.get_device_properties(0).multi_processor_count
    codes, scales, dec_rows = real_problem(n, k, gen)
    grid = gs.stream_grid(t, n, k, tile, ctas)
    ws = gs.StreamWorkspace.for_grid(grid, tile, dev)
    x = torch.zeros(t, k, dtype=torch.bfloat16, device=dev)
    out = torch.empty(t, n, dtype=torch.bfloat16, device=dev)

    def call():
        gs.gemv_stream(x, codes, scales, dec_rows, tile=tile, ctas=ctas, workspace=ws, out=out)

    call()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for _ in range(3):
        x.copy_(torch.randn(t, k, generator=gen).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, linear_w4a16_ref(x, codes, scales, dec_rows), rtol=1.6e-2, atol=1e-4)
        assert int(ws.counters.abs().sum()) == 0
    first = out.clone()
    graph.replay()
    assert torch.equal(out, first), "the split reduction is deterministic"


@pytest.mark.gpu
def test_gpu_empty_and_k_zero(gen):
    p = make_linear(64, 256, gen=gen).to("cuda")
    tile = gs.StreamTile(32, 8)
    out = gs.gemv_stream(torch.empty(0, 256, dtype=torch.bfloat16, device="cuda"), p.codes, p.scales, p.dec_rows,
                         tile=tile, ctas=4)
    assert out.shape == (0, 64)


@pytest.mark.sm120
def test_sm120_native_cvt_decode(gen):
    assert _gpu_decode() == gs.DECODE_CVT or pytest.skip("the ptxas in use emits a PTX ISA without the bf16 cvt")
    _check(gs.StreamTile(64, 8), 5, 5120, 8192, torch.bfloat16, gen, ctas=170, decode=gs.DECODE_CVT)
    _check(gs.StreamTile(64, 8), 5, 5120, 8192, torch.float16, gen, ctas=170, decode=gs.DECODE_CVT)


# ------------------------------------------------------------------------------------------------------------
# 7. GPU: the ready launch (what the linear op caches) and its per-stream counters
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("t,bias", [(1, False), (5, True), (9, False), (16, True)])
def test_gpu_ready_launch_equals_the_validating_launcher(gen, t, bias):
    """Bit-equal outputs, row tiles shared by several CTAs (partials and counters) included, on two calls."""
    from vllm_nvfp4_sm120.dispatch.gemv_stream_plan import stream_plan

    n, k, dev = 640, 3072, "cuda"  # 5 row tiles of 128 x 24 k-blocks over up to 396 CTAs
    props = torch.cuda.get_device_properties(0)
    plan = stream_plan(t, n, k, props.multi_processor_count, props.major)
    p = make_linear(n, k, gen=gen, logical_widths=[n // 2, n // 2]).to(dev)
    b = torch.randn(n, generator=gen).to(torch.bfloat16).to(dev) if bias else None
    run = gs.prepare_gemv_stream(t, n, k, dev, torch.bfloat16, tile=plan.tile, ctas=plan.ctas, has_bias=bias)
    for _ in range(2):
        x = torch.randn(t, k, generator=gen).to(torch.bfloat16).to(dev)
        got = run(x, p.codes, p.scales.view(torch.uint8), p.dec_rows, b, torch.empty(t, n, dtype=x.dtype, device=dev))
        want = gs.gemv_stream(x, p.codes, p.scales, p.dec_rows, tile=plan.tile, ctas=plan.ctas, bias=b)
        assert torch.equal(got, want)
        torch.testing.assert_close(got, linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows, bias=b), rtol=1.6e-2,
                                   atol=1e-4)


@pytest.mark.gpu
def test_gpu_ready_launch_keeps_one_counter_tensor_per_stream(gen):
    """Launches on two streams at once each get their own counters (shared counters would let one launch's
    arrivals complete the other's tiles); each stream's tensor is back to zero after its launches."""
    n, k, t, dev = 1280, 8192, 4, "cuda"
    tile, ctas = gs.StreamTile(128, 8, 4, 2), 300
    p = make_linear(n, k, gen=gen).to(dev)
    run = gs.prepare_gemv_stream(t, n, k, dev, torch.bfloat16, tile=tile, ctas=ctas, has_bias=False)
    xs = [torch.randn(t, k, generator=gen).to(torch.bfloat16).to(dev) for _ in range(2)]
    want = [linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows) for x in xs]
    streams = [torch.cuda.Stream() for _ in range(2)]
    outs = [[], []]
    torch.cuda.synchronize()
    for _ in range(20):  # interleaved launches, free to overlap
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                outs[i].append(run(xs[i], p.codes, p.scales.view(torch.uint8), p.dec_rows, None,
                                   torch.empty(t, n, dtype=torch.bfloat16, device=dev)))
    torch.cuda.synchronize()
    for i in range(2):
        for got in outs[i]:
            torch.testing.assert_close(got, want[i], rtol=1.6e-2, atol=1e-4)
    made = run.counters.by_stream  # the tensors the launcher made, one per stream, all zero again
    assert {s.cuda_stream for s in streams} <= set(made)
    assert all(int(c.abs().sum()) == 0 for c in made.values())


@pytest.mark.gpu
def test_gpu_ready_launch_graph_replay_equals_eager(gen):
    n, k, t, dev = 640, 3072, 3, "cuda"
    props = torch.cuda.get_device_properties(0)
    from vllm_nvfp4_sm120.dispatch.gemv_stream_plan import stream_plan

    plan = stream_plan(t, n, k, props.multi_processor_count, props.major)
    p = make_linear(n, k, gen=gen).to(dev)
    run = gs.prepare_gemv_stream(t, n, k, dev, torch.bfloat16, tile=plan.tile, ctas=plan.ctas, has_bias=False)
    x = torch.randn(t, k, generator=gen).to(torch.bfloat16).to(dev)
    args = (p.codes, p.scales.view(torch.uint8), p.dec_rows, None)
    eager = run(x, *args, torch.empty(t, n, dtype=x.dtype, device=dev))
    g = torch.cuda.CUDAGraph()
    out = torch.empty(t, n, dtype=x.dtype, device=dev)
    with torch.cuda.graph(g):
        run(x, *args, out)
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
