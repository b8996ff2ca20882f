"""Warp-specialized Gluon W4A4 MoE GEMMs: sm_120 compiles (CPU) and the same source with DECODE on a GPU.

Gluon cannot run in the interpreter, so the CPU half is the compile proof (OMMA block-scaled MMA in both GEMMs,
TMA for the weight codes, ``setmaxnreg`` for the loader/mma register split, no local memory, shared memory <=
99 KB) of the tiles the dispatch may route to, plus the sm_90 compile of the DECODE variant (the H200's path)
and the launchers' argument checks.

The GPU half (H200, Triton 3.8) runs the same source with ``DECODE`` (exact e2m1 x e4m3 → bf16 decode + bf16
``mma_v2``: the block-scaled MMA does not compile for sm_90), checked as ``tests/kernels/test_moe_gpu.py`` checks
the Triton W4A4 kernels: the input quantization bit-exact with ``quantize_nvfp4``; the intermediate equal to
``quantize_nvfp4(reference fp32 intermediate)`` up to explained rounding-midpoint flips (the fp32 values differ
in the last ulps: summation order, ``exp``); the output equal to the down GEMM of the kernel's own intermediate
(atomics and the deterministic store); and, where no code flipped, equal to ``format.moe_ref`` in W4A4 form.
"""

from __future__ import annotations

import functools

import pytest
import torch

from vllm_nvfp4_sm120.kernels import gluon_moe_w4a4 as g4
from vllm_nvfp4_sm120.kernels.aot import PTX_MMA_NVFP4, PTX_TMA_LOAD, SASS_OMMA_NVFP4, compile_kernel

# ------------------------------------------------------------------------------------------------------------
# Tiles: (block_m, gate_up block_n, down block_n, block_k, mma warps, stages, persistent, down epilogue warps)
# ------------------------------------------------------------------------------------------------------------
W4A4_TILES = {
    "bm64": (64, 64, 64, 128, 4, 3, False, 0),
    "bm64-persistent": (64, 64, 64, 128, 4, 3, True, 0),
    "bm64-persistent-epi": (64, 64, 64, 128, 4, 3, True, g4.EPILOGUE_WARPS),
    "bm128": (128, 64, 64, 128, 8, 3, False, 0),
}
W4A4_KERNEL = "vllm_nvfp4_sm120.kernels.gluon_moe_w4a4:_gluon_moe_w4a4_kernel"


