"""The MoE layer flow against format.moe_ref, for every plan the dispatch can return (interpreter on CPU).

GPU plans run here with their tiles and TMA switches but with the interpreter-safe decodes (pure-``tl`` e2m1
decode; W4A4 self-decode + fp16 MMA): those switches change instructions, not indexing.  fp16 only (bf16
``tl.dot`` is wrong in the interpreter).
"""

from dataclasses import replace

import pytest
import torch

from vllm_nvfp4_sm120.dispatch import moe_flow
from vllm_nvfp4_sm120.dispatch.hw import NO_GPU, Capability
from vllm_nvfp4_sm120.dispatch.moe import (
    DECODE_STREAM_DOWN_TILES,
    W4A4_MIN_TOKENS_PER_EXPERT,
    DecodeDown,
    all_moe_plans,
    decode_tier_plan,
    fused_decode_plan,
    select_moe_plan,
)
from vllm_nvfp4_sm120.kernels.moe_decode import DecodeTile

SM120, SM90 = Capability(120), Capability(90)
from vllm_nvfp4_sm120.dispatch.moe_flow import nvfp4_moe
from vllm_nvfp4_sm120.format import GlobalScale, make_moe_bank, moe_ref, topk_route


def _interpretable(plan):
    return replace(plan, fast_decode=False, decode=True)


def _plans():
    seen, out = set(), []
    for cap in (NO_GPU, SM120, SM90):
        for p in all_moe_plans(cap):
            if p.impl in ("gluon", "decode"):
                continue  # Gluon: not in the interpreter (test_gluon_moe.py on a GPU); decode plans: below
            p = _interpretable(p)
            # Stages and warps do not change what the interpreter computes; TMA is covered on both GEMMs at once.
            key = (p.kernel, p.block_m, p.gate_up.block_n, p.gate_up.block_k, p.down.block_n, p.down.block_k,
                   p.gate_up.use_tma, p.down.use_tma)
            if p.gate_up.use_tma != p.down.use_tma or key in seen:
                continue
            seen.add(key)
            out.append(pytest.param(p, id=f"{p.tier}-bm{p.block_m}-tma{int(p.gate_up.use_tma)}"))
    return out


def make_layer(e, h, i, gen):
    w13, d13 = make_moe_bank(e, 2 * i, h, gen=gen)
    w2, d2 = make_moe_bank(e, h, i, gen=gen)
    return w13, d13, w2, d2


def routing(t, e, top_k, gen, skewed=False):
    if skewed:  # every token on experts 0..k-1
        ids = torch.arange(top_k, dtype=torch.int32).expand(t, top_k).contiguous()
        return torch.softmax(torch.randn(t, top_k, generator=gen), -1), ids
    return topk_route(torch.randn(t, e, generator=gen), top_k)


def run_case(plan, t, top_k, gen, *, e=4, h=128, i=64, skewed=False, expert_map=None, activation="silu",
             deterministic=False, strided=False):
    w13, d13, w2, d2 = make_layer(e, h, i, gen)
    global_e = expert_map.numel() if expert_map is not None else e
    x = torch.randn(t, h + 32 if strided else h, generator=gen).half()[:, :h]
    tw, ti = routing(t, global_e, top_k, gen, skewed)
    kw, ref_kw = {}, {}
    if plan.kernel == "w4a4":
        a13 = GlobalScale.of(x) if t else GlobalScale.from_encode(1.0)
        a2 = GlobalScale.from_amax(8.0)
        kw = dict(a13_enc=a13.enc.reshape(1), a2_enc=a2.enc.reshape(1))
        ref_kw = dict(a13_gs=a13, a2_gs=a2)
    out = nvfp4_moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, expert_map=expert_map,
                    activation=activation, deterministic=deterministic, plan=plan, **kw)
    ref = moe_ref(x, w13, d13, w2, d2, tw, ti, expert_map=expert_map, activation=activation, **ref_kw)
    assert_moe_close(out, ref)
    return out


def assert_moe_close(out, ref):
    # Kernel and reference differ only in fp32 summation order (and, rarely, the last-bit rounding of the
    # intermediate that follows from it), which is absolute in the sums: the floor scales with the output.
    atol = 2.0**-10 * float(ref.float().abs().max()) if ref.numel() else 0.0
    torch.testing.assert_close(out, ref, atol=atol, rtol=2.0**-9)


@pytest.mark.parametrize("plan", _plans())
def test_every_plan_matches_reference(plan, gen):
    run_case(plan, 16, 3, gen)


W4A16 = _interpretable(select_moe_plan(NO_GPU, num_tokens=1, top_k=1, global_experts=4, hidden=128,
                                       intermediate=64, w4a4=False))
W4A4 = _interpretable(select_moe_plan(NO_GPU, num_tokens=64, top_k=2, global_experts=4, hidden=128,
                                      intermediate=64, w4a4=True))


@pytest.mark.parametrize("plan", [W4A16, W4A4], ids=["w4a16", "w4a4"])
@pytest.mark.parametrize("t,top_k", [(0, 2), (1, 1), (3, 2), (16, 3)])
@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
def test_tokens_and_routing(plan, t, top_k, skewed, gen):
    run_case(plan, t, top_k, gen, skewed=skewed)


@pytest.mark.parametrize("plan", [W4A16, W4A4], ids=["w4a16", "w4a4"])
def test_expert_map_gelu_deterministic_strided(plan, gen):
    # 8 global experts, this rank holds 4 of them; routes to the others contribute nothing.
    expert_map = torch.tensor([-1, 0, -1, 1, 2, -1, 3, -1], dtype=torch.int32)
    a = run_case(plan, 16, 3, gen, expert_map=expert_map, activation="gelu_tanh", deterministic=True,
                 strided=True, h=96, i=48)
    assert a.shape == (16, 96)


@pytest.mark.parametrize("plan", [W4A16, W4A4], ids=["w4a16", "w4a4"])
def test_deterministic_is_bitwise_repeatable(plan, gen):
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = run_case(plan, 16, 3, g1, deterministic=True)
    b = run_case(plan, 16, 3, g2, deterministic=True)
    assert torch.equal(a, b)


