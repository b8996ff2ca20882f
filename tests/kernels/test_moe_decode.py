"""Align-free decode MoE kernels (kernels/moe_decode.py) against format.moe_ref (weight-only form).

CPU: the kernels in the interpreter (fp16: the interpreter's bf16 ``tl.dot`` is wrong) on tiny shapes with I not a
multiple of the tile, H not a power of two, both activations, ``expert_map`` with -1, skewed routing (the chunk loop),
every down variant, the launchers' argument checks, the device sweep script end to end, and the native-convert decode
(sm_100+ / sm_120) through a PTX model.  ``compile``: every candidate of the sweep (benchmarks/moe_decode_sweep.py)
compiled for sm_120 with the intended instructions, and the dispatch's tiles with the native convert.
``gpu``: the real checkpoint shapes of moe_gpu_common on the same sources (the H200 runs the PTX decode, TMA and
programmatic dependent launch, which the interpreter cannot), CUDA-graph replay, and the PTX decode bit-exact.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from moe_gpu_common import assert_moe_close

from vllm_nvfp4_sm120.format import NvFp4, moe_ref, random_nvfp4
from vllm_nvfp4_sm120.kernels import moe_decode as md
from vllm_nvfp4_sm120.kernels.aot import PTX_TMA_LOAD, compile_kernel
from vllm_nvfp4_sm120.kernels.moe_decode import (
    DecodeTile,
    down_expert_workspace,
    moe_decode,
    moe_decode_down_expert,
    moe_decode_down_token,
    moe_decode_gate_up,
)


def load_benchmark(name: str):
    """benchmarks/NAME.py (a script, not a package), for the candidate tiles the compile and GPU tests cover."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SWEEP = load_benchmark("moe_decode_sweep")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Interpreter tiles: the smallest the kernels allow, so K and N tails and several K steps happen on tiny shapes.
DOT = DecodeTile(16, 32, 16, num_warps=4, num_stages=2, use_dot=True)
DOT_GATE = DecodeTile(8, 32, 16, num_warps=4, num_stages=2, use_dot=True)  # 16 stacked rows
FMA1 = DecodeTile(16, 32, 1, num_warps=4, num_stages=2, use_dot=False)
FMA2 = DecodeTile(16, 64, 2, num_warps=4, num_stages=2, use_dot=False)
DOT_TMA = DecodeTile(16, 256, 16, num_warps=4, num_stages=2, use_dot=True, use_tma=True)
# Split-K gate_up: K = 80 / 112 in 32-wide tiles = 3 / 4 tiles over 2 or 4 splits (an empty split at 4 x 1 of 3).
SPLIT2 = DecodeTile(16, 32, 16, num_warps=4, num_stages=2, use_dot=True, split_k=2)
SPLIT4_FMA = DecodeTile(16, 32, 1, num_warps=4, num_stages=2, use_dot=False, split_k=4)
SPLIT2_TMA = DecodeTile(16, 256, 16, num_warps=4, num_stages=2, use_dot=True, use_tma=True, split_k=2)
# Split-K expert-major down (atomic mode): I = 96 / 176 in 32-wide tiles = 3 / 6 tiles over 2, 3 or 4 splits (an
# empty split at 4 x 1 of 3, a partial last tile at 176).
DOWN_SPLIT2 = DecodeTile(16, 32, 16, num_warps=4, num_stages=2, use_dot=True, split_k=2)
DOWN_SPLIT3 = DecodeTile(16, 32, 16, num_warps=4, num_stages=2, use_dot=True, split_k=3)
DOWN_SPLIT4_FMA = DecodeTile(16, 32, 1, num_warps=4, num_stages=2, use_dot=False, split_k=4)
# 64 stacked rows over 4 warps with the shift decode: a wgmma on sm_90, which the shift decode cannot feed.
WGMMA_SHIFT = DecodeTile(32, 128, 16, num_warps=4, num_stages=2, use_dot=True, shift_decode=True)
# Warps over K: 2 slices of 32 (K = 80 / 112: the second slice of the last step partly or wholly past K), 4 of 32.
KW2 = DecodeTile(16, 64, 16, num_warps=2, num_stages=2, use_dot=True, k_warps=2)
KW4 = DecodeTile(16, 128, 16, num_warps=4, num_stages=2, use_dot=True, k_warps=4)
KW4_GATE = DecodeTile(8, 128, 16, num_warps=4, num_stages=2, use_dot=True, k_warps=4)  # 16 stacked rows
KW2_TMA = DecodeTile(16, 256, 16, num_warps=2, num_stages=2, use_dot=True, use_tma=True, k_warps=2)


def _problem(t, e, k, h, i, *, dtype=torch.float16, skewed=False, with_map=False, ids_dtype=torch.int32, seed=0):
    """Random banks (all code bytes, e4m3 scales over a range), x, softmax top-k routing; with a map, twice the
    experts globally and this rank holding every other one."""
    gen = torch.Generator().manual_seed(seed)
    w13 = random_nvfp4((e, 2 * i, h), gen=gen)
    w2 = random_nvfp4((e, h, i), gen=gen)
    d13 = 0.01 + 0.01 * torch.rand(e, generator=gen)
    d2 = 0.01 + 0.01 * torch.rand(e, generator=gen)
    x = (torch.randn(t, h, generator=gen) * 2).to(dtype)
    global_e = 2 * e if with_map else e
    logits = torch.randn(t, global_e, generator=gen)
    if skewed:
        logits[:, :k] += 100.0
    tw, ti = torch.softmax(logits, -1).topk(k, dim=-1)
    tw = (tw / tw.sum(-1, keepdim=True)).contiguous()
    ti = ti.to(ids_dtype).contiguous()
    emap = None
    if with_map:
        emap = torch.full((global_e,), -1, dtype=torch.int32)
        emap[1::2] = torch.arange(e, dtype=torch.int32)
    dev = lambda v: v.to(DEVICE) if v is not None else None  # noqa: E731
    return (dev(x), NvFp4(dev(w13.codes), dev(w13.scales)), dev(d13), NvFp4(dev(w2.codes), dev(w2.scales)), dev(d2),
            dev(tw), dev(ti), dev(emap))


def _run(p, gate_tile, down_tile, down, deterministic=False, activation="silu"):
    x, w13, d13, w2, d2, tw, ti, emap = p
    return moe_decode(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, gate_up_tile=gate_tile,
                      down_tile=down_tile, down=down, expert_map=emap, activation=activation,
                      deterministic=deterministic)


def _ref(p, activation="silu"):
    x, w13, d13, w2, d2, tw, ti, emap = p
    return moe_ref(x, w13, d13, w2, d2, tw, ti, activation=activation, expert_map=emap)


# ---------------------------------------------------------------------------------------------------------------
# CPU interpreter (or the GPU when present)
# ---------------------------------------------------------------------------------------------------------------
# (T, E, top_k, H, I, activation, gate tile, down kernel, deterministic, down tile, options)
CASES = [
    (0, 8, 2, 80, 96, "silu", DOT, "token", False, DOT, {}),
    (1, 8, 1, 80, 96, "silu", DOT_GATE, "expert", False, DOT, {}),
    (1, 60, 4, 112, 176, "gelu_tanh", FMA1, "token", False, FMA1, {}),
    (2, 8, 2, 112, 176, "silu", DOT, "expert", True, DOT, {"ids_dtype": torch.int64}),
    (3, 60, 2, 80, 96, "gelu_tanh", DOT, "token", False, DOT, {"with_map": True}),
    (3, 8, 4, 80, 96, "silu", FMA2, "expert", True, FMA2, {}),
    (5, 8, 2, 112, 96, "silu", DOT, "expert", False, DOT, {"with_map": True}),  # 10 slots > 8 experts: by expert
    (5, 60, 4, 80, 176, "silu", FMA1, "token", False, FMA1, {"skewed": True}),
    (16, 8, 4, 80, 96, "gelu_tanh", DOT, "token", False, DOT, {"skewed": True}),
    (16, 60, 2, 80, 96, "silu", FMA2, "expert", True, FMA2, {"skewed": True}),  # 16 routes per expert: 8 chunks
    (20, 8, 1, 80, 96, "silu", DOT, "expert", False, DOT, {"skewed": True}),  # 20 routes > BLOCK_T: 2 chunks
    (3, 8, 2, 256, 256, "silu", DOT_TMA, "token", False, DOT_TMA, {}),
    (3, 8, 2, 256, 256, "gelu_tanh", DOT_TMA, "expert", True, DOT_TMA, {"with_map": True}),
    (1, 8, 2, 80, 96, "silu", SPLIT2, "expert", False, DOT, {}),
    (3, 60, 2, 112, 96, "gelu_tanh", SPLIT2, "token", False, DOT, {"with_map": True}),
    (5, 8, 2, 80, 96, "silu", SPLIT4_FMA, "expert", False, DOT, {}),  # by expert; one split has no K tile
    (20, 8, 1, 112, 96, "silu", SPLIT2, "expert", True, DOT, {"skewed": True}),  # 2 chunks per program
    (3, 8, 2, 512, 256, "silu", SPLIT2_TMA, "expert", False, DOT_TMA, {}),
    (1, 8, 2, 80, 96, "silu", KW2, "expert", False, KW2, {}),
    (3, 8, 2, 112, 176, "gelu_tanh", KW4_GATE, "token", False, KW2, {"with_map": True}),
    (5, 8, 2, 112, 96, "silu", KW2, "expert", True, KW4, {}),
    (20, 8, 1, 80, 96, "silu", KW4, "expert", False, KW4, {"skewed": True}),  # 2 chunks per program
    (3, 8, 2, 256, 256, "silu", KW2_TMA, "expert", False, KW2_TMA, {}),
    (1, 8, 2, 80, 96, "silu", DOT, "expert", False, DOWN_SPLIT2, {}),
    (5, 8, 2, 112, 176, "gelu_tanh", DOT, "expert", False, DOWN_SPLIT3, {"with_map": True}),  # by expert
    (3, 60, 4, 80, 96, "silu", SPLIT2, "expert", False, DOWN_SPLIT4_FMA, {}),  # one split has no K tile
    (20, 8, 1, 80, 176, "silu", DOT, "expert", False, DOWN_SPLIT3, {"skewed": True}),  # 2 chunks per program
    (3, 8, 2, 256, 512, "silu", DOT_TMA, "expert", False, replace(DOT_TMA, split_k=2), {}),
]


