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
from moe_gpu_common import SHAPES, assert_moe_close, layer, routing, w4a4_reference

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
    from vllm_nvfp4_sm120.dispatch.hw import Capability
    from vllm_nvfp4_sm120.dispatch.moe import all_moe_plans

    compiled = set(W4A4_TILES.values())
    gluon = [p for p in all_moe_plans(Capability(120)) if p.impl == "gluon" and p.kernel == "w4a4"]
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
    tile = dict(block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=3)
    with pytest.raises(ValueError, match="block_k"):
        g4.gluon_moe_w4a4_gate_up(ac, asf, codes, scales, dec, enc, enc, align, **(tile | dict(block_k=64)))
    with pytest.raises(ValueError, match="shared memory"):
        g4.gluon_moe_w4a4_gate_up(ac, asf, codes, scales, dec, enc, enc, align,
                                  **(tile | dict(block_n=128, num_stages=6)))
    with pytest.raises(TypeError, match="a_codes: expected dtype"):
        g4.gluon_moe_w4a4_gate_up(ac.float(), asf, codes, scales, dec, enc, enc, align, **tile)
    with pytest.raises(ValueError, match="a13_enc"):
        g4.gluon_moe_w4a4_gate_up(ac, asf, codes, scales, dec, torch.ones(2), enc, align, **tile)
    # T = 0: nothing to launch, the empty intermediate / untouched output comes back.
    empty = MoeAlignment(z, z, z[:1], 64, 0, k)
    ic, isf = g4.gluon_moe_w4a4_gate_up(ac[:0], asf[:0], codes, scales, dec, enc, enc, empty, **tile)
    assert ic.shape == (0, i // 2) and isf.shape == (0, i // 16)
    w2 = torch.zeros(e, h, i // 2, dtype=torch.uint8)
    w2s = torch.zeros(e, h, i // 16, dtype=torch.float8_e4m3fn)
    out = torch.zeros(0, h)
    assert g4.gluon_moe_w4a4_down(ic, isf, w2, w2s, dec, enc, torch.zeros(0, k), empty, out, **tile) is out
    # Epilogue warps: a persistent down GEMM feature.
    ic, isf = torch.zeros(t * k, i // 2, dtype=torch.uint8), torch.zeros(t * k, i // 16, dtype=torch.float8_e4m3fn)
    for kw in (dict(epilogue_warps=4), dict(epilogue_warps=2, persistent=True)):
        with pytest.raises(ValueError, match="epilogue_warps"):
            g4.gluon_moe_w4a4_down(ic, isf, w2, w2s, dec, enc, torch.zeros(t, k), align, torch.zeros(t, h),
                                   **tile, **kw)


# ------------------------------------------------------------------------------------------------------------
# GPU: the same source with DECODE against the references (as tests/kernels/test_moe_gpu.py checks W4A4)
# ------------------------------------------------------------------------------------------------------------
TOKENS = [0, 64, 512]


def _check_layer(name, t, skewed, tile, *, activation="silu", use_tma=None, x_pad=0):
    """``use_tma=None``: the weight codes by TMA where the dispatch would use it (K % 256 == 0)."""
    from vllm_nvfp4_sm120.dispatch.linear import act_quant_config
    from vllm_nvfp4_sm120.dispatch.moe import TMA_K_MULTIPLE
    from vllm_nvfp4_sm120.format import GlobalScale, moe_ref, quantize_nvfp4
    from vllm_nvfp4_sm120.kernels.moe_align import moe_align, moe_sum
    from vllm_nvfp4_sm120.kernels.moe_w4a4 import moe_quant_input

    h, i, e, k, w13, d13, w2, d2 = layer(name)
    bm, bn_gu, bn_dn, bk, warps, stages, persistent, epi = W4A4_TILES[tile]
    kw = dict(block_k=bk, group_m=8, num_warps=warps, num_stages=stages, persistent=persistent, decode=True)
    tma_gu = h % TMA_K_MULTIPLE == 0 if use_tma is None else use_tma
    tma_dn = i % TMA_K_MULTIPLE == 0 if use_tma is None else use_tma
    # Row-strided input when x_pad: the quantizer reads it, the GEMMs read its (contiguous) codes.
    x = torch.randn(t, h + x_pad, device="cuda", dtype=torch.bfloat16)[:, :h]
    tw, ti = routing(t, e, k, skewed)
    a13 = (GlobalScale.of(x) if t else GlobalScale.from_encode(1.0)).to("cuda")
    a2 = GlobalScale.from_amax(24.0).to("cuda")
    align = moe_align(ti, e, bm)

    ac, asf = moe_quant_input(x, a13.enc, **act_quant_config(t, h))
    xq = quantize_nvfp4(x.cpu(), a13)  # on the CPU: IEEE divisions by construction
    torch.testing.assert_close(ac.cpu(), xq.codes, rtol=0, atol=0)
    torch.testing.assert_close(asf.cpu().view(torch.uint8), xq.scales.view(torch.uint8), rtol=0, atol=0)

    ic, isf = g4.gluon_moe_w4a4_gate_up(ac, asf, w13.codes, w13.scales, d13, a13.enc.reshape(1),
                                        a2.enc.reshape(1), align, activation=activation, block_n=bn_gu,
                                        use_tma=tma_gu, **kw)
    assert ic.shape == (t * k, i // 2) and isf.shape == (t * k, i // 16)
    out = torch.zeros(t, h, device="cuda")
    g4.gluon_moe_w4a4_down(ic, isf, w2.codes, w2.scales, d2, a2.enc.reshape(1), tw, align, out, block_n=bn_dn,
                           epilogue_warps=epi, use_tma=tma_dn, **kw)
    det = torch.zeros(t * k, h, device="cuda")
    g4.gluon_moe_w4a4_down(ic, isf, w2.codes, w2.scales, d2, a2.enc.reshape(1), tw, align, det, deterministic=True,
                           block_n=bn_dn, epilogue_warps=epi, use_tma=tma_dn, **kw)
    if t == 0:
        return

    # Reference intermediate (fp32, before quantization) per expert, and the down GEMM of the kernel's own one.
    ref_out, flips = w4a4_reference(ac, asf, w13, d13, w2, d2, tw, ti, ic, isf, a13, a2, activation)
    assert_moe_close(out.to(x.dtype), ref_out.to(x.dtype))
    assert_moe_close(moe_sum(det, k, torch.empty_like(x)), ref_out.to(x.dtype))
    if flips == 0:  # every intermediate code as the reference's: the whole layer is format.moe_ref's
        ref = moe_ref(x, w13, d13, w2, d2, tw, ti, activation=activation, a13_gs=a13, a2_gs=a2)
        assert_moe_close(out.to(x.dtype), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "odd"])
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
    from vllm_nvfp4_sm120.dispatch.linear import act_quant_config
    from vllm_nvfp4_sm120.dispatch.moe import as_gluon
    from vllm_nvfp4_sm120.dispatch.moe_flow import nvfp4_moe, plan_for
    from vllm_nvfp4_sm120.format import GlobalScale
    from vllm_nvfp4_sm120.kernels.moe_align import moe_align, moe_sum
    from vllm_nvfp4_sm120.kernels.moe_w4a4 import moe_quant_input

    h, i, e, k, w13, d13, w2, d2 = layer("qwen3-30b-a3b")
    t = 1024
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = routing(t, e, k, False)
    a13, a2 = GlobalScale.of(x).to("cuda"), GlobalScale.from_amax(24.0).to("cuda")
    a13_enc, a2_enc = a13.enc.reshape(1), a2.enc.reshape(1)
    plan = as_gluon(plan_for(x, w13.codes, w2.codes, ti, w4a4=True), i)
    assert (plan.kernel, plan.block_m, plan.down.persistent, plan.down.epilogue_warps) == (
        "w4a4", 64, True, g4.EPILOGUE_WARPS)
    out = nvfp4_moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, a13_enc=a13_enc,
                    a2_enc=a2_enc, deterministic=True, plan=plan)

    kw = dict(block_k=128, group_m=8, num_warps=4, num_stages=3, persistent=True, decode=True)
    align = moe_align(ti, e, 64)
    ac, asf = moe_quant_input(x, a13_enc, **act_quant_config(t, h))
    ic, isf = g4.gluon_moe_w4a4_gate_up(ac, asf, w13.codes, w13.scales, d13, a13_enc, a2_enc, align, block_n=64,
                                        use_tma=plan.gate_up.use_tma, **kw)
    det = torch.zeros(t * k, h, device="cuda")
    g4.gluon_moe_w4a4_down(ic, isf, w2.codes, w2.scales, d2, a2_enc, tw, align, det, deterministic=True,
                           block_n=64, use_tma=plan.down.use_tma, **kw)
    torch.testing.assert_close(out, moe_sum(det, k, torch.empty_like(x)), atol=0, rtol=0)


def _tile_of(plan) -> str:
    """The W4A4_TILES entry a dispatch plan runs (gate_up and down share block_m, block_k, warps and stages)."""
    key = (plan.block_m, plan.gate_up.block_n, plan.down.block_n, plan.down.block_k, plan.down.num_warps,
           plan.down.num_stages, plan.down.persistent, plan.down.epilogue_warps)
    return next(name for name, tile in W4A4_TILES.items() if tile == key)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [64, 256], ids=["64-per-expert", "256-per-expert"])
@pytest.mark.parametrize("name", ["qwen3-235b-a22b", "deepseek-v3", "qwen3-next-80b"])
def test_w4a4_dispatch_tiles_real_shapes(name, m):
    # The sm_120 dispatch's Gluon plan for the other benchmarked MoE checkpoints at BLOCK_M 64 and 128 (Qwen3-Next:
    # I = 512, so its persistent down GEMM runs with epilogue warps), against the references.
    from vllm_nvfp4_sm120.dispatch.hw import Capability
    from vllm_nvfp4_sm120.dispatch.moe import as_gluon, select_moe_plan

    h, i, e, k = SHAPES[name]
    t = -(-m * e // k)
    plan = as_gluon(select_moe_plan(Capability(120), num_tokens=t, top_k=k, global_experts=e, hidden=h, intermediate=i,
                                    w4a4=True), i)
    assert plan.block_m == (64 if m == 64 else 128)
    _check_layer(name, t, False, _tile_of(plan))