def test_cpu_without_plan_is_the_reference(gen):
    w13, d13, w2, d2 = make_layer(4, 64, 32, gen)
    x = torch.randn(8, 64, generator=gen).half()
    tw, ti = topk_route(torch.randn(8, 4, generator=gen), 2)
    a13, a2 = GlobalScale.of(x), GlobalScale.from_amax(8.0)
    out = nvfp4_moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti,
                    a13_enc=a13.enc.reshape(1), a2_enc=a2.enc.reshape(1))
    # 8 tokens x top-2 over 4 experts = 4 per expert: W4A4 from W4A4_MIN_TOKENS_PER_EXPERT on.
    assert W4A4_MIN_TOKENS_PER_EXPERT == 4
    torch.testing.assert_close(out, moe_ref(x, w13, d13, w2, d2, tw, ti, a13_gs=a13, a2_gs=a2), atol=0, rtol=0)
    small = nvfp4_moe(x[:1], w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw[:1], ti[:1],
                      a13_enc=a13.enc.reshape(1), a2_enc=a2.enc.reshape(1))
    torch.testing.assert_close(small, moe_ref(x[:1], w13, d13, w2, d2, tw[:1], ti[:1]), atol=0, rtol=0)


def test_dispatch_tiers():
    def plan(t, w4a4=True, cap=SM120, h=2048, i=768, e=128):
        return select_moe_plan(cap, num_tokens=t, top_k=8, global_experts=e, hidden=h, intermediate=i, w4a4=w4a4)

    # decode rows: test_dispatch_decode_rows.  Above its T = 64, below 4 routes per expert: the W4A16 tier.
    assert plan(1).impl == "decode" and plan(72, e=256).impl == "triton"
    assert plan(72, e=256).kernel == "w4a16" and plan(72, e=256).block_m == 16 and plan(72, e=256).stream_weights
    assert plan(64).kernel == "w4a4" and plan(64).block_m == 16  # 4 tokens per expert
    assert plan(8192).block_m == 128 and plan(8192, w4a4=False).gate_up.use_tma
    assert not plan(8192, w4a4=False, h=2112).gate_up.use_tma and plan(8192, w4a4=False, h=2112).down.use_tma
    assert plan(4096, cap=SM90).decode is False and plan(4096, cap=NO_GPU).decode is True
    assert all(p.kernel in ("w4a16", "w4a4") for cap in (NO_GPU, SM90, SM120) for p in all_moe_plans(cap))


@pytest.mark.parametrize("w4a4", [False, True], ids=["w4a16", "w4a4"])
def test_dispatch_gluon_on_sm120(w4a4, monkeypatch):
    from vllm_nvfp4_sm120.kernels.gluon_compat import ENV_DISABLE, HAS_GLUON

    def plan(t, cap=SM120, i=768):
        return select_moe_plan(cap, num_tokens=t, top_k=8, global_experts=128, hidden=2048, intermediate=i,
                               w4a4=w4a4)

    if not HAS_GLUON:
        pytest.skip("no Gluon in this Triton")
    monkeypatch.delenv(ENV_DISABLE, raising=False)
    p64, p128 = plan(1024), plan(8192)  # 64 and 512 routes per expert
    assert (p64.block_m, p64.impl, p128.block_m, p128.impl) == (64, "gluon", 128, "gluon")
    assert p64.kernel == p128.kernel == ("w4a4" if w4a4 else "w4a16")
    assert p64.gate_up.persistent and p64.down.persistent and not p128.gate_up.persistent
    assert p64.gate_up_kwargs()["persistent"] and not p128.down_kwargs()["persistent"]
    # The persistent W4A4 down GEMM below I = 1024: separate epilogue warps; from 1024 on, and at BLOCK_M 128, not.
    assert bool(p64.down.epilogue_warps) == w4a4 and ("epilogue_warps" in p64.down_kwargs()) == w4a4
    assert "epilogue_warps" not in p64.gate_up_kwargs() and p128.down.epilogue_warps == 0
    assert plan(1024, i=1024).down.epilogue_warps == 0 and plan(1024, i=1024).down.persistent
    if w4a4:  # the launcher picks native block-scaled MMA on sm_120, the exact emulation elsewhere
        assert p128.gate_up_kwargs()["decode"] is None and p128.down_kwargs()["decode"] is None
    # Triton below BLOCK_M 64, on other GPUs, and with the switch off.
    assert plan(128).impl == "triton" and plan(8192, cap=SM90).impl == "triton"
    monkeypatch.setenv(ENV_DISABLE, "1")
    assert plan(8192).impl == "triton" and plan(8192).down.epilogue_warps == 0


def test_bad_input_is_named(gen):
    w13, d13, w2, d2 = make_layer(2, 64, 32, gen)
    x = torch.randn(2, 64, generator=gen).half()
    tw, ti = topk_route(torch.randn(2, 2, generator=gen), 1)
    with pytest.raises(ValueError, match="a13_enc and a2_enc"):
        nvfp4_moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, a13_enc=torch.ones(1))
    with pytest.raises(ValueError, match="topk_weights: expected shape"):
        nvfp4_moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw[:1], ti)
    with pytest.raises(ValueError, match="w13_codes: expected shape"):
        nvfp4_moe(x, w13.codes[:, :, :16], w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, plan=W4A16)



# ---- the decode plan (align-free kernels) ----------------------------------------------------------------------
H200_SHAPES = {  # name: (H, I, E, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "qwen3-next-80b": (2048, 512, 512, 10),
}
# H not a power of two (a multiple of 256, as the decode table asks of H) and I not a multiple of 128, where the table
# runs the streaming gate_up and down (T = 3-8).
ODD_STREAM_SHAPES = {"odd-2304x704": (2304, 704, 60, 4)}