def _case_id(c):
    t, e, k, h, i, act, gt, down, det, dt, opts = c
    kind = ("tma" if gt.use_tma else "dot" if gt.use_dot else f"fma{gt.block_t}") + (
        f"-split{gt.split_k}" if gt.split_k > 1 else "") + (f"-kw{gt.k_warps}" if gt.k_warps > 1 else "") + (
        f"-downsplit{dt.split_k}" if dt.split_k > 1 else "")
    extra = "-".join(f"{n}" for n, v in opts.items() if v is True) + ("-i64" if "ids_dtype" in opts else "")
    return f"T{t}-E{e}-k{k}-H{h}-I{i}-{act}-{kind}-{down}{'-det' if det else ''}{'-' + extra if extra else ''}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_layer_matches_reference(case):
    t, e, k, h, i, act, gate_tile, down, det, down_tile, opts = case
    p = _problem(t, e, k, h, i, **opts)
    out = _run(p, gate_tile, down_tile, down, det, act)
    assert out.shape == (t, h) and out.dtype == p[0].dtype
    assert_moe_close(out, _ref(p, act))


@pytest.mark.parametrize("down,tile", [("token", DOT), ("expert", DOT), ("token", FMA1)], ids=["token", "expert",
                                                                                          "token-fma"])
@pytest.mark.parametrize("gate", [DOT, SPLIT2], ids=["gate", "gate-split2"])
def test_deterministic_twice_identical(down, tile, gate):
    # Token-major always, expert-major in deterministic mode: the same bits on every run (split-K gate_up too:
    # its splits are summed in split order).
    p = _problem(5, 8, 4, 80, 96, with_map=True)
    a = _run(p, gate, tile, down, deterministic=True)
    b = _run(p, gate, tile, down, deterministic=True)
    assert torch.equal(a, b)
    assert_moe_close(a, _ref(p))


