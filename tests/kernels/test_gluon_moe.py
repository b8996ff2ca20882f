"""Warp-specialized Gluon MoE GEMMs: sm_120 compiles (CPU) and the same sources on a GPU against format.moe_ref.

Gluon cannot run in the interpreter, so the CPU half is the compile proof of every tile the dispatch may route
to (TMA in the loader, ``setmaxnreg`` for the register split, mma.sync + ldmatrix, no local memory, shared
memory <= 99 KB) plus the launchers' argument checks.  The GPU half (H200, Triton 3.8: TMA, mbarrier,
warp_specialize and mma_v2 all run there; the e2m1 decode is the exact portable table instead of sm_120's cvt)
runs the full MoE layer on two of the benchmarked MoE shapes with T in {0, 3, 64, 512}, uniform and skewed routing.
"""

from __future__ import annotations

import functools

import pytest
import torch
from moe_gpu_common import assert_moe_close, layer, routing

from vllm_nvfp4_sm120.kernels import gluon_moe_w4a16 as g16
from vllm_nvfp4_sm120.kernels.aot import PTX_TMA_LOAD, compile_kernel

# ------------------------------------------------------------------------------------------------------------
# Tiles: what the dispatch routes to on sm_120 (BLOCK_M 64 / 128; persistent BLOCK_M 64, 3 stages).
# ------------------------------------------------------------------------------------------------------------
# name: (block_m, gate_up block_n, down block_n, block_k, mma warps, stages, persistent)
W4A16_TILES = {
    "bm64": (64, 64, 128, 64, 4, 2, False),
    "bm64-persistent": (64, 64, 128, 64, 4, 3, True),
    "bm128": (128, 64, 128, 64, 8, 2, False),
}
W4A16_KERNEL = "vllm_nvfp4_sm120.kernels.gluon_moe_w4a16:_gluon_moe_w4a16_kernel"


@functools.cache
def _compile_w4a16(gated: bool, use_tma: bool, tile: str, dtype: str = "bf16", activation: str = "silu",
                   deterministic: bool = False):
    bm, bn_gu, bn_dn, bk, warps, stages, persistent = W4A16_TILES[tile]
    bn = bn_gu if gated else bn_dn
    consts = dict(GATED=gated, ACTIVATION=activation, DETERMINISTIC=deterministic, USE_TMA=use_tma, DECODE=0,
                  PERSISTENT=persistent, STAGES=stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                  MMA_WARPS_M=warps // 2)
    rep = compile_kernel(W4A16_KERNEL, g16.signature(gated, use_tma, bn, bk, dtype), consts,
                         divisible=g16.divisible(use_tma), gluon=True, num_warps=warps)
    print(rep.summary(), tile, "gate_up" if gated else "down", "tma" if use_tma else "ptr")
    return rep


@pytest.mark.compile
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "ptr"])
@pytest.mark.parametrize("gated", [True, False], ids=["gate_up", "down"])
@pytest.mark.parametrize("tile", list(W4A16_TILES))
def test_w4a16_compiles_for_sm120(tile, gated, use_tma):
    if not use_tma and tile != "bm64":
        pytest.skip("pointer-load loader: one tile is enough (the odd shapes it serves are small)")
    rep = _compile_w4a16(gated, use_tma, tile)
    rep.require_no_local().require_smem()
    rep.require_ptx(r"setmaxnreg")  # loader and decode warps give registers to the mma warps
    rep.require_ptx(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32").require_ptx(r"ldmatrix")
    rep.require_ptx(r"mbarrier\.try_wait")
    # The decode is sm_120's native cvt (DECODE=0); the portable table is what the H200 runs.
    rep.require_ptx(r"cvt\.rn\.bf16x2\.e2m1x2")
    if use_tma:
        rep.require_ptx(PTX_TMA_LOAD)
    else:
        assert not rep.has_ptx(PTX_TMA_LOAD)


def test_dispatch_gluon_tiles_are_the_compiled_ones():
    from vllm_nvfp4_sm120.dispatch.hw import Capability
    from vllm_nvfp4_sm120.dispatch.moe import all_moe_plans

    compiled = set(W4A16_TILES.values())
    gluon = [p for p in all_moe_plans(Capability(120)) if p.impl == "gluon" and p.kernel == "w4a16"]
    assert {p.block_m for p in gluon} == {64, 128}
    for p in gluon:
        assert p.gate_up.block_k == p.down.block_k and p.gate_up.num_warps == p.down.num_warps
        key = (p.block_m, p.gate_up.block_n, p.down.block_n, p.gate_up.block_k, p.gate_up.num_warps,
               p.gate_up.num_stages, p.gate_up.persistent)
        assert p.down.persistent == p.gate_up.persistent and not p.down.epilogue_warps
        assert key in compiled, key


@pytest.mark.compile
def test_w4a16_variants_compile():
    # fp16 activations, GELU, and the deterministic per-route store of the down GEMM.
    _compile_w4a16(True, True, "bm64", "fp16", "gelu_tanh").require_no_local().require_smem().require_ptx(
        r"cvt\.rn\.f16x2\.e2m1x2")
    _compile_w4a16(False, True, "bm64-persistent", deterministic=True).require_no_local().require_smem()


def test_w4a16_launcher_checks():
    from vllm_nvfp4_sm120.kernels.moe_align import MoeAlignment

    if not g16.HAS_GLUON:
        pytest.skip("no Gluon in this Triton")
    e, h, i, t, k = 2, 64, 32, 3, 2
    x = torch.zeros(t, h, dtype=torch.bfloat16)
    codes = torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8)
    scales = torch.zeros(e, 2 * i, h // 16, dtype=torch.float8_e4m3fn)
    dec = torch.ones(e)
    z = torch.zeros(8, dtype=torch.int32)
    align = MoeAlignment(z.repeat(16), z, z[:1], 64, t * k, k)
    tile = dict(block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="block_k"):
        g16.gluon_moe_w4a16_gate_up(x, codes, scales, dec, align, **(tile | dict(block_k=32)))
    with pytest.raises(ValueError, match="shared memory"):
        g16.gluon_moe_w4a16_gate_up(x, codes, scales, dec, align, **(tile | dict(block_n=256, num_stages=3)))
    with pytest.raises(TypeError, match="x: expected dtype"):
        g16.gluon_moe_w4a16_gate_up(x.float(), codes, scales, dec, align, **tile)
    # T = 0: nothing to launch, the empty intermediate comes back.
    empty = MoeAlignment(z, z, z[:1], 64, 0, k)
    assert g16.gluon_moe_w4a16_gate_up(x[:0], codes, scales, dec, empty, **tile).shape == (0, i)


# ------------------------------------------------------------------------------------------------------------
# GPU: the full layer against moe_ref (weights generated on the GPU: the CPU quantizer is too slow at 128 experts)
# ------------------------------------------------------------------------------------------------------------
TOKENS = [0, 3, 64, 512]


def _run_w4a16(x, w13, d13, w2, d2, tw, ti, e, tile, *, use_tma=None, activation="silu", deterministic=False):
    from vllm_nvfp4_sm120.kernels.moe_align import moe_align, moe_sum

    bm, bn_gu, bn_dn, bk, warps, stages, persistent = W4A16_TILES[tile]
    t, h = x.shape
    k = ti.shape[1]
    i = w2.codes.shape[2] * 2
    kw = dict(block_k=bk, group_m=8, num_warps=warps, num_stages=stages, persistent=persistent)
    align = moe_align(ti, e, bm)
    tma_gu = h % bk == 0 if use_tma is None else use_tma
    tma_dn = i % bk == 0 if use_tma is None else use_tma
    inter = g16.gluon_moe_w4a16_gate_up(x, w13.codes, w13.scales, d13, align, activation=activation,
                                        block_n=bn_gu, use_tma=tma_gu, **kw)
    acc = torch.zeros((t * k if deterministic else t, h), dtype=torch.float32, device=x.device)
    g16.gluon_moe_w4a16_down(inter, w2.codes, w2.scales, d2, tw, align, acc, deterministic=deterministic,
                             block_n=bn_dn, use_tma=tma_dn, **kw)
    return moe_sum(acc, k if deterministic else 1, torch.empty_like(x))


@pytest.mark.gpu
@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "odd"])
@pytest.mark.parametrize("tile", list(W4A16_TILES))
def test_w4a16_layer(tile, name, t, skewed):
    from vllm_nvfp4_sm120.format import moe_ref

    h, i, e, k, w13, d13, w2, d2 = layer(name)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = routing(t, e, k, skewed)
    out = _run_w4a16(x, w13, d13, w2, d2, tw, ti, e, tile)
    assert_moe_close(out, moe_ref(x, w13, d13, w2, d2, tw, ti))