def _decode_plans():
    """Every decode gate_up tile and both down kernels, the expert-major one with and without TMA (the interpreter
    is slow: one case each; the kernels' own tests cover the rest)."""
    cases = {  # id: (T, H, I) as decode_tier_plan reads them
        "t1-expert-ptr": (1, 4096, 4096), "t2-expert-tma": (2, 4096, 512), "t8-token": (8, 4096, 512),
        "t32-expert-tma": (32, 4096, 4096),
        "t8-token-odd": (8, 4112, 496), "t4-expert-nontma": (4, 4112, 4112), "t2-wide-gate-up": (2, 7168, 4096),
    }
    out = []
    # The Triton gate_up tiles (the interpreter cannot run the streaming Gluon one; tests/kernels/
    # test_gluon_moe_decode.py and the GPU op tests below cover it).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_NVFP4_SM120_DISABLE_GLUON", "1")
        for name, (t, h, i) in cases.items():
            p = decode_tier_plan(SM90, t, hidden=h, intermediate=i)
            assert p in all_moe_plans(SM90)  # one the dispatch can return
            out.append(pytest.param(p, id=name))
    return out


DECODE_PLANS = _decode_plans()


def _decode_shape(plan):
    """Tiny shapes for the interpreter: K a multiple of 256 where the plan reads by TMA, else H, I not multiples of
    64 (masked K tails)."""
    return (256 if plan.gate_up.use_tma else 112), (256 if plan.down.use_tma else 96)


def test_decode_plans_cover_both_down_kernels_and_tma():
    from vllm_nvfp4_sm120.dispatch.moe import DECODE_GATE_UP_TILES

    assert {p.values[0].gate_up for p in DECODE_PLANS} == set(DECODE_GATE_UP_TILES.values())
    kinds = {(p.values[0].decode_down, p.values[0].down.use_tma) for p in DECODE_PLANS}
    assert kinds == {("expert", True), ("expert", False), ("token", False)}
    assert all(p.values[0].kernel == "w4a16" and p.values[0].block_m == 0 for p in DECODE_PLANS)


@pytest.mark.parametrize("plan", DECODE_PLANS)
def test_decode_plan_matches_reference(plan, gen):
    h, i = _decode_shape(plan)
    run_case(plan, 3, 2, gen, e=8, h=h, i=i)