@functools.cache
def _compile(gated: bool, use_tma: bool, tile: str, decode: bool = False, arch: int = 120,
             activation: str = "silu", deterministic: bool = False):
    bm, bn_gu, bn_dn, bk, warps, stages, persistent, epi = W4A4_TILES[tile]
    bn = bn_gu if gated else bn_dn
    consts = dict(GATED=gated, ACTIVATION=activation, DETERMINISTIC=deterministic, USE_TMA=use_tma, DECODE=decode,
                  PERSISTENT=persistent, EPILOGUE_WARPS=0 if gated else epi, STAGES=stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                  MMA_WARPS_M=warps // 2)
    rep = compile_kernel(W4A4_KERNEL, g4.signature(gated, use_tma, bn, bk), consts, divisible=g4.divisible(use_tma),
                         gluon=True, num_warps=warps, arch=arch)
    print(rep.summary(), tile, "gate_up" if gated else "down", "tma" if use_tma else "ptr",
          "decode" if decode else "omma")
    return rep


@pytest.mark.compile
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "ptr"])
@pytest.mark.parametrize("gated", [True, False], ids=["gate_up", "down"])
@pytest.mark.parametrize("tile", list(W4A4_TILES))
def test_w4a4_compiles_for_sm120(tile, gated, use_tma):
    if not use_tma and (tile != "bm64" or not gated):
        pytest.skip("pointer-load weight codes: one kernel and tile is enough (they serve small odd shapes)")
    if gated and W4A4_TILES[tile][-1]:
        pytest.skip("epilogue warps are a down-GEMM variant: the gate_up kernel of this tile is bm64-persistent's")
    # One compile per kernel and tile: GELU rides on the pointer-load kernel, the deterministic per-route store
    # on the persistent down GEMM (the others use atomics).
    rep = _compile(gated, use_tma, tile, activation="silu" if use_tma else "gelu_tanh",
                   deterministic=tile == "bm64-persistent" and not gated)
    rep.require_no_local().require_smem()
    rep.require_ptx(PTX_MMA_NVFP4).require_sass(SASS_OMMA_NVFP4)  # the block-scaled MMA, not an emulation
    rep.require_ptx(r"setmaxnreg\.dec").require_ptx(r"setmaxnreg\.inc")  # the loader gives registers away
    rep.require_ptx(r"mbarrier\.try_wait")
    assert not rep.has_ptx(r"mma\.sync\.aligned\.m16n8k16")  # no bf16 MMA: the DECODE path is compiled out
    if gated:  # the intermediate's e2m1 rounding by the hardware convert
        rep.require_ptx(r"cvt\.rn\.satfinite\.e2m1x2\.f32").require_sass(r"F2FP\.SATFINITE\.E2M1\.F32")
    if use_tma:
        rep.require_ptx(PTX_TMA_LOAD)
    else:
        assert not rep.has_ptx(PTX_TMA_LOAD)
    # mma + loader (+ epilogue) warps, padded to whole warpgroups (setmaxnreg works per warpgroup).
    mma_warps, epi = W4A4_TILES[tile][4], W4A4_TILES[tile][-1]
    assert rep.num_warps == -(-(mma_warps + g4.LOADER_WARPS + (0 if gated else epi)) // 4) * 4


def test_dispatch_gluon_tiles_are_the_compiled_ones():
    from vllm_nvfp4_sm120.dispatch.moe import all_moe_plans

    compiled = set(W4A4_TILES.values())
    gluon = [p for p in all_moe_plans((12, 0)) if p.backend == "gluon" and p.kernel == "w4a4"]
    assert {p.block_m for p in gluon} == {64, 128}
    assert {p.down.epilogue_warps for p in gluon} == {0, g4.EPILOGUE_WARPS}  # both sides of the I rule
    for p in gluon:
        assert p.gate_up.block_k == p.down.block_k and p.gate_up.num_warps == p.down.num_warps
        for tile, gated in ((p.gate_up, True), (p.down, False)):
            key = (p.block_m, p.gate_up.block_n, p.down.block_n, tile.block_k, tile.num_warps, tile.num_stages,
                   tile.persistent, tile.epilogue_warps)
            assert key in compiled, (key, "gate_up" if gated else "down")


@pytest.mark.compile
@pytest.mark.parametrize("gated", [True, False], ids=["gate_up", "down"])
def test_w4a4_decode_variant_compiles_for_sm90(gated):
    # What the H200 runs: the same source with DECODE (bf16 mma.sync instead of the block-scaled MMA).  Local
    # memory is not asserted: a few spill slots on sm_90 do not matter for an emulation path.
    rep = _compile(gated, gated, "bm64", decode=True, arch=90)
    rep.require_ptx(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32").require_smem()
    assert not rep.has_ptx(PTX_MMA_NVFP4) and not rep.has_ptx(r"e2m1x2")


def test_w4a4_launcher_checks():
    from vllm_nvfp4_sm120.kernels.moe_align import MoeAlignment

    if not g4.HAS_GLUON:
        pytest.skip("no Gluon in this Triton")
    e, h, i, t, k = 2, 256, 32, 3, 2
    ac = torch.zeros(t, h // 2, dtype=torch.uint8)
    asf = torch.zeros(t, h // 16, dtype=torch.float8_e4m3fn)
    codes = torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8)
    scales = torch.zeros(e, 2 * i, h // 16, dtype=torch.float8_e4m3fn)
    dec, enc = torch.ones(e), torch.ones(1)
    z = torch.zeros(8, dtype=torch.int32)
    align = MoeAlignment(z.repeat(16), z, z[:1], 64, t * k, k)
    with pytest.raises(ValueError, match="block_k"):
        g4.gluon_moe_w4a4_gate_up(ac, asf, codes, scales, dec, enc, enc, align, block_k=64)
    with pytest.raises(ValueError, match="shared memory"):
        g4.gluon_moe_w4a4_gate_up(ac, asf, codes, scales, dec, enc, enc, align, block_n=128, num_stages=6)
    with pytest.raises(TypeError, match="a_codes: expected dtype"):
        g4.gluon_moe_w4a4_gate_up(ac.float(), asf, codes, scales, dec, enc, enc, align)
    with pytest.raises(ValueError, match="a13_enc"):
        g4.gluon_moe_w4a4_gate_up(ac, asf, codes, scales, dec, torch.ones(2), enc, align)
    # T = 0: nothing to launch, the empty intermediate / untouched output comes back.
    empty = MoeAlignment(z, z, z[:1], 64, 0, k)
    ic, isf = g4.gluon_moe_w4a4_gate_up(ac[:0], asf[:0], codes, scales, dec, enc, enc, empty)
    assert ic.shape == (0, i // 2) and isf.shape == (0, i // 16)
    w2 = torch.zeros(e, h, i // 2, dtype=torch.uint8)
    w2s = torch.zeros(e, h, i // 16, dtype=torch.float8_e4m3fn)
    out = torch.zeros(0, h)
    assert g4.gluon_moe_w4a4_down(ic, isf, w2, w2s, dec, enc, torch.zeros(0, k), empty, out) is out
    # Epilogue warps: a persistent down GEMM feature.
    ic, isf = torch.zeros(t * k, i // 2, dtype=torch.uint8), torch.zeros(t * k, i // 16, dtype=torch.float8_e4m3fn)
    for kw in (dict(epilogue_warps=4), dict(epilogue_warps=2, persistent=True)):
        with pytest.raises(ValueError, match="epilogue_warps"):
            g4.gluon_moe_w4a4_down(ic, isf, w2, w2s, dec, enc, torch.zeros(t, k), align, torch.zeros(t, h), **kw)


# ------------------------------------------------------------------------------------------------------------
# GPU: the same source with DECODE against the references (as tests/kernels/test_moe_gpu.py checks W4A4)
# ------------------------------------------------------------------------------------------------------------
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "odd": (336, 80, 8, 2)}  # H, I, E, top_k
TOKENS = [0, 64, 512]
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@functools.cache
def _bank(e, rows, k, seed):
    from vllm_nvfp4_sm120.format import NvFp4

    g = torch.Generator(device="cuda").manual_seed(seed)
    codes = torch.randint(0, 256, (e, rows, k // 2), generator=g, device="cuda", dtype=torch.uint8)
    scales = (0.25 + 1.75 * torch.rand(e, rows, k // 16, generator=g, device="cuda")).to(torch.float8_e4m3fn)
    dec = 0.004 + 0.004 * torch.rand(e, generator=g, device="cuda")
    return NvFp4(codes, scales), dec


def _layer(name):
    h, i, e, k = SHAPES[name]
    return (h, i, e, k) + _bank(e, 2 * i, h, 1) + _bank(e, h, i, 2)


def _routing(t, e, k, skewed, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(t, e, generator=g, device="cuda")
    if skewed:  # every token on experts 0..k-1: a few experts with many row blocks, the rest idle
        logits[:, :k] += 100.0
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32)


def _assert_moe_close(out, ref):
    # As tests/kernels/test_moe_gpu.py: fp32 summation order (absolute, scales with the output) + one 16-bit ulp.
    atol = 2.0**-8 * float(ref.float().abs().max()) if ref.numel() else 0.0
    torch.testing.assert_close(out, ref, atol=atol, rtol=2.0**-7)


def _fp4_flips(codes, scales, ref_values, gs) -> int:
    """Kernel NVFP4 ``(codes, scales)`` vs ``quantize_nvfp4(ref_values)``: asserts every difference is explained
    (a block scale one e4m3 step off, or a code whose value sits within fp32 jitter of an e2m1 rounding
    midpoint, both rare) and returns how many there are."""
    from vllm_nvfp4_sm120.format import quantize_nvfp4

    q = quantize_nvfp4(ref_values, gs)
    sf_kernel, sf_ref = scales.view(torch.uint8), q.scales.view(torch.uint8)
    bad_sf = sf_kernel != sf_ref
    assert int(bad_sf.sum()) <= max(2, bad_sf.numel() // 10000), f"{int(bad_sf.sum())} block scales differ"
    if bad_sf.any():
        steps = (sf_kernel.int() - sf_ref.int())[bad_sf].abs()
        assert int(steps.max()) <= 1, f"a block scale is {int(steps.max())} e4m3 steps off"
    enc = gs.enc.to(ref_values.device)
    scaled = ref_values.float().unflatten(-1, (-1, 16)) / (q.scales.float() / enc).unsqueeze(-1)
    kernel_codes = torch.stack((codes & 15, codes >> 4), -1).flatten(-2).unflatten(-1, (-1, 16))
    ref_codes = torch.stack((q.codes & 15, q.codes >> 4), -1).flatten(-2).unflatten(-1, (-1, 16))
    diff = (kernel_codes != ref_codes) & ~bad_sf.unsqueeze(-1)
    if diff.any():
        mid = torch.tensor(_MIDPOINTS, device=scaled.device)
        dist = (scaled[diff].abs().unsqueeze(-1) - mid).abs().min(-1).values
        assert float(dist.max()) < 1e-3, f"code mismatch {float(dist.max())} away from any rounding midpoint"
        assert int(diff.sum()) <= max(4, diff.numel() // 10000), f"{int(diff.sum())} codes differ"
    return int(bad_sf.sum()) + int(diff.sum())


def _check_layer(name, t, skewed, tile, *, activation="silu", use_tma=None, x_pad=0):
    from vllm_nvfp4_sm120.format import GlobalScale, moe_ref, quantize_nvfp4, unit_values
    from vllm_nvfp4_sm120.format.reference import gated_activation
    from vllm_nvfp4_sm120.kernels.moe_align import moe_align, moe_sum
    from vllm_nvfp4_sm120.kernels.moe_w4a4 import moe_quant_input

    h, i, e, k, w13, d13, w2, d2 = _layer(name)
    bm, bn_gu, bn_dn, bk, warps, stages, persistent, epi = W4A4_TILES[tile]
    kw = dict(block_k=bk, num_warps=warps, num_stages=stages, persistent=persistent, decode=True, use_tma=use_tma)
    # Row-strided input when x_pad: the quantizer reads it, the GEMMs read its (contiguous) codes.
    x = torch.randn(t, h + x_pad, device="cuda", dtype=torch.bfloat16)[:, :h]
    tw, ti = _routing(t, e, k, skewed)
    a13 = (GlobalScale.of(x) if t else GlobalScale.from_encode(1.0)).to("cuda")
    a2 = GlobalScale.from_amax(24.0).to("cuda")
    align = moe_align(ti, e, bm)

    ac, asf = moe_quant_input(x, a13.enc)
    xq = quantize_nvfp4(x.cpu(), a13)  # on the CPU: IEEE divisions by construction
    torch.testing.assert_close(ac.cpu(), xq.codes, rtol=0, atol=0)
    torch.testing.assert_close(asf.cpu().view(torch.uint8), xq.scales.view(torch.uint8), rtol=0, atol=0)

    ic, isf = g4.gluon_moe_w4a4_gate_up(ac, asf, w13.codes, w13.scales, d13, a13.enc.reshape(1),
                                        a2.enc.reshape(1), align, activation=activation, block_n=bn_gu, **kw)
    assert ic.shape == (t * k, i // 2) and isf.shape == (t * k, i // 16)
    out = torch.zeros(t, h, device="cuda")
    g4.gluon_moe_w4a4_down(ic, isf, w2.codes, w2.scales, d2, a2.enc.reshape(1), tw, align, out, block_n=bn_dn,
                           epilogue_warps=epi, **kw)
    det = torch.zeros(t * k, h, device="cuda")
    g4.gluon_moe_w4a4_down(ic, isf, w2.codes, w2.scales, d2, a2.enc.reshape(1), tw, align, det, deterministic=True,
                           block_n=bn_dn, epilogue_warps=epi, **kw)
    if t == 0:
        return

    # Reference intermediate (fp32, before quantization) per expert, and the down GEMM of the kernel's own one.
    x_in = unit_values(ac, asf)  # = the reference's quantized input (checked above)
    ref_out = torch.zeros(t, h, device="cuda")
    routes = ti.reshape(-1).long()
    flips = 0
    for ex in range(e):
        r = (routes == ex).nonzero().flatten()
        if r.numel() == 0:
            continue
        hh = (x_in[r // k] @ unit_values(w13.codes[ex], w13.scales[ex]).t()) * (d13[ex] * a13.dec)
        flips += _fp4_flips(ic[r], isf[r], gated_activation(hh, activation), a2)
        y = unit_values(ic[r], isf[r].view(torch.float8_e4m3fn)) @ unit_values(w2.codes[ex], w2.scales[ex]).t()
        ref_out.index_add_(0, r // k, y * (d2[ex] * a2.dec) * tw.reshape(-1)[r, None])
    _assert_moe_close(out.to(x.dtype), ref_out.to(x.dtype))
    _assert_moe_close(moe_sum(det, k, torch.empty_like(x)), ref_out.to(x.dtype))
    if flips == 0:  # every intermediate code as the reference's: the whole layer is format.moe_ref's
        ref = moe_ref(x, w13, d13, w2, d2, tw, ti, activation=activation, a13_gs=a13, a2_gs=a2)
        _assert_moe_close(out.to(x.dtype), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_w4a4_layer_decode(name, t, skewed):
    # Qwen3-30B: weight codes by TMA (H and I % 256 == 0); odd: pointer loads with K and N tails.
    _check_layer(name, t, skewed, "bm64")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["bm64-persistent", "bm64-persistent-epi", "bm128"])
def test_w4a4_tiles_decode(tile):
    # The persistent ring across tiles and the 8-warp tile, skewed (many row blocks per expert), row-strided x.
    _check_layer("qwen3-30b-a3b", 512, True, tile, x_pad=64)


@pytest.mark.gpu
def test_w4a4_pointer_loader_gelu_decode():
    # The pointer-load weight path on the TMA-able shape, with GELU.
    _check_layer("qwen3-30b-a3b", 64, False, "bm64", activation="gelu_tanh", use_tma=False)


@pytest.mark.gpu
def test_w4a4_gluon_plan_through_the_flow():
    # The dispatch's sm_120 plan at 64 routes per expert (persistent BLOCK_M 64, down GEMM with epilogue warps since
    # I < 1024) run by the layer flow, bitwise equal (deterministic sum) to the launchers called by hand without
    # epilogue warps -- which the tests above check against the references.
    from vllm_nvfp4_sm120.dispatch.moe import as_gluon
    from vllm_nvfp4_sm120.dispatch.moe_flow import nvfp4_moe, plan_for
    from vllm_nvfp4_sm120.format import GlobalScale
    from vllm_nvfp4_sm120.kernels.moe_align import moe_align, moe_sum
    from vllm_nvfp4_sm120.kernels.moe_w4a4 import moe_quant_input

    h, i, e, k, w13, d13, w2, d2 = _layer("qwen3-30b-a3b")
    t = 1024
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = _routing(t, e, k, False)
    a13, a2 = GlobalScale.of(x).to("cuda"), GlobalScale.from_amax(24.0).to("cuda")
    a13_enc, a2_enc = a13.enc.reshape(1), a2.enc.reshape(1)
    plan = as_gluon(plan_for(x, w13.codes, w2.codes, ti, w4a4=True), i)
    assert (plan.kernel, plan.block_m, plan.down.persistent, plan.down.epilogue_warps) == (
        "w4a4", 64, True, g4.EPILOGUE_WARPS)
    out = nvfp4_moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, a13_enc=a13_enc,
                    a2_enc=a2_enc, deterministic=True, plan=plan)

    kw = dict(block_k=128, num_warps=4, num_stages=3, persistent=True, decode=True)
    align = moe_align(ti, e, 64)
    ac, asf = moe_quant_input(x, a13_enc)
    ic, isf = g4.gluon_moe_w4a4_gate_up(ac, asf, w13.codes, w13.scales, d13, a13_enc, a2_enc, align, block_n=64,
                                        **kw)
    det = torch.zeros(t * k, h, device="cuda")
    g4.gluon_moe_w4a4_down(ic, isf, w2.codes, w2.scales, d2, a2_enc, tw, align, det, deterministic=True,
                           block_n=64, **kw)
    torch.testing.assert_close(out, moe_sum(det, k, torch.empty_like(x)), atol=0, rtol=0)