@pytest.mark.gpu
@pytest.mark.parametrize("tile", ["bm64", "bm64-persistent"])
def test_w4a16_pointer_loader_fp16_gelu_deterministic(tile):
    # The non-TMA loader on the large shape, fp16, GELU, row-strided input, the deterministic per-route store.
    from vllm_nvfp4_sm120.format import moe_ref

    h, i, e, k, w13, d13, w2, d2 = layer("qwen3-30b-a3b")
    t = 64
    x = torch.randn(t + 3, h + 64, device="cuda", dtype=torch.float16)[:t, :h]
    tw, ti = routing(t, e, k, False, seed=1)
    args = (x, w13, d13, w2, d2, tw, ti, e, tile)
    a = _run_w4a16(*args, use_tma=False, activation="gelu_tanh", deterministic=True)
    b = _run_w4a16(*args, use_tma=False, activation="gelu_tanh", deterministic=True)
    assert torch.equal(a, b)
    assert_moe_close(a, moe_ref(x, w13, d13, w2, d2, tw, ti, activation="gelu_tanh"))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [64, 256], ids=["64-per-expert", "256-per-expert"])
@pytest.mark.parametrize("name", ["qwen3-235b-a22b", "deepseek-v3", "qwen3-next-80b"])
def test_w4a16_dispatch_tiles_real_shapes(name, m):
    # The sm_120 dispatch's Gluon plan for the other benchmarked MoE checkpoints at BLOCK_M 64 and 128.
    from vllm_nvfp4_sm120.dispatch.hw import Capability
    from vllm_nvfp4_sm120.dispatch.moe import as_gluon, select_moe_plan
    from vllm_nvfp4_sm120.format import moe_ref

    h, i, e, k, w13, d13, w2, d2 = layer(name)
    t = -(-m * e // k)
    plan = as_gluon(select_moe_plan(Capability(120), num_tokens=t, top_k=k, global_experts=e, hidden=h, intermediate=i,
                                    w4a4=False), i)
    key = (plan.block_m, plan.gate_up.block_n, plan.down.block_n, plan.down.block_k, plan.down.num_warps,
           plan.down.num_stages, plan.down.persistent)
    tile = next(name for name, value in W4A16_TILES.items() if value == key)
    assert plan.block_m == (64 if m == 64 else 128)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    tw, ti = routing(t, e, k, False)
    out = _run_w4a16(x, w13, d13, w2, d2, tw, ti, e, tile)
    assert_moe_close(out, moe_ref(x, w13, d13, w2, d2, tw, ti))