@pytest.mark.parametrize("down", ["expert", "token"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_decode_expert_map_activations(down, activation, deterministic, gen):
    # 12 global experts, this rank holds 6 (-1: another rank's); 5 tokens x top-3 = 15 routes > 6 local experts
    # (the kernels' by-expert grid); x row-strided.
    plan = decode_tier_plan(SM90, 8 if down == "token" else 1, hidden=112, intermediate=96 if down == "expert" else 512)
    assert plan.decode_down == down
    emap = torch.tensor([-1, 0, 1, -1, 2, -1, 3, -1, -1, 4, 5, -1], dtype=torch.int32)
    i = 96 if down == "expert" else 80  # the explicit plan runs any I; 80: not a multiple of the tile either
    run_case(plan, 5, 3, gen, e=6, h=112, i=i, expert_map=emap, activation=activation, deterministic=deterministic,
             strided=True)


@pytest.mark.parametrize("t", [0, 1, 16])
def test_decode_tokens_and_skew(t, gen):
    plan = decode_tier_plan(SM90, max(t, 1), hidden=112, intermediate=96)
    run_case(plan, t, 2, gen, e=8, h=112, i=96, skewed=True)


@pytest.mark.parametrize("down", ["expert", "token"])
def test_decode_deterministic_is_bitwise_repeatable(down):
    plan = decode_tier_plan(SM90, 8, hidden=112, intermediate=4112 if down == "expert" else 512)
    assert plan.decode_down == down
    a = run_case(plan, 6, 2, torch.Generator().manual_seed(3), e=8, h=112, i=96, deterministic=True)
    b = run_case(plan, 6, 2, torch.Generator().manual_seed(3), e=8, h=112, i=96, deterministic=True)
    assert torch.equal(a, b)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_decode_plan_with_split_k_gate_up(deterministic, gen):
    # A split-K gate_up tile (a sweep candidate) runs through the flow unchanged: the launcher sizes its buffers (the
    # T = 1 tile has warps over K as well: 4 slices of 32 per 128-wide step, the second split empty at K = 112).
    plan = decode_tier_plan(SM90, 1, hidden=112, intermediate=96)
    plan = replace(plan, gate_up=replace(plan.gate_up, block_k=128, split_k=2))
    run_case(plan, 3, 2, gen, e=8, h=112, i=96, deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_decode_plan_with_split_k_down(deterministic, gen):
    # A split-K expert-major down tile: atomic mode runs it as given; deterministic mode (and batch invariance) runs
    # the per-route rows with the whole K in one program (the flow drops the split), bit-identical run to run.
    plan = decode_tier_plan(SM90, 1, hidden=112, intermediate=4112)
    assert plan.decode_down == "expert"
    plan = replace(plan, down=replace(plan.down, block_k=64, split_k=3))  # I = 176: 3 K tiles, one a split
    a = run_case(plan, 3, 2, torch.Generator().manual_seed(5), e=8, h=112, i=176, deterministic=deterministic)
    if deterministic:
        b = run_case(plan, 3, 2, torch.Generator().manual_seed(5), e=8, h=112, i=176, deterministic=True)
        assert torch.equal(a, b)


def test_deterministic_mode_runs_the_rows_triton_down_instead_of_the_streaming_one(gen):
    # The streaming down adds by fp32 atomics: deterministic mode (and batch invariance) runs the plan's Triton
    # expert-major down with its per-route rows, bit-identical run to run (here in the interpreter, where the
    # streaming Gluon kernel could not run at all).
    plan = decode_tier_plan(SM90, 4, hidden=112, intermediate=96)
    stream = DECODE_STREAM_DOWN_TILES["dns-m64t8-rw2-lc-c4"]
    plan = replace(plan, gate_up=decode_tier_plan(SM90, 2, hidden=112, intermediate=96).gate_up, stream_down=stream)
    moe_flow.clear()
    a = run_case(plan, 3, 2, torch.Generator().manual_seed(7), e=8, h=112, i=96, deterministic=True)
    b = run_case(plan, 3, 2, torch.Generator().manual_seed(7), e=8, h=112, i=96, deterministic=True)
    assert torch.equal(a, b)
    entries = list(moe_flow._CACHE.values())  # the call signatures this test made, each with the plan it ran
    assert entries and all(e.deterministic and e.plan.stream_down is None for e in entries)


def test_decode_strided_routing(gen):
    plan = decode_tier_plan(SM90, 1, hidden=112, intermediate=96)
    w13, d13, w2, d2 = make_layer(8, 112, 96, gen)
    x = torch.randn(3, 112, generator=gen).half()
    tw, ti = topk_route(torch.randn(3, 8, generator=gen), 2)
    tw_s, ti_s = tw.t().contiguous().t(), ti.t().contiguous().t()  # column-major views of the same values
    assert not ti_s.is_contiguous() and not tw_s.is_contiguous()
    out = nvfp4_moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw_s, ti_s, plan=plan)
    assert_moe_close(out, moe_ref(x, w13, d13, w2, d2, tw, ti))


def test_decode_bad_input_is_named(gen):
    plan = decode_tier_plan(SM90, 1, hidden=112, intermediate=96)
    w13, d13, w2, d2 = make_layer(4, 112, 96, gen)
    x = torch.randn(2, 112, generator=gen).half()
    tw, ti = topk_route(torch.randn(2, 4, generator=gen), 2)
    args = (w13.codes, w13.scales, d13, w2.codes, w2.scales, d2)
    with pytest.raises(ValueError, match=r"topk_ids: .*out of range|topk_ids: .*\[0, 4\)"):
        nvfp4_moe(x, *args, tw, ti + 4, plan=plan)
    with pytest.raises(ValueError, match="w2_codes: expected shape"):
        nvfp4_moe(x, w13.codes, w13.scales, d13, w2.codes[:, :, :8], w2.scales, d2, tw, ti, plan=plan)
    with pytest.raises(ValueError, match="w13_scales: expected shape"):
        nvfp4_moe(x, w13.codes, w13.scales[:, :, :3], d13, w2.codes, w2.scales, d2, tw, ti, plan=plan)
    with pytest.raises((TypeError, ValueError), match="x: expected dtype"):
        nvfp4_moe(x.float(), *args, tw, ti, plan=plan)


# The one-launch plan (DecodeDown.FUSED) on small tiles: gate_up of 16 stacked rows and a 16-row down over 4 warps
# (as kernels/test_moe_decode_fused.py), and the same tiles with two warps over K.
FUSED_TILES = {
    "w4": (DecodeTile(8, 32, 16, num_warps=4, num_stages=2, use_dot=True),
           DecodeTile(16, 32, 16, num_warps=4, num_stages=2, use_dot=True)),
    "kw2": (DecodeTile(8, 64, 16, num_warps=2, num_stages=2, use_dot=True, k_warps=2),
            DecodeTile(16, 64, 16, num_warps=2, num_stages=2, use_dot=True, k_warps=2)),
}


def _fused_plan(tiles="w4"):
    return fused_decode_plan(SM90, *FUSED_TILES[tiles], hidden=112, intermediate=96)


@pytest.mark.parametrize("tiles", list(FUSED_TILES))
@pytest.mark.parametrize("t,top_k,skewed", [(0, 2, False), (1, 1, False), (5, 3, False), (16, 2, True)])
def test_fused_decode_plan_matches_reference_and_two_launch_bits(tiles, t, top_k, skewed, gen):
    # The one launch computes what the two-launch plan with the deterministic expert-major down computes, bit for
    # bit, in either mode (its top-k sum is in slot order).
    fused = _fused_plan(tiles)
    assert (fused.decode_down, fused.impl, fused.tma) == ("fused", "decode", (False, False))
    two = replace(fused, decode_down=DecodeDown.EXPERT)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    kw = dict(e=8, h=112, i=96, skewed=skewed)
    a = run_case(fused, t, top_k, torch.Generator().manual_seed(seed), **kw)
    b = run_case(fused, t, top_k, torch.Generator().manual_seed(seed), deterministic=True, **kw)
    c = run_case(two, t, top_k, torch.Generator().manual_seed(seed), deterministic=True, **kw)
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_fused_decode_plan_expert_map_strided(activation, gen):
    # 12 global experts, 6 local (-1: another rank's): a token may have no local expert; x row-strided; I = 80
    # not a multiple of the tiles.
    emap = torch.tensor([-1, 0, 1, -1, 2, -1, 3, -1, -1, 4, 5, -1], dtype=torch.int32)
    run_case(_fused_plan(), 5, 3, gen, e=6, h=112, i=80, expert_map=emap, activation=activation, strided=True)


def test_fused_rows_pick_the_one_launch_plan(monkeypatch):
    from vllm_nvfp4_sm120.dispatch import moe as M

    before = decode_tier_plan(SM90, 2, hidden=2048, intermediate=768)
    monkeypatch.setitem(M._DECODE_FUSED_ROWS, SM90.family, ((2, 4096, "t2", "a measured row"),))
    plan = decode_tier_plan(SM90, 2, hidden=2048, intermediate=768)
    assert (plan.gate_up, plan.down) == M.DECODE_FUSED_PAIRS["t2"]
    assert (plan.decode_down, plan.tier) == ("fused", "sm90/decode/fused-t2")
    assert plan in all_moe_plans(SM90)
    # Outside the row (T, H) and on another family: the two-launch rows.
    assert decode_tier_plan(SM90, 3, hidden=2048, intermediate=768).decode_down != "fused"
    assert decode_tier_plan(SM90, 2, hidden=7168, intermediate=768).decode_down != "fused"
    assert decode_tier_plan(SM120, 2, hidden=2048, intermediate=768).decode_down != "fused"
    # What `env` / `inspect` print for it.
    from vllm_nvfp4_sm120.envinfo import moe_plan

    lines = dict(moe_plan((9, 0), w4a4=False, hidden=2048, intermediate=768, top_k=8, experts=128, tokens=(2, 3)))
    assert "align-free decode (gate_up and down in one launch)" in lines["T = 2 (0.125 rows/expert)"]
    assert "expert-major down" in lines["T = 3 (0.1875 rows/expert)"]
    monkeypatch.setitem(M._DECODE_FUSED_ROWS, SM90.family, ())
    assert decode_tier_plan(SM90, 2, hidden=2048, intermediate=768) == before


def test_fused_decode_plan_refuses_tiles_it_cannot_share():
    gate, down = FUSED_TILES["w4"]
    with pytest.raises(ValueError, match="down_tile: num_warps"):
        fused_decode_plan(SM90, gate, replace(down, num_warps=2), hidden=112, intermediate=96)
    with pytest.raises(ValueError, match="gate_up_tile: the fused decode layer takes"):
        fused_decode_plan(SM90, replace(gate, block_k=256, use_tma=True), down, hidden=112, intermediate=96)


def test_dispatch_decode_rows(monkeypatch):
    from vllm_nvfp4_sm120.dispatch import moe as M

    def plan(t, name="qwen3-30b-a3b", cap=SM90, w4a4=False, **over):
        h, i, e, k = H200_SHAPES[name]
        shape = dict(hidden=h, intermediate=i, global_experts=e, top_k=k) | over
        return select_moe_plan(cap, num_tokens=t, w4a4=w4a4, **shape)

    for cap in (SM90, SM120):
        for name in H200_SHAPES:
            for t in (1, 2, 3, 4, 8, 16, 32):
                h, i, e, k = H200_SHAPES[name]
                if t > M.DECODE_WIDE_MAX_TOKENS and t * k / e >= M.DECODE_LATE_MAX_ROUTES_PER_EXPERT:
                    assert plan(t, name, cap).impl != "decode", (cap, name, t)
                    continue
                for w4a4 in (False, True):  # weight-only for W4A4 checkpoints too
                    p = plan(t, name, cap, w4a4)
                    assert (p.impl, p.kernel, p.block_m) == ("decode", "w4a16", 0), (cap, name, t, w4a4)
                    # the expert-major down by TMA at I <= 512, and at T = 5-16 up to I = 768.
                    i = H200_SHAPES[name][1]
                    mid = 5 <= t <= 16 and i <= 768
                    assert p.down.use_tma == (p.decode_down == "expert" and (i <= M.DECODE_TMA_DOWN_MAX_I or mid))
                    assert p.down.shift_decode == (t > 2 or i > M.DECODE_TMA_DOWN_MAX_I)
                    # The streaming Gluon gate_up where it won on the H100 (runs 63-68, 83): H = 7168 at T = 1-8,
                    # H = 4096 at T = 2-8 (32 x 8), H = 2048 at T = 3-8 (64 x 8 over two row warps).
                    stream = t <= 8 and (h >= 7168 or (h >= 4096 and t >= 2) or (h >= 2048 and t >= 3))
                    name_ = "gus-m32t8" if h >= 4096 else "gus-m64t8-rw2"
                    assert (p.gate_up == M.DECODE_STREAM_GATE_UP_TILES[name_]) == stream, (cap, name, t)
                    assert ("stream" in p.tier.split("/")) == stream
                    # The streaming late-cast down where it won in the layer (H100 runs 73-75, 83-84): an
                    # expert-major down at H = 7168 at T = 1-8, H = 4096 at T = 2-8, H = 2048 at T = 3-8; the row's
                    # Triton down stays the plan's down (what deterministic mode runs).
                    sdown = p.decode_down == "expert" and t <= 8 and (h >= 7168 or (h >= 4096 and t >= 2) or t >= 3)
                    assert (p.stream_down == M.DECODE_STREAM_DOWN_TILES["dns-m64t8-rw2-lc-c4"]) == sdown, (name, t)
                    assert (p.stream_down is None) == (not sdown) and p.tier.endswith("/stream-down") == sdown
                    if stream:
                        assert p.tma[0] is False
                        continue
                    # otherwise the Triton gate_up by pointer loads (the narrow K step)
                    assert not p.gate_up.use_tma
                    wide = h >= M.DECODE_WIDE_GATE_UP_MIN_H and t <= M.DECODE_WIDE_GATE_UP_MAX_T
                    assert (p.gate_up == M.DECODE_GATE_UP_TILES[M.DECODE_WIDE_GATE_UP_TILE]) == wide
                    assert p.tier.endswith("/wide") == wide
                    assert p.gate_up.shift_decode == (t != 2 or wide)
                    assert p.gate_up.k_warps == (4 if t == 1 and not wide else 1)
            h, i, e, k = H200_SHAPES[name]  # T = 64: the decode plan's below 4 routes per expert (H200 run 26)
            assert (plan(64, name, cap).impl == "decode") == (64 * k / e < M.W4A4_MIN_TOKENS_PER_EXPERT)
            assert plan(128, name, cap).impl != "decode"
    # H = 7168: the streaming gate_up up to T = 8 (H100 run 63), the rows' tiles beyond; without Gluon the wide
    # Triton tile up to T = 8 (H200 run 43).
    assert all(plan(t, "deepseek-v3").gate_up == M.DECODE_STREAM_GATE_UP_TILES["gus-m32t8"] for t in (1, 2, 4, 8))
    assert plan(32, "deepseek-v3").gate_up == M.DECODE_GATE_UP_TILES["gu-n32k128-w2-st3-shift"]
    monkeypatch.setenv("VLLM_NVFP4_SM120_DISABLE_GLUON", "1")
    assert all(plan(t, "deepseek-v3").gate_up == M.DECODE_GATE_UP_TILES["gu-n32k128-w1-st3-shift"]
               for t in (1, 2, 4, 8))
    assert plan(8).gate_up == M.DECODE_GATE_UP_TILES["gu-n32k128-w2-st3-shift"]
    assert all(plan(t, name).stream_down is None for t in (1, 4, 8) for name in H200_SHAPES)
    monkeypatch.delenv("VLLM_NVFP4_SM120_DISABLE_GLUON")
    # I not a multiple of 128: the streaming down's K-tail variant spills under its cap, so the row's Triton down
    # serves (the streaming gate_up reads K = H and stays).
    for cap in (SM90, SM120):
        for i in (704, 768 + 64):
            p = plan(4, cap=cap, intermediate=i)
            assert p.stream_down is None and p.tier.endswith("/stream"), (cap, i, p.tier)
        assert plan(4, cap=cap, intermediate=768).stream_down is not None
    # What `env` / `inspect` print for the streaming down: its tile, not the row's Triton one.
    from vllm_nvfp4_sm120.envinfo import moe_plan

    lines = dict(moe_plan((12, 0), w4a4=False, hidden=2048, intermediate=768, top_k=8, experts=128, tokens=(2, 4)))
    assert "streaming expert-major down" in lines["T = 4 (0.25 rows/expert)"]
    assert "/ down streaming 64x8 [" in lines["T = 4 (0.25 rows/expert)"]
    assert "streaming" not in lines["T = 2 (0.125 rows/expert)"].split("/ down")[1]
    # below the measured H (2048) the Triton rows at every T
    assert decode_tier_plan(SM90, 8, hidden=1024, intermediate=768).gate_up == M.DECODE_GATE_UP_TILES[
        "gu-n32k128-w2-st3-shift"]
    assert [plan(1, "qwen3-235b-a22b").gate_up, plan(2).gate_up] == [
        M.DECODE_GATE_UP_TILES["gu-n16k256-kw4-st3-shift"], M.DECODE_GATE_UP_TILES["gu-n16k128-w2-st3"]]
    assert all(plan(t, "deepseek-v3").decode_down == "expert" for t in (1, 4, 32))
    # Qwen3-30B-A3B at T = 32 (2 routes per expert) is the decode plan's; 4 routes per expert are the tiers'.
    assert plan(32).impl == "decode" and plan(16).impl == "decode"
    assert plan(32, global_experts=64).impl != "decode"
    assert [plan(t, "qwen3-next-80b").decode_down for t in (1, 4, 5, 6, 8, 32)] == [
        "expert", "expert", "expert", "token", "token", "token"]
    assert plan(1).down == plan(4).down == M.DECODE_DOWN_TILES[M.DECODE_POINTER_DOWN_TILE]  # I = 768
    # ... but the TMA tile at T = 5-15 (H200 runs 69 and 71, H100 run 68), not on the wider layers, and the
    # token-major down at T = 16 (H100 run 87, H200 run 71)
    tma_down = M.DECODE_DOWN_TILES["exp-n64k256-w2-tma-st2-shift"]
    assert [plan(t).down == tma_down for t in (4, 5, 8, 15, 16, 17)] == [False, True, True, True, False, False]
    assert [plan(t).decode_down for t in (12, 15, 16, 17)] == ["expert", "expert", "token", "expert"]
    assert plan(16).down == M.DECODE_DOWN_TILES[M.DECODE_TOKEN_DOWN_TILE] and plan(16).stream_down is None
    assert plan(16, "qwen3-235b-a22b").decode_down == "expert"  # I = 1536
    assert plan(17).down == plan(4).down == M.DECODE_DOWN_TILES[M.DECODE_POINTER_DOWN_TILE]
    assert plan(6, "qwen3-235b-a22b").down == M.DECODE_DOWN_TILES[M.DECODE_POINTER_DOWN_TILE]  # I = 1536
    assert plan(6, intermediate=784).down == M.DECODE_DOWN_TILES[M.DECODE_POINTER_DOWN_TILE]
    assert plan(1, "qwen3-next-80b").down == M.DECODE_DOWN_TILES["exp-n32k256-w2-tma-st2"]  # I = 512
    assert plan(4, "qwen3-next-80b").down == M.DECODE_DOWN_TILES["exp-n64k256-w2-tma-st2-shift"]
    assert plan(8, "qwen3-next-80b").down == M.DECODE_DOWN_TILES[M.DECODE_TOKEN_DOWN_TILE]
    # Not decode: no rows for the GPU, 4+ routes per expert, K not TMA-readable, more routes than one id vector.
    for cap in (NO_GPU, Capability(80), Capability(100)):
        assert plan(1, cap=cap).impl != "decode"
    assert plan(32, global_experts=8, top_k=2).impl != "decode"  # 8 routes per expert
    assert plan(1, hidden=2112).impl != "decode" and plan(1, intermediate=776).impl == "decode"
    assert not plan(1, intermediate=776).down.use_tma
    assert plan(32, top_k=40, global_experts=4096).impl != "decode"  # 1280 routes
    # tier_plan names the decode plan as a measured config does (w4a16 / decode / BLOCK_M 0).
    assert M.tier_plan(SM90, M.MoeKernel.W4A16, 0, hidden=2048, intermediate=768, impl=M.Impl.DECODE,
                       num_tokens=8) == plan(8)
    assert M.tier_plan(SM90, M.MoeKernel.W4A4, 0, hidden=2048, intermediate=768, impl=M.Impl.DECODE) is None


def test_decode_plan_kwargs_bind():
    from vllm_nvfp4_sm120.dispatch.registry import MOE_KERNELS

    p = decode_tier_plan(SM120, 8, hidden=2048, intermediate=512)  # the token-major down
    gate_up, down = MOE_KERNELS[p.kernel, p.impl]
    assert p.gate_up_kwargs() == {"tile": p.gate_up} and p.down_kwargs() == {"tile": p.down, "by_expert": False}
    # one entry for both gate_up kernels: the tile's type picks the Triton or the streaming Gluon launcher, and
    # the flow's call binds to it either way
    import inspect

    from vllm_nvfp4_sm120.dispatch import moe as M

    assert gate_up.__name__ == "decode_gate_up" and p.gate_up == M.DECODE_STREAM_GATE_UP_TILES["gus-m64t8-rw2"]
    for tile in (p.gate_up, M.DECODE_GATE_UP_TILES["gu-n16k128-w2-st3"]):
        inspect.signature(gate_up).bind(None, None, None, None, None, expert_map=None, activation="silu", zero=None,
                                        down_bank=None, tile=tile)


def test_op_on_cpu_is_the_reference_at_decode_sizes(gen):
    from vllm_nvfp4_sm120.dispatch import moe_ops  # noqa: F401  (registers the op)

    w13, d13, w2, d2 = make_layer(8, 64, 32, gen)
    x = torch.randn(2, 64, generator=gen).half()
    tw, ti = topk_route(torch.randn(2, 8, generator=gen), 2)
    out = torch.empty_like(x)
    torch.ops.nvfp4_sm120.moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, None, None, None, "silu",
                              False, out)
    torch.testing.assert_close(out, moe_ref(x, w13, d13, w2, d2, tw, ti), atol=0, rtol=0)


# ---- GPU: the decode plan through the registered op on real shapes -----------------------------------------------
def _gpu_layer(name, t, *, with_map=False, dtype=torch.bfloat16, seed=0):
    from vllm_nvfp4_sm120.bench import gpu_nvfp4

    h, i, e, k = {**H200_SHAPES, **ODD_STREAM_SHAPES}[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13, w2 = gpu_nvfp4((e, 2 * i, h), gen), gpu_nvfp4((e, h, i), gen)
    d13 = 0.004 + 0.004 * torch.rand(e, device="cuda", generator=gen)
    d2 = 0.004 + 0.004 * torch.rand(e, device="cuda", generator=gen)
    global_e = 2 * e if with_map else e
    x = torch.randn(t, h, device="cuda", generator=gen).to(dtype)
    tw, ti = torch.softmax(torch.randn(t, global_e, device="cuda", generator=gen), -1).topk(k, -1)
    tw, ti = (tw / tw.sum(-1, keepdim=True)).float().contiguous(), ti.to(torch.int32).contiguous()
    emap = None
    if with_map:
        emap = torch.full((global_e,), -1, dtype=torch.int32, device="cuda")
        emap[1::2] = torch.arange(e, dtype=torch.int32, device="cuda")
    return x, w13, d13, w2, d2, tw, ti, emap


def _op(p, activation="silu", deterministic=False, out=None):
    from vllm_nvfp4_sm120.dispatch import moe_ops  # noqa: F401

    x, w13, d13, w2, d2, tw, ti, emap = p
    out = torch.empty_like(x) if out is None else out
    torch.ops.nvfp4_sm120.moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, None, None, emap,
                              activation, deterministic, out)
    return out


def _assert_gpu_close(out, ref):
    # The kernels' GPU tolerance (tests/kernels/moe_gpu_common.py): fp32 summation order and the last-bit rounding
    # of the 16-bit intermediate that follows from it, absolute in the sums; plus one bf16 ulp of the output.
    atol = 2.0**-8 * float(ref.float().abs().max()) if ref.numel() else 0.0
    torch.testing.assert_close(out, ref, atol=atol, rtol=2.0**-7)


def _gpu_ref(p, activation="silu"):
    x, w13, d13, w2, d2, tw, ti, emap = p
    return moe_ref(x, w13, d13, w2, d2, tw, ti, activation=activation, expert_map=emap)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 3, 5, 6, 8, 12, 16, 32])