def test_gate_up_intermediate_and_zeroing():
    # The intermediate rows of routed slots equal the reference's rounded act(gate) * up; the zero argument is
    # cleared by the kernel's programs (a slice each).
    from vllm_nvfp4_sm120.format import unit_values
    from vllm_nvfp4_sm120.format.reference import gated_activation

    x, w13, d13, w2, d2, tw, ti, emap = _problem(3, 8, 2, 80, 96)
    zero = torch.full((3, 80), 7.0, device=DEVICE)
    inter = moe_decode_gate_up(x, w13.codes, w13.scales, d13, ti, tile=DOT, zero=zero)
    assert torch.equal(zero, torch.zeros_like(zero))
    for r, ex in enumerate(ti.reshape(-1).tolist()):
        h = (x[r // 2].float() @ unit_values(w13.codes[ex], w13.scales[ex]).t()) * d13[ex]
        torch.testing.assert_close(inter[r], gated_activation(h, "silu").to(x.dtype), atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------------------------------------------------------
# Argument checks (no kernel runs)
# ---------------------------------------------------------------------------------------------------------------
def _bad_input_cases():
    x, w13, d13, w2, d2, tw, ti, _ = _problem(2, 8, 2, 80, 96)
    gate = functools.partial(moe_decode_gate_up, tile=DOT)
    tok = functools.partial(moe_decode_down_token, tile=DOT)
    inter = torch.zeros(4, 96, dtype=x.dtype, device=x.device)
    return [
        ("x", lambda: gate(x.float(), w13.codes, w13.scales, d13, ti)),
        ("w13_codes", lambda: gate(x, w13.codes[:, :, :8], w13.scales, d13, ti)),
        ("w13_scales", lambda: gate(x, w13.codes, w13.scales[:, :-1], d13, ti)),
        ("w13_scales", lambda: gate(x, w13.codes, w13.scales.float(), d13, ti)),
        ("w13_dec", lambda: gate(x, w13.codes, w13.scales, d13[:-1], ti)),
        ("topk_ids", lambda: gate(x, w13.codes, w13.scales, d13, ti.float())),
        ("topk_ids", lambda: gate(x, w13.codes, w13.scales, d13, ti[:1])),
        ("topk_ids", lambda: gate(x, w13.codes, w13.scales, d13, ti.t())),
        ("topk_ids", lambda: gate(x, w13.codes, w13.scales, d13, ti + 8, check_ids=True)),  # out of range
        ("expert_map", lambda: gate(x, w13.codes, w13.scales, d13, ti, expert_map=torch.zeros(8))),
        ("activation", lambda: gate(x, w13.codes, w13.scales, d13, ti, activation="relu")),
        ("out", lambda: gate(x, w13.codes, w13.scales, d13, ti, out=inter[:3])),
        ("tile", lambda: moe_decode_gate_up(x, w13.codes, w13.scales, d13, ti,
                                            tile=DecodeTile(4, 32, 16, 4, 2, use_dot=True))),
        ("inter", lambda: tok(inter[:3], w2.codes, w2.scales, d2, ti, tw)),
        ("w2_codes", lambda: tok(inter, w2.codes[:, :, :40], w2.scales, d2, ti, tw)),
        ("w2_scales", lambda: tok(inter, w2.codes, w2.scales[:1], d2, ti, tw)),
        ("topk_weights", lambda: tok(inter, w2.codes, w2.scales, d2, ti, tw.half())),
        ("topk_weights", lambda: tok(inter, w2.codes, w2.scales, d2, ti, tw[:, :1])),
        ("workspace", lambda: moe_decode_down_expert(inter, w2.codes, w2.scales, d2, ti, tw,
                                                     torch.zeros(2 * 80, device=x.device), tile=DOT)),
        ("workspace", lambda: moe_decode_down_expert(inter, w2.codes, w2.scales, d2, ti, tw,
                                                     torch.zeros(2 * 80 + 2 * 5, device=x.device), tile=DOT,
                                                     deterministic=True)),
        ("down", lambda: moe_decode(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti,
                                    gate_up_tile=DOT, down_tile=DOT, down="sum")),
        ("w13_codes", lambda: gate(x, w13.codes, w13.scales, d13, ti, tile=DOT_TMA)),  # TMA needs K % 256 == 0
        # The shift decode on a dot Triton makes a wgmma on sm_90 (64k rows over 4k warps): refused everywhere.
        ("tile: gate_up with shift_decode", lambda: gate(x, w13.codes, w13.scales, d13, ti, tile=WGMMA_SHIFT)),
        ("tile: down_token with shift_decode", lambda: tok(inter, w2.codes, w2.scales, d2, ti, tw,
                                                          tile=replace(WGMMA_SHIFT, block_n=64))),
        ("tile: gate_up with shift_decode", lambda: md.prepare_moe_decode_gate_up(
            2, 80, 96, 8, 2, 8, x.device, tile=WGMMA_SHIFT, activation="silu", has_map=False, zero_numel=None)),
        # The down prefetch needs the down bank, of this layer's shape; a down kernel has no such switch.
        ("down_bank", lambda: gate(x, w13.codes, w13.scales, d13, ti, tile=replace(DOT, prefetch_down=True))),
        ("w2_codes", lambda: gate(x, w13.codes, w13.scales, d13, ti, tile=replace(DOT, prefetch_down=True),
                                  down_bank=(w2.codes[:, :, :40], w2.scales, d2))),
        ("w2_scales", lambda: gate(x, w13.codes, w13.scales, d13, ti, tile=replace(DOT, prefetch_down=True),
                                   down_bank=(w2.codes, w2.scales[:, :-1], d2))),
        ("tile: prefetch_down", lambda: tok(inter, w2.codes, w2.scales, d2, ti, tw,
                                            tile=replace(DOT, prefetch_down=True))),
        # K splits add into the atomic sums: neither the token-major nor the deterministic down has them.
        ("tile: split_k", lambda: tok(inter, w2.codes, w2.scales, d2, ti, tw, tile=DOWN_SPLIT2)),
        ("tile: split_k", lambda: moe_decode_down_expert(inter, w2.codes, w2.scales, d2, ti, tw,
                                                         torch.zeros(4 * 80, device=x.device), tile=DOWN_SPLIT2,
                                                         deterministic=True)),
    ]


@pytest.mark.parametrize("case", range(len(_bad_input_cases())))
def test_bad_input_names_the_tensor(case):
    name, call = _bad_input_cases()[case]
    with pytest.raises((ValueError, TypeError), match=name):
        call()


@pytest.mark.parametrize("h,programs", [(2048, 48), (2048, 96), (4096, 96), (7168, 64), (80, 6), (336, 2),
                                        (2048, 4096)])
def test_prefetch_rows_cover_the_down_rows(h, programs):
    # The programs of a grid row prefetch PF_ROWS down rows each, from part * PF_ROWS: together every row of the
    # expert, with under twice the rows one program needs at the least.
    rows = md.prefetch_rows_per_program(h, programs)
    assert rows & (rows - 1) == 0
    assert rows * programs >= h
    assert rows < 2 * -(-h // programs)


def test_prefetch_down_changes_no_result():
    # Through the layer (the interpreter has no prefetch instruction: the argument path and the launch key), the same
    # bits as the tile without it; the GPU test runs the prefetch itself.
    p = _problem(3, 8, 2, 80, 96, with_map=True)
    gate = DecodeTile(16, 32, 16, num_warps=1, num_stages=2, use_dot=True)
    down = DecodeTile(16, 32, 16, num_warps=1, num_stages=2, use_dot=True)
    a = _run(p, gate, down, "token")
    assert torch.equal(a, _run(p, replace(gate, prefetch_down=True), down, "token"))
    assert_moe_close(a, _ref(p))


def test_too_many_routes():
    x, w13, d13, *_ = _problem(1, 8, 2, 80, 96)
    ids = torch.zeros(md.MAX_ROUTES // 2 + 1, 2, dtype=torch.int32, device=DEVICE)
    ids[:, 1] = 1
    xs = torch.zeros(ids.shape[0], 80, dtype=x.dtype, device=DEVICE)
    with pytest.raises(ValueError, match="topk_ids"):
        moe_decode_gate_up(xs, w13.codes, w13.scales, d13, ids, tile=DOT)


@pytest.mark.parametrize("kwargs", [dict(block_n=24), dict(block_k=16), dict(block_t=8), dict(num_stages=0),
                                    dict(split_k=0), dict(split_k=9),
                                    dict(use_tma=True), dict(k_warps=4), dict(k_warps=3, num_warps=3),
                                    dict(k_warps=8, num_warps=8), dict(k_warps=2, num_warps=2, use_dot=False,
                                                                         block_t=1),
                                    dict(max_regs=100), dict(max_regs=256)],
                         ids=["block_n", "block_k", "block_t", "num_stages", "split_k-0", "split_k-9", "use_tma",
                              "k_warps-num_warps",
                              "k_warps-pow2", "k_warps-slice", "k_warps-fma", "max_regs-8", "max_regs-255"])
def test_tile_validation(kwargs):
    base = dict(block_n=16, block_k=128, block_t=16, num_warps=2, num_stages=3, use_dot=True)
    with pytest.raises(ValueError, match="DecodeTile"):
        DecodeTile(**(base | kwargs))


def test_register_cap_is_a_launch_option():
    base = dict(block_n=16, block_k=128, block_t=16, num_warps=2, num_stages=3, use_dot=True)
    assert DecodeTile(**base).launch_kwargs() == {"num_warps": 2, "num_stages": 3}
    assert DecodeTile(**base, max_regs=176, pdl=True).launch_kwargs(True) == {
        "num_warps": 2, "num_stages": 3, "maxnreg": 176, "launch_pdl": True}


# ---------------------------------------------------------------------------------------------------------------
# sm_120 compiles: every candidate tile of the sweep, the other switches on one tile
# ---------------------------------------------------------------------------------------------------------------
KERNELS = {  # name: (kernel, signature, divisible, weight box parts)
    "gate_up": ("_moe_decode_gate_up_kernel", md.MOE_DECODE_GATE_UP_SIGNATURE, md.MOE_DECODE_GATE_UP_DIVISIBLE, 2),
    "token": ("_moe_decode_down_token_kernel", md.MOE_DECODE_DOWN_TOKEN_SIGNATURE, md.MOE_DECODE_DOWN_TOKEN_DIVISIBLE,
              1),
    "expert": ("_moe_decode_down_expert_kernel", md.MOE_DECODE_DOWN_EXPERT_SIGNATURE,
               md.MOE_DECODE_DOWN_EXPERT_DIVISIBLE, 1),
}
ROUTING_CONSTS = {
    "gate_up": dict(ACTIVATION="silu", HAS_MAP=True, BY_EXPERT=False, ZERO=False, S_BLOCK=64, GDC=True),
    "token": dict(HAS_MAP=True, TOPK_BLOCK=8),
    "expert": dict(HAS_MAP=True, BY_EXPERT=False, DETERMINISTIC=False, S_BLOCK=64, TOPK_BLOCK=8),
}
SASS_PRMT = r"\bPRMT\b"
SASS_HMMA = r"\bHMMA\.16816\.F32\b"  # .BF16 for bf16, no suffix for fp16
SASS_FFMA = r"\bFFMA\b"
SASS_MUL_PAIRS = r"\bHMUL2\b|\bHFMA2\b"  # the block-scale multiply on packed pairs
SASS_CP_ASYNC_16B = r"LDGSTS\.E\.BYPASS\.128"


@functools.cache
def _compile(kind, tile: DecodeTile, extra: tuple = (), dtype: str = "bf16", arch: int = 120):
    name, sig, div, parts = KERNELS[kind]
    if tile.use_tma:
        sig, div = md.tma_signature(sig, div, parts, tile.block_n, tile.block_k)
    if dtype != "bf16":
        sig = {k: v.replace("bf16", dtype) for k, v in sig.items()}
    consts = ROUTING_CONSTS[kind] | dict(FAST_DECODE=True, EVEN_K=True) | tile.kernel_kwargs() | dict(extra)
    if kind != "gate_up":
        consts["PDL"] = tile.pdl
    if kind != "token":
        consts["SPLIT_K"] = tile.split_k
    if kind == "gate_up":
        consts |= dict(PREFETCH_DOWN=tile.prefetch_down, PF_ROWS=64)
    return compile_kernel(f"vllm_nvfp4_sm120.kernels.moe_decode:{name}", sig, consts, divisible=div, arch=arch,
                          num_warps=tile.num_warps, num_stages=tile.num_stages, maxnreg=tile.max_regs)


def _compile_jobs():
    jobs = [("gate_up", n, t) for n, t in SWEEP.GATE_UP.items()]
    # (the fused kernel's down items: test_moe_decode_fused.py compiles them in their pairs)
    jobs += [(kind, n, t) for n, (kind, _, t) in SWEEP.DOWN.items() if kind != "fused"]
    return jobs


def _check_sass(rep, tile: DecodeTile):
    rep.require_sass(SASS_PRMT).require_sass(SASS_MUL_PAIRS).require_no_local().require_smem()
    rep.require_sass(SASS_HMMA if tile.use_dot else SASS_FFMA)
    if tile.use_tma:
        rep.require_ptx(PTX_TMA_LOAD)
    if tile.pdl:  # the weight rows prefetched to L2, then the wait for the gate_up kernel
        rep.require_ptx(r"prefetch\.global\.L2").require_ptx(r"griddepcontrol\.wait")
    if tile.prefetch_down:  # the gate_up program's share of its expert's down rows (an L2 prefetch in SASS)
        rep.require_ptx(r"prefetch\.global\.L2").require_sass(r"\bCCTL\.E\.PF2\b")
    if tile.use_dot:  # the pipelined loads are 16-byte asynchronous copies (the activations at least)
        rep.require_sass(SASS_CP_ASYNC_16B)
    if tile.split_k > 1:  # the arrival count releases the partial sums; the last split reads them from L2
        rep.require_ptx(r"atom\.global\.gpu\.acq_rel\.add").require_ptx(r"ld\.global\.cg")


@pytest.mark.compile
@pytest.mark.parametrize("job", _compile_jobs(), ids=lambda j: f"{j[0]}-{j[1]}")
def test_sweep_candidates_compile_for_sm120(job):
    kind, _, tile = job
    _check_sass(_compile(kind, tile), tile)


def _dispatch_jobs():
    """Every decode tile the dispatch can pick (``dispatch.moe.all_moe_plans``), TMA and pointer variants."""
    from vllm_nvfp4_sm120.dispatch.hw import Capability
    from vllm_nvfp4_sm120.dispatch.moe import all_moe_plans

    jobs = {}
    for p in all_moe_plans(Capability(120)):
        # (a fused plan is one kernel: test_moe_decode_fused.py compiles the dispatch's pairs)
        if p.impl == "decode" and p.decode_down != "fused":
            if isinstance(p.gate_up, DecodeTile):  # (the streaming Gluon gate_up: test_gluon_moe_decode.py)
                jobs[("gate_up", p.gate_up)] = None
            jobs[(str(p.decode_down), p.down)] = None
    return list(jobs)


@pytest.mark.compile
@pytest.mark.parametrize("kind,tile", [
    ("gate_up", WGMMA_SHIFT), ("gate_up", replace(WGMMA_SHIFT, num_warps=2)),
    ("expert", replace(WGMMA_SHIFT, block_n=128)), ("expert", replace(WGMMA_SHIFT, block_n=128, num_warps=2)),
], ids=["gate_up-w4", "gate_up-w2", "down-w4", "down-w2"])
def test_shift_decode_refused_exactly_where_sm90_makes_a_wgmma(kind, tile):
    # The shift decode's PTX takes a thread's 4 code bytes as one memory word, which the mma_v2 operand layout
    # gives and the wgmma register operand does not (H200 run 43: wrong sums).  The refusal rule of
    # DecodeTile.check_rows agrees with the compiler: HGMMA in the sm_90 SASS exactly for the refused tiles.
    rows = 2 * tile.block_n if kind == "gate_up" else tile.block_n
    try:
        tile.check_rows(rows, kind)
        refused = False
    except ValueError:
        refused = True
    sass = _compile(kind, tile, arch=90).sass
    assert bool(re.search(r"\bHGMMA\b", sass)) == refused
    assert bool(re.search(r"\bHMMA\b", sass)) == (not refused)


@pytest.mark.compile
@pytest.mark.parametrize("job", _dispatch_jobs(), ids=lambda j: f"{j[0]}-n{j[1].block_n}k{j[1].block_k}"
                         f"w{j[1].num_warps}{'-tma' if j[1].use_tma else ''}")
def test_dispatch_decode_tiles_compile_for_sm120(job):
    kind, tile = job
    _check_sass(_compile(kind, tile), tile)


@pytest.mark.compile
@pytest.mark.parametrize("kind,extra,dtype", [
    ("gate_up", (("ACTIVATION", "gelu_tanh"), ("BY_EXPERT", True), ("ZERO", True), ("S_BLOCK", 1024)), "bf16"),
    ("gate_up", (("HAS_MAP", False), ("EVEN_K", False)), "fp16"),
    ("expert", (("DETERMINISTIC", True), ("BY_EXPERT", True), ("S_BLOCK", 1024)), "fp16"),
    ("expert", (("HAS_MAP", False), ("EVEN_K", False)), "bf16"),
    ("token", (("HAS_MAP", False), ("EVEN_K", False)), "fp16"),
], ids=["gate_up-gelu-by-expert-zero", "gate_up-fp16-tail", "expert-det-fp16", "expert-atomic-tail",
        "token-fp16-tail"])
def test_switches_compile_for_sm120(kind, extra, dtype):
    tile = DecodeTile(16, 256, 16, num_warps=2, num_stages=4, use_dot=True)
    rep = _compile(kind, tile, extra, dtype)
    _check_sass(rep, tile)
    if kind == "gate_up":  # lets a programmatically dependent down kernel start its prologue
        rep.require_ptx(r"griddepcontrol\.launch_dependents")
    if kind == "expert" and not dict(extra).get("DETERMINISTIC"):
        # Vector fp32 atomics, the acq_rel tile count, and the completed tile read from L2.
        rep.require_ptx(r"atom\.global\.gpu\.relaxed\.add\.v4\.f32").require_ptx(r"atom\.global\.gpu\.acq_rel\.add")
        rep.require_ptx(r"ld\.global\.cg")


# ---------------------------------------------------------------------------------------------------------------
# The native-convert decode (sm_100+ / sm_120): its PTX modelled exactly on CPU, every dispatch tile compiled with it
# ---------------------------------------------------------------------------------------------------------------
def test_decode_for_picks_the_native_convert_only_where_it_compiles():
    assert md.decode_for(12, 93) == md.DECODE_CVT  # sm_120 with Triton 3.8's own ptxas
    assert md.decode_for(10, 92) == md.DECODE_CVT
    assert md.decode_for(12, 90) == md.DECODE_PTX  # a CUDA 13.0 ptxas: no bf16 convert
    assert md.decode_for(12, 88) == md.DECODE_PTX
    assert md.decode_for(9, 93) == md.DECODE_PTX  # sm_90: no e2m1 convert
    assert md.decode_kind(torch.device("cpu")) == md.DECODE_TL


def _word(byte_values) -> int:
    return sum(b << (8 * i) for i, b in enumerate(byte_values))


@pytest.mark.parametrize("fmt", ["bf16", "f16"])
def test_cvt_decode_asm_is_exact_for_every_code_and_scale(fmt):
    # The scale pairs' asm (4 e4m3 bytes -> 4 (s, s) pairs), then the decode's (4 code bytes and their pairs -> 4
    # pairs of scaled weights), through the PTX model of test_gemv_stream: every code byte with every finite e4m3
    # scale (negative, zero and subnormal ones too) in every byte position, against the exact product rounded once.
    from test_gemv_stream import E2M1_MAG, bits_of_float, e4m3, run_ptx

    scales = [b for b in range(256) if b & 0x7F != 0x7F]
    scale_asm, decode_asm = md.SCALE_PAIRS_CVT_PTX[fmt].value, md.SCALED_CVT_PTX[fmt].value
    for g in range(0, len(scales), 4):
        sc = [scales[(g + i) % len(scales)] for i in range(4)]
        pairs = run_ptx(scale_asm, {"$4": _word(sc)})
        for w in range(256):
            codes = [(w + 64 * i) % 256 for i in range(4)]
            out = run_ptx(decode_asm, {"$4": _word(codes), **{f"${5 + i}": pairs[f"${i}"] for i in range(4)}})
            for i, (byte, scale) in enumerate(zip(codes, sc)):
                s_sign, s_mag = e4m3(scale)
                for half, code in enumerate((byte & 15, byte >> 4)):
                    want = bits_of_float((code >> 3) ^ s_sign, E2M1_MAG[code & 7] * s_mag, fmt)
                    got = out[f"${i}"] >> (16 * half) & 0xFFFF
                    assert got == want, f"{fmt}: code byte {byte:#04x} (position {i}) scale {scale:#04x}: " \
                        f"half {half} {got:#06x}, want {want:#06x}"


@pytest.mark.compile
@pytest.mark.parametrize("job", _dispatch_jobs(), ids=lambda j: f"{j[0]}-n{j[1].block_n}k{j[1].block_k}"
                         f"w{j[1].num_warps}{'-tma' if j[1].use_tma else ''}")
def test_dispatch_decode_tiles_compile_with_the_native_convert(job):
    # What an sm_120 GPU runs (the launchers turn the shift decode off there).  Per step of the K loop each code
    # byte is one e2m1 convert, each code word's scale half an e4m3 convert, and no integer decode is left: the
    # loop has 0.59-0.67 of the instructions of the same tile with the PTX decode (compiled for sm_120 at this
    # commit: e.g. 505 -> 317 for the T >= 4 gate_up, 970 -> 626 for the pointer-load down).
    from vllm_nvfp4_sm120.kernels.sass_stats import main_loop

    kind, tile = job
    rep = _compile(kind, replace(tile, shift_decode=False), (("FAST_DECODE", md.DECODE_CVT),))
    rep.require_ptx(r"cvt\.rn\.bf16x2\.e2m1x2").require_ptx(r"cvt\.rn\.bf16x2\.e4m3x2")
    rep.require_sass(SASS_MUL_PAIRS).require_sass(SASS_HMMA).require_no_local().require_smem()
    if tile.use_tma:
        rep.require_ptx(PTX_TMA_LOAD)
    loop, ptx_loop = main_loop(rep.sass), main_loop(_compile(kind, tile).sass)
    rows = 2 * tile.block_n if kind == "gate_up" else tile.block_n
    code_bytes = rows * tile.block_k // 2 // (32 * tile.num_warps)  # per thread and step
    assert loop.count(r"F2FP\.BF16\.E2M1\.UNPACK_B") == code_bytes
    assert loop.count(r"F2FP\.BF16\.E4M3\.UNPACK_B") * 8 == code_bytes
    # (the PTX decodes spend 2 or more LOP3 per code word; what is left is the loop's own bookkeeping)
    assert loop.count(r"LOP3.*") <= 2, dict(loop.ops)
    assert loop.total <= 0.7 * ptx_loop.total, (loop.total, ptx_loop.total)


@pytest.mark.compile
@pytest.mark.parametrize("kind", ["gate_up", "expert", "token"])
def test_native_convert_compiles_for_fp16_and_the_cuda_core_tile(kind):
    rep = _compile(kind, DecodeTile(32, 128, 16, num_warps=2, num_stages=3, use_dot=True),
                   (("FAST_DECODE", md.DECODE_CVT),), "fp16")
    rep.require_ptx(r"cvt\.rn\.f16x2\.e2m1x2").require_ptx(r"cvt\.rn\.f16x2\.e4m3x2")
    rep.require_sass(r"\bF2FP\.F16\.E2M1\.UNPACK_B\b").require_sass(SASS_HMMA).require_no_local().require_smem()
    # CUDA cores (block_t 1): the bf16 pairs widened to fp32 by shifts, as with the PTX decode.
    fma = _compile(kind, DecodeTile(16, 64, 1, num_warps=4, num_stages=2, use_dot=False),
                   (("FAST_DECODE", md.DECODE_CVT),))
    fma.require_ptx(r"cvt\.rn\.bf16x2\.e2m1x2").require_sass(SASS_FFMA).require_no_local().require_smem()


@pytest.mark.compile
def test_sum_kernel_compiles_for_sm120():
    for has_map in (False, True):
        rep = compile_kernel("vllm_nvfp4_sm120.kernels.moe_decode:_moe_decode_sum_kernel", md.MOE_DECODE_SUM_SIGNATURE,
                             dict(HAS_MAP=has_map, BLOCK_H=1024), divisible=md.MOE_DECODE_SUM_DIVISIBLE)
        rep.require_no_local().require_smem()


# ---------------------------------------------------------------------------------------------------------------
# GPU: real checkpoint shapes
# ---------------------------------------------------------------------------------------------------------------
GPU_TOKENS = [1, 2, 3, 5, 16, 64]
# The shapes of moe_gpu_common the GPU tests run: the four models and an odd one (H, I not multiples of 256).
GPU_SHAPES = ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "qwen3-next-80b", "odd"]
# Down variants of the GPU tests: (kernel, deterministic), each with its sweep candidate tile.
GPU_DOWN = {"token": ("tok-n16k256-w1", False), "expert": ("exp-n32k256-w2", False),
            "expert-det": ("exp-n32k256-w2-tma-det", True), "token-pdl": ("tok-n16k256-w1-pdl", False),
            "expert-pdl": ("exp-n16k256-w1-tma-pdl", False)}


def _gpu_tiles(h, i, gate_name="gu-n16k256-w2-tma", down="token"):
    gate = SWEEP.GATE_UP[gate_name]
    if gate.use_tma and not md.tma_ok(h):
        gate = SWEEP.GATE_UP["gu-n16k256-w2"]
    kind, det, dtile = SWEEP.DOWN[GPU_DOWN[down][0]]
    if dtile.use_tma and not md.tma_ok(i):
        dtile = replace(dtile, use_tma=False)
    return gate, kind, det, dtile


def _gpu_problem(name, t, *, skewed=False, dtype=torch.bfloat16, with_map=False):
    from moe_gpu_common import layer, routing

    h, i, e, k, w13, d13, w2, d2 = layer(name)
    x = torch.randn(t, h, device="cuda", dtype=dtype)
    tw, ti = routing(t, 2 * e if with_map else e, k, skewed)
    emap = None
    if with_map:
        emap = torch.full((2 * e,), -1, dtype=torch.int32, device="cuda")
        emap[1::2] = torch.arange(e, dtype=torch.int32, device="cuda")
    return h, i, (x, w13, d13, w2, d2, tw, ti, emap)


@functools.cache
def _gpu_problem_and_ref(name, t, activation="silu", **kwargs):
    """One problem and its reference per (shape, T, options): the reference is the slow part."""
    h, i, p = _gpu_problem(name, t, **kwargs)
    return h, i, p, _ref(p, activation)


@pytest.mark.gpu
@pytest.mark.parametrize("down", list(GPU_DOWN))
@pytest.mark.parametrize("t", GPU_TOKENS)
@pytest.mark.parametrize("name", GPU_SHAPES)
def test_gpu_layer(name, t, down):
    h, i, p, ref = _gpu_problem_and_ref(name, t)
    gate, kind, det, dtile = _gpu_tiles(h, i, down=down)
    assert_moe_close(_run(p, gate, dtile, kind, det), ref)


def _every_candidate():
    """Each gate_up candidate with the sweep's check down tile, each down candidate with its check gate_up tile (as
    the sweep checks them: a wrong kernel fails whichever partner it has)."""
    pairs = [(g, SWEEP.CHECK_DOWN) for g in SWEEP.GATE_UP]
    return pairs + [(SWEEP.CHECK_GATE_UP, d) for d, (kind, _, _) in SWEEP.DOWN.items()
                    if d != SWEEP.CHECK_DOWN and kind != "fused"]


@pytest.mark.gpu
@pytest.mark.parametrize("gate_name,down_name", _every_candidate(), ids=lambda v: v)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name,t", [("qwen3-30b-a3b", 4), ("qwen3-next-80b", 64)])
def test_gpu_every_sweep_candidate(name, t, dtype, gate_name, down_name):
    _, _, p, ref = _gpu_problem_and_ref(name, t, dtype=dtype)
    gate = SWEEP.GATE_UP[gate_name]
    kind, det, dtile = SWEEP.DOWN[down_name]
    assert_moe_close(_run(p, gate, dtile, kind, det), ref)


SPLIT_GATE_UP = [n for n, tile in SWEEP.GATE_UP.items() if tile.split_k > 1]


@pytest.mark.gpu
@pytest.mark.parametrize("gate_name", SPLIT_GATE_UP)
@pytest.mark.parametrize("t", [1, 2, 3, 16])
@pytest.mark.parametrize("name", GPU_SHAPES)
def test_gpu_split_k_gate_up(name, t, gate_name):
    # Every split's partial sums reach the last one to arrive, whatever the order: checked against the reference
    # and bit-identical twice (the splits are summed in split order).
    h, i, p, ref = _gpu_problem_and_ref(name, t)
    gate = SWEEP.GATE_UP[gate_name]
    if not md.tma_ok(h):
        gate = replace(gate, use_tma=False, block_k=256)
    _, kind, det, dtile = _gpu_tiles(h, i, down="expert-det")
    a = _run(p, gate, dtile, kind, det)
    assert_moe_close(a, ref)
    assert torch.equal(a, _run(p, gate, dtile, kind, det))


SPLIT_DOWN = [n for n, (kind, det, tile) in SWEEP.DOWN.items() if tile.split_k > 1 and kind != "fused"]


@pytest.mark.gpu
@pytest.mark.parametrize("down_name", SPLIT_DOWN)
@pytest.mark.parametrize("t", [1, 2, 3, 16])
@pytest.mark.parametrize("name", GPU_SHAPES)
def test_gpu_split_k_down(name, t, down_name):
    # Every split of every local expert adds into the token's sums before the last arrival casts them (atomic
    # mode: close to the reference, not bit-identical), with the table's T = 1 gate_up.
    h, i, p, ref = _gpu_problem_and_ref(name, t)
    gate, kind, det, dtile = _sweep_tiles("gu-n16k256-kw4-st3-shift", down_name, h, i)
    assert_moe_close(_run(p, gate, dtile, kind, det), ref)


def _sweep_tiles(gate_name, down_name, h, i):
    """``(gate_up tile, down kernel, deterministic, down tile)`` of two sweep candidates for banks with reduction sizes
    ``h`` and ``i``: TMA off where the bank's K cannot take it."""
    gate = SWEEP.GATE_UP[gate_name]
    kind, det, dtile = SWEEP.DOWN[down_name]
    return (replace(gate, use_tma=gate.use_tma and md.tma_ok(h)), kind, det,
            replace(dtile, use_tma=dtile.use_tma and md.tma_ok(i)))


KW_GATE_UP = [n for n, tile in SWEEP.GATE_UP.items() if tile.k_warps > 1]
KW_DOWN = [n for n, (kind, _, tile) in SWEEP.DOWN.items() if tile.k_warps > 1 and kind != "fused"]


@pytest.mark.gpu
@pytest.mark.parametrize("gate_name,down_name", list(zip(KW_GATE_UP, KW_DOWN * 2)), ids=lambda v: v)
@pytest.mark.parametrize("t", [1, 2, 3, 16])
@pytest.mark.parametrize("name", GPU_SHAPES)
def test_gpu_k_warps(name, t, gate_name, down_name):
    # The batched-MMA K slices of both kernels (the PTX decodes and TMA, which the interpreter cannot run) on every
    # shape, the odd one's tails included (TMA off where K % 256 != 0).
    h, i, p, ref = _gpu_problem_and_ref(name, t)
    gate, kind, det, dtile = _sweep_tiles(gate_name, down_name, h, i)
    assert_moe_close(_run(p, gate, dtile, kind, det), ref)


PFD_GATE_UP = [n for n, tile in SWEEP.GATE_UP.items() if tile.prefetch_down]


@pytest.mark.gpu
@pytest.mark.parametrize("gate_name", PFD_GATE_UP)
@pytest.mark.parametrize("t", [1, 2, 3, 16])
@pytest.mark.parametrize("name", GPU_SHAPES)
def test_gpu_prefetch_down_changes_no_result(name, t, gate_name):
    # The L2 prefetch of the down rows (every row of every touched expert, an expert map on the odd shape's ranks)
    # reads and writes nothing the layer uses: the same bits as the tile without it, and the reference's sums.
    h, i, p, ref = _gpu_problem_and_ref(name, t, with_map=name == "odd")
    gate, kind, det, dtile = _sweep_tiles(gate_name, "tok-n32k128-w1-st3-shift", h, i)
    a = _run(p, gate, dtile, kind, det)
    assert_moe_close(a, ref)
    assert torch.equal(a, _run(p, replace(gate, prefetch_down=False), dtile, kind, det))


# The shift decode needs 16-byte code rows (md.shift_ok); elsewhere the ready launchers run the table decode.  The odd
# shape's K = 336 / 80 (rows of 168 / 40 bytes) and I = 176 (DeepSeek-V2-Lite's 1408 over 8 ranks: 88-byte rows).
SHIFT_PAIRS = [("gu-n32k128-w2-st3-shift", "exp-n64k256-w2-tma-st2-shift"),
               ("gu-n16k256-kw4-st3-shift", "tok-n32k128-w1-st3-shift"),
               ("gu-n16k512-kw8-st2-shift", "exp-n32k256-kw4-tma-st2-shift")]


def _shift_problem(h, i, e, k, t):
    from moe_gpu_common import bank, routing

    w13, d13 = bank(e, 2 * i, h, 1)
    w2, d2 = bank(e, h, i, 2)
    tw, ti = routing(t, e, k, False)
    return (torch.randn(t, h, device="cuda", dtype=torch.bfloat16), w13, d13, w2, d2, tw, ti, None)




@pytest.mark.gpu
@pytest.mark.parametrize("gate_name,down_name", SHIFT_PAIRS, ids=lambda v: v)
@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("shape", [(336, 80, 6, 3), (2048, 176, 64, 6)], ids=["odd", "i176"])
def test_gpu_shift_decode_tiles_on_unaligned_rows(shape, t, gate_name, down_name):
    h, i, e, k = shape
    p = _shift_problem(h, i, e, k, t)
    gate, kind, det, dtile = _sweep_tiles(gate_name, down_name, h, i)
    assert_moe_close(_run(p, gate, dtile, kind, det), _ref(p))


@pytest.mark.gpu
def test_gpu_shift_decode_tiles_on_an_unaligned_bank_address():
    # Banks whose first byte is 8 bytes past a 16-byte boundary (views into larger buffers; rows still 16-byte
    # multiples): the ready launchers take the table decode for those calls, the aligned banks keep the shift one.
    h, i, e, k = 512, 256, 8, 2
    x, w13, d13, w2, d2, tw, ti, _ = _shift_problem(h, i, e, k, 3)

    def shifted(q):
        buf = torch.empty(q.codes.numel() + 8, dtype=torch.uint8, device="cuda")
        view = buf[8:].view(q.codes.shape)
        view.copy_(q.codes)
        assert view.data_ptr() % 16 == 8
        return NvFp4(view, q.scales)

    p = (x, w13, d13, w2, d2, tw, ti, None)
    q = (x, shifted(w13), d13, shifted(w2), d2, tw, ti, None)
    for gate_name, down_name in (("gu-n32k128-w2-st3-shift", "tok-n32k128-w1-st3-shift"),
                                 ("gu-n16k256-kw4-st3-shift", "exp-n32k256-kw4-st3")):
        gate, kind, det, dtile = _sweep_tiles(gate_name, down_name, h, i)
        ref = _ref(p)
        assert_moe_close(_run(p, gate, dtile, kind, det), ref)
        assert_moe_close(_run(q, gate, dtile, kind, det), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("down", list(GPU_DOWN))
@pytest.mark.parametrize("t", [1, 5, 64])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3", "odd"])
def test_gpu_fp16_gelu_map_skewed(name, t, down):
    h, i, p, ref = _gpu_problem_and_ref(name, t, "gelu_tanh", skewed=True, dtype=torch.float16, with_map=True)
    gate, kind, det, dtile = _gpu_tiles(h, i, down=down)
    assert_moe_close(_run(p, gate, dtile, kind, det, "gelu_tanh"), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("down", ["token", "expert-det", "token-pdl"])
def test_gpu_deterministic_and_graph_replay(down):
    h, i, p = _gpu_problem("qwen3-30b-a3b", 16, with_map=True)
    gate, kind, det, dtile = _gpu_tiles(h, i, down=down)
    eager = _run(p, gate, dtile, kind, det)
    assert torch.equal(eager, _run(p, gate, dtile, kind, det))
    x, w13, d13, w2, d2, tw, ti, emap = p
    out = torch.empty_like(x)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _run(p, gate, dtile, kind, det)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_decode(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, gate_up_tile=gate, down_tile=dtile,
                   down=kind, expert_map=emap, deterministic=det, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("down", ["expert", "expert-pdl"])
def test_gpu_atomic_graph_replay_close(down):
    # fp32 atomics: replays may differ in the last bits, never beyond the summation-order tolerance.
    h, i, p = _gpu_problem("deepseek-v3", 5)
    gate, kind, det, dtile = _gpu_tiles(h, i, down=down)
    x, w13, d13, w2, d2, tw, ti, emap = p
    out = torch.empty_like(x)
    _run(p, gate, dtile, kind, det)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_decode(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, gate_up_tile=gate, down_tile=dtile,
                   down=kind, out=out)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert_moe_close(out, _ref(p))


@pytest.mark.gpu
def test_gpu_out_of_range_ids_contribute_nothing():
    # Without the synchronizing check an id >= E is another rank's expert; with it, a ValueError.
    h, i, p = _gpu_problem("qwen3-30b-a3b", 5)
    x, w13, d13, w2, d2, tw, ti, _ = p
    e = w13.codes.shape[0]
    bad = ti.clone()
    bad[1, 2] = e + 3
    bad[3, 0] = -1
    gate, kind, det, dtile = _gpu_tiles(h, i)
    out = moe_decode(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, bad, gate_up_tile=gate,
                     down_tile=dtile, down=kind)
    emap = torch.arange(e + 4, dtype=torch.int32, device="cuda")
    emap[e:] = -1  # the reference's view of the same routing: ids >= E (and -1, the last entry) on no rank here
    assert_moe_close(out, moe_ref(x, w13, d13, w2, d2, tw, bad, expert_map=emap))
    with pytest.raises(ValueError, match="topk_ids"):
        moe_decode(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, bad, gate_up_tile=gate,
                   down_tile=dtile, down=kind, check_ids=True)


@pytest.mark.gpu
def test_gpu_empty_batch():
    h, i, p = _gpu_problem("qwen3-30b-a3b", 0)
    for down in GPU_DOWN:
        gate, kind, det, dtile = _gpu_tiles(h, i, down=down)
        assert _run(p, gate, dtile, kind, det).shape == (0, h)


class _RecordedKernel:
    """Stands for ReadyKernel in the ready launchers: records what it was made with and called with."""

    def __init__(self, made, kernel, grid, **const):
        self.kernel, self.grid, self.const, self.calls = kernel, grid, const, []
        made.append(self)

    def __call__(self, *args):
        self.calls.append(args)


@pytest.fixture
def recorded(monkeypatch):
    from vllm_nvfp4_sm120.kernels import launch

    made = []
    monkeypatch.setattr(launch, "ReadyKernel", lambda *a, **kw: _RecordedKernel(made, *a, **kw))
    return made


def _misaligned(t):
    """A tensor like ``t`` whose data starts one byte past a 16-byte boundary."""
    buf = torch.zeros(t.numel() * t.element_size() + 16, dtype=torch.uint8)
    off = (1 - buf.data_ptr()) % 16
    return buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)


def test_shift_decode_only_on_16_byte_code_rows(recorded):
    # K / 2 bytes per code row a multiple of 16: the shift decode; otherwise the table decode (md.shift_ok).
    assert [k for k in (80, 176, 336, 352, 512, 1408, 2048, 7168) if md.shift_ok(k)] == [352, 512, 1408, 2048, 7168]
    e, h, i, t, k = 4, 512, 64, 1, 2
    tile = replace(DOT, shift_decode=True)
    codes = torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8)
    sf, dec = torch.zeros(e, 2 * i, h // 16, dtype=torch.uint8), torch.ones(e)
    x, ids = torch.zeros(t, h, dtype=torch.bfloat16), torch.zeros(t, k, dtype=torch.int32)
    run = md.prepare_moe_decode_gate_up(t, h, i, e, k, e, torch.device("cpu"), tile=tile, activation="silu",
                                        has_map=False, zero_numel=None)
    run(x, codes, sf, dec, ids, ids)
    run(x, _misaligned(codes), sf, dec, ids, ids)
    run(x, codes, sf, dec, ids, ids)
    assert [r.const["SHIFT_DECODE"] for r in recorded] == [True, False]
    assert [len(r.calls) for r in recorded] == [2, 1], "aligned codes again: the shift decode's launch again"
    unshifted = md.prepare_moe_decode_gate_up(t, 336, i, e, k, e, torch.device("cpu"), tile=tile,
                                              activation="silu", has_map=False, zero_numel=None)
    unshifted(torch.zeros(t, 336, dtype=torch.bfloat16), torch.zeros(e, 2 * i, 168, dtype=torch.uint8),
              torch.zeros(e, 2 * i, 21, dtype=torch.uint8), dec, ids, ids)
    assert recorded[-1].const["SHIFT_DECODE"] is False


def test_native_convert_turns_the_shift_decode_off(recorded, monkeypatch):
    # Where the GPU converts e2m1 itself, every launcher passes that decode and no shift decode (its relabelled k
    # order exists for the PTX decode only); the validating launcher's path is the ready one.
    monkeypatch.setattr(md, "decode_kind", lambda device: md.DECODE_CVT)
    e, h, i, t, k = 4, 512, 64, 1, 2
    tile = replace(DOT, shift_decode=True)
    codes, sf = torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8), torch.zeros(e, 2 * i, h // 16, dtype=torch.uint8)
    x, ids, dec = torch.zeros(t, h, dtype=torch.bfloat16), torch.zeros(t, k, dtype=torch.int32), torch.ones(e)
    md.prepare_moe_decode_gate_up(t, h, i, e, k, e, torch.device("cpu"), tile=tile, activation="silu",
                                  has_map=False, zero_numel=None)(x, codes, sf, dec, ids, ids)
    w2, sf2 = torch.zeros(e, h, i // 2, dtype=torch.uint8), torch.zeros(e, h, i // 16, dtype=torch.uint8)
    inter, tw = torch.zeros(t * k, i, dtype=torch.bfloat16), torch.ones(t, k)
    down = replace(DOT, block_k=64, shift_decode=True)
    md.prepare_moe_decode_down_token(t, h, i, e, k, e, torch.device("cpu"), tile=down, has_map=False)(
        inter, w2, sf2, dec, ids, ids, tw)
    md.prepare_moe_decode_down_expert(t, h, i, e, k, e, torch.device("cpu"), tile=down, has_map=False,
                                      deterministic=True)(
        inter, w2, sf2, dec, ids, ids, tw, md.down_expert_workspace(t, k, h, down, True, "cpu"))
    decodes = [(r.const["FAST_DECODE"], r.const["SHIFT_DECODE"]) for r in recorded if "FAST_DECODE" in r.const]
    assert decodes == [(md.DECODE_CVT, False)] * 3


_GATE_UP_INTS = ("S", "I", "K", "E", "GLOBAL_E", "top_k", "zero_numel", "zero_chunk", "stride_xt", "stride_we",
                 "stride_wn", "stride_wse", "stride_wsn", "stride_om", "stride_w2e", "stride_w2n", "stride_w2se",
                 "stride_w2sn")
_DOWN_INTS = ("S", "H", "K", "E", "GLOBAL_E", "top_k", "stride_am", "stride_we", "stride_wn", "stride_wse",
              "stride_wsn", "stride_om")


@pytest.mark.parametrize("strided", ["x", "codes", "scales", "out"])
def test_ready_gate_up_fixes_its_integers_per_stride(recorded, strided):
    """Every integer of the ready gate_up launch is fixed when its ReadyKernel is made (the per-call arguments are
    the tensors); a call with other strides gets a launch made for them, never the first one's."""
    e, h, i, t, k, ge = 4, 256, 32, 1, 2, 6
    codes = torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8)
    sf, dec = torch.zeros(e, 2 * i, h // 16, dtype=torch.uint8), torch.ones(e)
    x, ids = torch.zeros(t, h, dtype=torch.bfloat16), torch.zeros(t, k, dtype=torch.int32)
    zero = torch.zeros(40)
    run = md.prepare_moe_decode_gate_up(t, h, i, e, k, ge, torch.device("cpu"), tile=DOT, activation="silu",
                                        has_map=False, zero_numel=zero.numel())
    out = run(x, codes, sf, dec, ids, ids, None, zero)
    (first,) = recorded
    assert {n: first.const[n] for n in _GATE_UP_INTS} == dict(
        S=t * k, I=i, K=h, E=e, GLOBAL_E=ge, top_k=k, zero_numel=40, zero_chunk=-(-40 // (min(t * k, e) * 2)),
        stride_xt=h, stride_we=2 * i * h // 2, stride_wn=h // 2, stride_wse=2 * i * h // 16, stride_wsn=h // 16,
        stride_om=i, stride_w2e=0, stride_w2n=0, stride_w2se=0, stride_w2sn=0)  # (no down prefetch)
    assert out.shape == (t * k, i)
    want = (x, codes, sf, codes, sf, dec, ids, ids, out, zero, dec, dec, codes, sf)
    assert len(first.calls[0]) == len(want) and all(a is b for a, b in zip(first.calls[0], want))
    wide = {"x": torch.zeros(t, 2 * h, dtype=torch.bfloat16)[:, :h],
            "codes": torch.zeros(e, 2 * i, h, dtype=torch.uint8)[:, :, :h // 2],
            "scales": torch.zeros(e, 2 * i, h // 8, dtype=torch.uint8)[:, :, :h // 16],
            "out": torch.zeros(t * k, 2 * i, dtype=torch.bfloat16)[:, :i]}[strided]
    other = dict(x=x, codes=codes, scales=sf, out=None) | {strided: wide}
    run(other["x"], other["codes"], other["scales"], dec, ids, ids, other["out"], zero)
    assert len(recorded) == 2, "other strides: another launch"
    changed = {n for n in _GATE_UP_INTS if recorded[1].const[n] != first.const[n]}
    assert changed == {"x": {"stride_xt"}, "codes": {"stride_we", "stride_wn"}, "scales": {"stride_wse", "stride_wsn"},
                       "out": {"stride_om"}}[strided]
    run(x, codes, sf, dec, ids, ids, None, zero)
    assert len(recorded) == 2 and len(first.calls) == 2, "the first strides again: the first launch"


@pytest.mark.parametrize("kind", ["token", "expert", "expert-det"])
def test_ready_down_fixes_its_integers_per_stride(recorded, kind):
    e, h, i, t, k, ge = 4, 64, 32, 2, 2, 4
    det = kind == "expert-det"
    codes = torch.zeros(e, h, i // 2, dtype=torch.uint8)
    sf, dec = torch.zeros(e, h, i // 16, dtype=torch.uint8), torch.ones(e)
    inter, ids = torch.zeros(t * k, i, dtype=torch.bfloat16), torch.zeros(t, k, dtype=torch.int32)
    tw = torch.ones(t, k)
    dev = torch.device("cpu")
    if kind == "token":
        run = md.prepare_moe_decode_down_token(t, h, i, e, k, ge, dev, tile=DOT, has_map=False)
        call = lambda inter, out: run(inter, codes, sf, dec, ids, ids, tw, out)  # noqa: E731
    else:
        ws = down_expert_workspace(t, k, h, DOT, det, dev)
        run = md.prepare_moe_decode_down_expert(t, h, i, e, k, ge, dev, tile=DOT, has_map=False, deterministic=det)
        call = lambda inter, out: run(inter, codes, sf, dec, ids, ids, tw, ws, out)  # noqa: E731
    out = call(inter, None)
    first = recorded[0]
    assert {n: first.const[n] for n in _DOWN_INTS} == dict(
        S=t * k, H=h, K=i, E=e, GLOBAL_E=ge, top_k=k, stride_am=i, stride_we=h * i // 2, stride_wn=i // 2,
        stride_wse=h * i // 16, stride_wsn=i // 16, stride_om=h)
    args = first.calls[0]
    assert all(isinstance(a, torch.Tensor) for a in args) and args[-1] is out
    if kind != "token":
        assert args[9] is ws, "the sums: the workspace's address"
        counts = args[10]
        assert counts.dtype == torch.int32
        assert counts.data_ptr() == ws.data_ptr() + (0 if det else t * h * 4)
    if det:
        summed = recorded[1]
        assert {n: summed.const[n] for n in ("H", "S", "E", "GLOBAL_E", "top_k", "stride_dst")} == dict(
            H=h, S=t * k, E=e, GLOBAL_E=ge, top_k=k, stride_dst=h)
        assert summed.calls == [(ws, ids, ids, out)]
    made = len(recorded)
    call(torch.zeros(t * k, 2 * i, dtype=torch.bfloat16)[:, :i], torch.zeros(t, 2 * h, dtype=torch.bfloat16)[:, :h])
    assert len(recorded) == made + (2 if det else 1)
    assert (recorded[made].const["stride_am"], recorded[made].const["stride_om"]) == (2 * i, 2 * h)
    if det:
        assert recorded[-1].const["stride_dst"] == 2 * h


def test_workspace_sizes():
    # Atomic: [T, H] sums and one count per (token, H tile); deterministic: one row per route.
    assert down_expert_workspace(3, 8, 64, DOT, False, DEVICE).shape == (3 * 64 + 3 * 4,)
    assert down_expert_workspace(3, 8, 64, DOT, True, DEVICE).shape == (24 * 64,)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the inline-PTX decode (table + scale multiply, scale pairs) bit-exact against the pure-tl one
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _decode_probe(codes_ptr, sf_ptr, out_ptr, out32_ptr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                  FAST: tl.constexpr):
    r = tl.arange(0, ROWS)[:, None]
    codes = tl.load(codes_ptr + r * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)[None, :])
    sf = tl.load(sf_ptr + r * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)[None, :])
    dtype = out_ptr.dtype.element_ty
    offs = r * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    tl.store(out_ptr + offs, md._dequant_tile(codes, sf, ROWS, BLOCK_K, dtype, FAST))
    tl.store(out32_ptr + offs, md._dequant_tile_f32(codes, sf, ROWS, BLOCK_K, dtype, FAST))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_fast_decode_bit_exact(dtype):
    # Every code byte against every finite e4m3 scale (including subnormal scales and zero), a different scale in
    # each 16-element group of a row, so a byte multiplied by a neighbour group's scale would show.
    rows, block_k = 128, 512
    scales = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    r = torch.arange(rows)[:, None]
    g = torch.arange(block_k // 16)[None, :]
    sf = scales[(r * 7 + g * 3) % scales.numel()].contiguous().cuda()
    codes = ((torch.arange(block_k // 2)[None, :] + r * 5) % 256).to(torch.uint8).contiguous().cuda()
    outs = {}
    # An sm_100+ / sm_120 GPU also checks the native convert (the H200 has none).
    kinds = (True, False) + ((md.DECODE_CVT,) if md.decode_kind(torch.device("cuda")) == md.DECODE_CVT else ())
    for fast in kinds:
        out = torch.empty(rows, block_k, dtype=dtype, device="cuda")
        out32 = torch.empty(rows, block_k, dtype=torch.float32, device="cuda")
        _decode_probe[(1,)](codes, sf, out, out32, ROWS=rows, BLOCK_K=block_k, FAST=fast, num_warps=4)
        outs[fast] = (out, out32)
    for fast in kinds[:1] + kinds[2:]:
        assert torch.equal(outs[fast][0].view(torch.int16), outs[False][0].view(torch.int16)), fast
        assert torch.equal(outs[fast][1].view(torch.int32), outs[False][1].view(torch.int32)), fast
    from vllm_nvfp4_sm120.format import unit_values

    torch.testing.assert_close(outs[False][1], unit_values(codes, sf.view(torch.float8_e4m3fn)), rtol=0, atol=0)


@pytest.mark.parametrize("down,det", [("token", False), ("expert", False), ("expert", True)])
def test_token_without_local_expert_is_zero(down, det):
    # Token 1's slots are all another rank's experts: its output row is zeros (no program adds into it).
    p = list(_problem(3, 8, 2, 80, 96, with_map=True))
    ti = p[6].clone()
    ti[1] = torch.tensor([0, 2], dtype=ti.dtype)  # even global ids: not on this rank
    ti[0, 0], ti[2, 1] = 1, 3
    p[6] = ti
    out = _run(p, DOT, DOT, down, det)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_moe_close(out, _ref(p))


def test_sweep_script_runs(tmp_path):
    # The device sweep end to end on a tiny shape (in the interpreter on CPU): every candidate checked against the
    # reference, the JSON written.  Guards the lead's device run against a script error.
    import json

    SWEEP.main(["--device", DEVICE, "--shapes", "tiny", "--tokens", "2", "--gate-up", "gu-n16k256-w2-tma",
                "--down", "tok-n16k256-w1,exp-n32k256-w2-tma-det", "--min-bytes", "1", "--repeats", "2",
                "--no-baseline", "--out", str(tmp_path)])
    row = json.loads((tmp_path / "moe_decode.json").read_text())["rows"][0]
    assert row["failed"] == [] and set(row["errors"]) == {"gu-n16k256-w2-tma", "tok-n16k256-w1",
                                                          "exp-n32k256-w2-tma-det"}
    assert row["best"] and row["best_us"] > 0 and row["experts_touched"] >= 2


def test_sweep_script_warm(tmp_path):
    # --warm: one bank and one routing in every call of the graph (the experts touched once per graph).
    import json

    SWEEP.main(["--device", DEVICE, "--shapes", "tiny", "--tokens", "1", "--gate-up", "gu-n16k256-w2-tma",
                "--down", "tok-n16k256-w1", "--repeats", "1", "--no-baseline", "--warm", "--out", str(tmp_path)])
    row = json.loads((tmp_path / "moe_decode.json").read_text())["rows"][0]
    assert row["failed"] == [] and row["copies"] == 16 and row["experts_touched"] == 2  # T = 1, top-2


def test_sweep_read_ceiling(tmp_path, gen):
    # --read-ceiling: two launches that read only the touched experts' words, checked by their xor; a flipped bit
    # in a touched expert changes it, one in an untouched expert does not.
    import json

    SWEEP.main(["--device", DEVICE, "--shapes", "tiny", "--tokens", "1,3", "--pairs",
                "gu-n16k128-w2-st3+exp-n32k256-w2-st2-shift", "--min-bytes", "1", "--repeats", "1", "--no-baseline",
                "--read-ceiling", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "moe_decode.json").read_text())["rows"]
    assert all(r["failed"] == [] and r["read_ceiling_us"] > 0 for r in rows)
    codes = torch.randint(0, 256, (6, 40, 96), dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 256, (6, 40, 12), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    ids = torch.tensor([1, 4], dtype=torch.int32)
    out = torch.empty(2 * 3, dtype=torch.int32)
    got = SWEEP.xor_words(SWEEP.read_experts(codes.to(DEVICE), scales.to(DEVICE), ids.to(DEVICE), out.to(DEVICE)))
    assert got == SWEEP.read_experts_expected(codes, scales, ids)
    codes[4, 39, 95] ^= 0x80  # the last byte of a touched expert
    codes[2, 0, 0] ^= 1  # an untouched expert
    got2 = SWEEP.xor_words(SWEEP.read_experts(codes.to(DEVICE), scales.to(DEVICE), ids.to(DEVICE), out.to(DEVICE)))
    assert got2 == got ^ (0x80 << 24)


def test_sweep_candidate_names():
    # "all" times every tile that has a kernel of its own: the fused kernel's down items only run in --pairs, and
    # sweep() refuses them in --down, so "all" must leave them out (it used to end the run there).
    gate, down = SWEEP.candidate_names("all", "all")
    assert gate == list(SWEEP.ANY_GATE_UP)
    assert down and all(SWEEP.ANY_DOWN[n][0] != "fused" for n in down)
    assert set(down) | {n for n, v in SWEEP.DOWN.items() if v[0] == "fused"} == set(SWEEP.ANY_DOWN)
    assert set(SWEEP.STREAM_DOWN) <= set(down)
    assert SWEEP.candidate_names("", "") == (list(SWEEP.DEFAULT_GATE_UP), list(SWEEP.DEFAULT_DOWN))
    assert SWEEP.candidate_names("a,b", "c") == (["a", "b"], ["c"])


def test_sweep_script_times_pairs(tmp_path):
    # --pairs alone: each pair checked and timed as a whole layer, no tile timed alone (a programmatic dependent
    # down kernel shows its gain only after its gate_up kernel).
    import json

    SWEEP.main(["--device", DEVICE, "--shapes", "tiny", "--tokens", "1", "--pairs",
                "gu-n16k128-w2-st3+exp-n32k256-w2-st2-pdl", "--min-bytes", "1", "--repeats", "2", "--no-baseline",
                "--out", str(tmp_path)])
    row = json.loads((tmp_path / "moe_decode.json").read_text())["rows"][0]
    name = "gu-n16k128-w2-st3+exp-n32k256-w2-st2-pdl"
    assert row["failed"] == [] and set(row["errors"]) == {name}
    assert row["pairs_us"][name] > 0 and row["gate_up_us"] == {} and row["down_us"] == {}
    with pytest.raises(SystemExit, match="--pairs"):
        SWEEP.main(["--device", DEVICE, "--shapes", "tiny", "--pairs", "gu-n16k128-w2-st3", "--out", str(tmp_path)])


def test_sweep_loads_probe(tmp_path):
    # --loads-probe: the streaming gate_up's and down's walks with their loads alone (benchmarks/stream_loads_probe.py,
    # Gluon: GPU only), checked exactly on the first call, then timed alone, as a pair and without the cross-CTA sums.
    import json

    with pytest.raises(SystemExit, match="--loads-probe"):
        SWEEP.main(["--device", DEVICE, "--shapes", "tiny", "--tokens", "1", "--loads-probe", "gus-m32t8",
                    "--out", str(tmp_path)])
    SWEEP.main(["--device", DEVICE, "--shapes", "tiny", "--tokens", "1,3", "--pairs",
                "gu-n16k128-w2-st3+exp-n32k256-w2-st2-shift", "--min-bytes", "1", "--repeats", "1", "--no-baseline",
                "--loads-probe", "gus-m32t8,dns-m64t8-rw2-lc-c4", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "moe_decode.json").read_text())["rows"]
    assert [r["T"] for r in rows] == [1, 3] and all(r["failed"] == [] for r in rows)
    for r in rows:
        if DEVICE == "cuda":
            assert set(r["loads_probe_us"]) == {"gate_up gus-m32t8", "down dns-m64t8-rw2-lc-c4", "pair",
                                                "pair without the cross-CTA sums"}
            assert all(us > 0 for us in r["loads_probe_us"].values())
        else:  # no Gluon on the CPU: the rows come without it
            assert "loads_probe_us" not in r