@pytest.mark.parametrize("name", list(H200_SHAPES))
def test_gpu_op_runs_the_decode_plan(name, t):
    from vllm_nvfp4_sm120.dispatch.moe_flow import plan_for

    from vllm_nvfp4_sm120.dispatch import moe as M

    p = _gpu_layer(name, t)
    x, w13, _, w2, _, _, ti, _ = p
    h, i, e, k = H200_SHAPES[name]
    late = t > M.DECODE_WIDE_MAX_TOKENS and t * k / e >= M.DECODE_LATE_MAX_ROUTES_PER_EXPERT  # the tiers serve
    assert (plan_for(x, w13.codes, w2.codes, ti, w4a4=False).impl == "decode") != late
    _assert_gpu_close(_op(p), _gpu_ref(p))
    _assert_gpu_close(_op(p, deterministic=True), _gpu_ref(p))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("name,t", [("qwen3-30b-a3b", 3), ("qwen3-next-80b", 16), ("deepseek-v3", 5),
                                    ("odd-2304x704", 5)])
def test_gpu_op_decode_expert_map_fp16(name, t, activation):
    p = _gpu_layer(name, t, with_map=True, dtype=torch.float16)
    _assert_gpu_close(_op(p, activation), _gpu_ref(p, activation))


@pytest.mark.gpu
def test_gpu_odd_stream_shape_takes_the_streaming_gate_up():
    """The odd shape above is the streaming gate_up's case where Gluon runs (else the Triton rows'); its I = 704 (not
    a multiple of 128) keeps the row's Triton down."""
    from vllm_nvfp4_sm120.dispatch.moe_flow import plan_for
    from vllm_nvfp4_sm120.kernels.gluon_compat import gluon_enabled

    x, w13, _, w2, _, _, ti, emap = _gpu_layer("odd-2304x704", 5, with_map=True)
    plan = plan_for(x, w13.codes, w2.codes, ti, w4a4=False, expert_map=emap)
    assert plan.impl == "decode" and plan.decode_down == "expert"
    streams = gluon_enabled()
    assert plan.stream_down is None and plan.tier.endswith("/stream") == streams


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
@pytest.mark.parametrize("name,t", [("qwen3-30b-a3b", 1), ("qwen3-30b-a3b", 16), ("qwen3-next-80b", 8),
                                    ("qwen3-30b-a3b", 4), ("odd-2304x704", 6)])
def test_gpu_op_decode_graph_replay_equals_eager(name, t, deterministic):
    from vllm_nvfp4_sm120.dispatch.moe_flow import plan_for

    p = _gpu_layer(name, t, with_map=True)
    x, w13, _, w2, _, _, ti, emap = p
    plan = plan_for(x, w13.codes, w2.codes, ti, w4a4=False, expert_map=emap)
    assert plan.impl == "decode"
    token_major = plan.decode_down == "token"
    eager = _op(p, deterministic=deterministic)
    if deterministic:
        assert torch.equal(eager, _op(p, deterministic=True))
    out = torch.empty_like(eager)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _op(p, deterministic=deterministic, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _op(p, deterministic=deterministic, out=out)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        if deterministic or token_major:  # the token-major down is bit-identical in either mode
            assert torch.equal(out, eager)
        else:  # fp32 atomics: the last bits may differ between runs, never beyond the summation-order tolerance
            _assert_gpu_close(out, _gpu_ref(p))


# ---- bad inputs: every tensor checked before anything reads it, the same on CPU (the reference) and a GPU ---------

def _good_moe(gen):
    w13, d13, w2, d2 = make_layer(4, 64, 32, gen)
    x = torch.randn(3, 64, generator=gen).half()
    tw, ti = topk_route(torch.randn(3, 4, generator=gen), 2)
    return dict(x=x, w13_codes=w13.codes, w13_scales=w13.scales, w13_dec=d13, w2_codes=w2.codes,
                w2_scales=w2.scales, w2_dec=d2, topk_weights=tw, topk_ids=ti)


def _moe_with(**changes):
    return lambda a: {**a, **{k: v(a) for k, v in changes.items()}}


BAD_MOE = [
    ("x-fp32", _moe_with(x=lambda a: a["x"].float()), TypeError, r"x: expected dtype bfloat16 or float16, got float32"),
    ("x-1d", _moe_with(x=lambda a: a["x"][0]), ValueError, r"x: expected 2-D tensor"),
    ("w13-H", _moe_with(x=lambda a: torch.zeros(3, 96, dtype=torch.float16)), ValueError,
     r"w13_codes: expected shape \[E, \*, 48\], got \[4, 64, 32\]"),
    ("w13-2d", _moe_with(w13_codes=lambda a: a["w13_codes"][0]), ValueError, r"w13_codes: expected 3-D tensor"),
    ("w13-2I", _moe_with(w13_codes=lambda a: a["w13_codes"][:, :48].contiguous(),
                         w13_scales=lambda a: a["w13_scales"][:, :48].contiguous()), ValueError,
     r"w13_codes: 2I = 48 rows must be gate and up halves"),
    ("w13-scales", _moe_with(w13_scales=lambda a: a["w13_scales"][:, :, :2].contiguous()), ValueError,
     r"w13_scales: expected shape \[4, 64, 4\], got \[4, 64, 2\]"),
    ("w13-dec-E", _moe_with(w13_dec=lambda a: a["w13_dec"][:3]), ValueError, r"w13_dec: expected shape \[4\]"),
    ("w2-E", _moe_with(w2_codes=lambda a: a["w2_codes"][:3]), ValueError,
     r"w2_codes: expected shape \[4, 64, 16\] .* got \[3, 64, 16\]"),
    ("w2-H", _moe_with(w2_codes=lambda a: a["w2_codes"][:, :32].contiguous()), ValueError,
     r"w2_codes: expected shape \[4, 64, 16\]"),
    ("w2-I", _moe_with(w2_codes=lambda a: a["w2_codes"][:, :, :8].contiguous()), ValueError,
     r"w2_codes: expected shape \[4, 64, 16\] .* got \[4, 64, 8\]"),
    ("w2-scales", _moe_with(w2_scales=lambda a: a["w2_scales"][:2]), ValueError,
     r"w2_scales: expected shape \[4, 64, 2\]"),
    ("w2-dec-dtype", _moe_with(w2_dec=lambda a: a["w2_dec"].half()), TypeError, r"w2_dec: expected dtype float32"),
    ("topk-ids-float", _moe_with(topk_ids=lambda a: a["topk_ids"].float()), TypeError, r"topk_ids: expected dtype"),
    ("topk-weights-T", _moe_with(topk_weights=lambda a: a["topk_weights"][:2]), ValueError,
     r"topk_weights: expected shape \[3, 2\]"),
    ("a-enc-length", _moe_with(a13_enc=lambda a: torch.ones(2), a2_enc=lambda a: torch.ones(1)), ValueError,
     r"a13_enc: expected one fp32 encode scale"),
    ("expert-map-int64", _moe_with(expert_map=lambda a: torch.arange(4)), TypeError,
     r"expert_map: expected dtype int32, got int64"),
]


_POSITIONAL = ("x", "w13_codes", "w13_scales", "w13_dec", "w2_codes", "w2_scales", "w2_dec", "topk_weights",
               "topk_ids")


def _moe_call(a):
    positional = [a[k] for k in _POSITIONAL]
    return nvfp4_moe(*positional, **{k: v for k, v in a.items() if k not in _POSITIONAL})


@pytest.mark.parametrize("case", [pytest.param(c[1:], id=c[0]) for c in BAD_MOE])
def test_bad_moe_input_named_error_cpu(case, gen):
    change, exc, match = case
    good = _good_moe(gen)
    _moe_call(dict(good))
    with pytest.raises(exc, match=match):
        _moe_call(change(good))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [pytest.param(c[1:], id=c[0]) for c in BAD_MOE])
def test_bad_moe_input_named_error_gpu(case, gen):
    change, exc, match = case
    good = {k: v.cuda() for k, v in _good_moe(gen).items()}
    _moe_call(dict(good))
    with pytest.raises(exc, match=match):
        _moe_call({k: v.cuda() for k, v in change(good).items()})


@pytest.mark.gpu
def test_moe_bank_on_another_device(gen):
    a = {k: v.cuda() for k, v in _good_moe(gen).items()}
    a["w2_dec"] = a["w2_dec"].cpu()
    with pytest.raises(ValueError, match=r"w2_dec: expected a tensor on cuda"):
        _moe_call(a)
