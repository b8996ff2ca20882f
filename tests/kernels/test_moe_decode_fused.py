"""The one-launch decode MoE layer (kernels/moe_decode_fused.py) against format.moe_ref and the two-launch path.

CPU: the kernel in the interpreter (fp16) on tiny shapes: T = 0-20, E 8 / 60, top_k 1-4, I not a multiple of the
tiles, H not a power of two, both activations, ``expert_map`` with -1 (a token with no local expert), skewed routing
(several chunks per program), one control block over calls of different routings; bit-identical to the two-launch
path with the deterministic expert-major down; the checks.  ``compile``: every fused pair of the sweep for sm_120
(no local memory, smem, the ticket / release / acquire protocol, the L2 prefetch, the decode instructions; also with
the native convert) and the sm_90 form.  ``gpu``: the real checkpoint shapes, fp16 and maps, graph replay, a control block shared by layers.
"""

from __future__ import annotations

import functools
import re
from dataclasses import replace

import pytest
import torch
from moe_gpu_common import assert_moe_close
from test_moe_decode import SWEEP, _gpu_problem, _problem, _ref

from vllm_nvfp4_sm120.kernels import moe_decode as md
from vllm_nvfp4_sm120.kernels import moe_decode_fused as mf
from vllm_nvfp4_sm120.kernels.aot import compile_kernel
from vllm_nvfp4_sm120.kernels.gluon_moe_decode import MoeStreamTile
from vllm_nvfp4_sm120.kernels.moe_decode import DecodeTile, moe_decode
from vllm_nvfp4_sm120.kernels.moe_decode_fused import control_numel, fused_workspace, moe_decode_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

GATE = DecodeTile(8, 32, 16, num_warps=4, num_stages=2, use_dot=True)  # 16 stacked rows
DOWN = DecodeTile(16, 32, 16, num_warps=4, num_stages=2, use_dot=True)
GATE_KW = DecodeTile(8, 64, 16, num_warps=2, num_stages=2, use_dot=True, k_warps=2)
DOWN_KW = DecodeTile(16, 64, 16, num_warps=2, num_stages=2, use_dot=True, k_warps=2)

# (T, E, top_k, H, I, activation, gate tile, down tile, options)
CASES = [
    (0, 8, 2, 80, 96, "silu", GATE, DOWN, {}),
    (1, 8, 1, 80, 96, "silu", GATE, DOWN, {}),
    (1, 60, 4, 112, 176, "gelu_tanh", GATE, DOWN, {}),
    (2, 8, 2, 112, 176, "silu", GATE_KW, DOWN_KW, {"ids_dtype": torch.int64}),
    (3, 60, 2, 80, 96, "gelu_tanh", GATE, DOWN, {"with_map": True}),
    (5, 8, 2, 112, 96, "silu", GATE, DOWN, {"with_map": True}),  # 10 slots > 8 experts: by expert
    (5, 60, 4, 80, 176, "silu", GATE_KW, DOWN_KW, {"skewed": True}),
    (16, 8, 4, 80, 96, "gelu_tanh", GATE, DOWN, {"skewed": True}),  # 16 routes per expert
    (20, 8, 1, 80, 96, "silu", GATE, DOWN, {"skewed": True}),  # 20 routes > BLOCK_T: 2 chunks per program
]


def _fused(p, gate, down, activation="silu", control=None, out=None):
    x, w13, d13, w2, d2, tw, ti, emap = p
    return moe_decode_fused(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, gate_up_tile=gate,
                            down_tile=down, expert_map=emap, activation=activation, control=control, out=out)


def _two_launch(p, gate, down, activation="silu"):
    x, w13, d13, w2, d2, tw, ti, emap = p
    return moe_decode(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, gate_up_tile=gate,
                      down_tile=down, down="expert", expert_map=emap, activation=activation, deterministic=True)


def _case_id(c):
    t, e, k, h, i, act, gate, down, opts = c
    extra = "-".join(n for n, v in opts.items() if v is True) + ("-i64" if "ids_dtype" in opts else "")
    return f"T{t}-E{e}-k{k}-H{h}-I{i}-{act}-w{gate.num_warps}{'-kw' if gate.k_warps > 1 else ''}" + (
        f"-{extra}" if extra else "")


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_layer_matches_reference_and_two_launch_path(case):
    t, e, k, h, i, act, gate, down, opts = case
    p = _problem(t, e, k, h, i, **opts)
    control = fused_workspace(t, k, e, h, down, p[0].device)
    out = _fused(p, gate, down, act, control=control)
    assert out.shape == (t, h) and out.dtype == p[0].dtype
    assert_moe_close(out, _ref(p, act))
    # The same products and the same slot-order sum as the deterministic two-launch path: the same bits.
    assert torch.equal(out, _two_launch(p, gate, down, act))
    assert torch.count_nonzero(control) == 0  # left zero for the next call


def test_control_block_serves_later_calls():
    # One control block over calls of other routings and token counts (its grid-sized parts are reset by the
    # kernel): each call right, twice the same bits.
    control = fused_workspace(5, 4, 60, 80, DOWN, DEVICE)
    for t, seed in ((5, 0), (3, 1), (5, 2), (1, 3)):
        p = _problem(t, 60, 4, 80, 96, with_map=seed % 2 == 1, seed=seed)
        a = _fused(p, GATE, DOWN, control=control)
        assert torch.equal(a, _fused(p, GATE, DOWN, control=control))
        assert_moe_close(a, _ref(p))
    assert torch.count_nonzero(control) == 0


def test_token_without_local_expert_is_zero():
    p = _problem(3, 8, 2, 80, 96, with_map=True)
    x, w13, d13, w2, d2, tw, ti, emap = p
    ti = ti.clone()
    ti[1] = 0  # expert 0 is on another rank (the map holds the odd ones here)
    p = (x, w13, d13, w2, d2, tw, ti, emap)
    out = _fused(p, GATE, DOWN, out=torch.full_like(x, 3.0))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_moe_close(out, _ref(p))


def test_control_numel():
    tile = replace(DOWN, block_n=64)
    # ticket + finish + one ready count per grid row (min(slots, experts)) + tokens x H blocks
    assert control_numel(3, 2, 8, 200, tile) == 2 + 6 + 3 * 4
    assert control_numel(5, 4, 8, 64, tile) == 2 + 8 + 5 * 1


def _bad_input_cases():
    p = _problem(2, 8, 2, 80, 96)
    x, w13, d13, w2, d2, tw, ti, _ = p
    run = functools.partial(moe_decode_fused, gate_up_tile=GATE, down_tile=DOWN)
    return [
        ("x", lambda: run(x.float(), w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti)),
        ("w13_codes", lambda: run(x, w13.codes[:, :, :8], w13.scales, d13, w2.codes, w2.scales, d2, tw, ti)),
        ("w2_codes", lambda: run(x, w13.codes, w13.scales, d13, w2.codes[:, :40], w2.scales, d2, tw, ti)),
        ("w2_codes", lambda: run(x, w13.codes, w13.scales, d13, w2.codes[:4], w2.scales[:4], d2[:4], tw, ti)),
        ("w2_scales", lambda: run(x, w13.codes, w13.scales, d13, w2.codes, w2.scales[:, :, :2], d2, tw, ti)),
        ("topk_weights", lambda: run(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw.half(), ti)),
        ("topk_ids", lambda: run(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti + 8,
                                 check_ids=True)),
        ("control", lambda: run(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti,
                                control=torch.zeros(3, dtype=torch.int32, device=x.device))),
        ("control", lambda: run(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti,
                                control=torch.zeros(64, device=x.device))),
        ("down_tile: num_warps", lambda: moe_decode_fused(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw,
                                                          ti, gate_up_tile=GATE, down_tile=replace(DOWN,
                                                                                                   num_warps=2))),
        ("down_tile: max_regs", lambda: moe_decode_fused(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2,
                                                         tw, ti, gate_up_tile=GATE,
                                                         down_tile=replace(DOWN, max_regs=128))),
        ("gate_up_tile", lambda: moe_decode_fused(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti,
                                                  gate_up_tile=replace(GATE, use_tma=True, block_k=256),
                                                  down_tile=DOWN)),
        ("down_tile", lambda: moe_decode_fused(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti,
                                               gate_up_tile=GATE, down_tile=replace(DOWN, split_k=2))),
        ("gate_up_tile", lambda: moe_decode_fused(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti,
                                                  gate_up_tile=replace(GATE, prefetch_down=True), down_tile=DOWN)),
        ("gate_up_tile", lambda: moe_decode_fused(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti,
                                                  gate_up_tile=replace(GATE, use_dot=False, block_t=1),
                                                  down_tile=DOWN)),
        # a streaming Gluon tile (another kernel's tile type) is refused by name, not by an AttributeError
        ("gate_up_tile", lambda: moe_decode_fused(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti,
                                                  gate_up_tile=MoeStreamTile(64, 8, row_warps=2), down_tile=DOWN)),
        ("activation", lambda: run(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti,
                                   activation="relu")),
        ("out", lambda: run(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, out=x[:1])),
    ]


@pytest.mark.parametrize("case", range(len(_bad_input_cases())))
def test_bad_input_names_the_tensor(case):
    name, call = _bad_input_cases()[case]
    with pytest.raises((ValueError, TypeError), match=name):
        call()


# ---------------------------------------------------------------------------------------------------------------
# Compiles: every fused pair of the sweep (a gate_up tile + a "-fused" down tile of the same warps and cap)
# ---------------------------------------------------------------------------------------------------------------
FUSED_PAIRS = list(SWEEP.FUSED_PAIRS.values())


@functools.cache
def _compile(gname: str, dname: str, arch: int = 120, extra: tuple = (), dtype: str = "bf16",
             decode: int = md.DECODE_PTX):
    gt, dt = SWEEP.GATE_UP[gname], SWEEP.DOWN[dname][2]
    sig = mf.MOE_DECODE_FUSED_SIGNATURE
    if dtype != "bf16":
        sig = {k: v.replace("bf16", dtype) for k, v in sig.items()}
    return compile_kernel("vllm_nvfp4_sm120.kernels.moe_decode_fused:_moe_decode_fused_kernel", sig,
                          mf.compile_constexprs(gt, dt, fast_decode=decode) | dict(extra),
                          divisible=mf.MOE_DECODE_FUSED_DIVISIBLE, arch=arch, num_warps=gt.num_warps,
                          num_stages=gt.num_stages, maxnreg=gt.max_regs)


def test_the_sweep_fused_pairs_are_valid():
    for g, d in FUSED_PAIRS:
        assert SWEEP.DOWN[d][0] == "fused"
        mf.check_fused_tiles(SWEEP.GATE_UP[g], SWEEP.DOWN[d][2])


def test_the_dispatch_fused_pairs_are_sweep_pairs():
    # What the dispatch can run in one launch is what the sweep measures and the compile test below checks.
    from vllm_nvfp4_sm120.dispatch.moe import DECODE_FUSED_PAIRS

    for name, (gate, down) in DECODE_FUSED_PAIRS.items():
        g, d = SWEEP.FUSED_PAIRS[name]
        assert (SWEEP.GATE_UP[g], SWEEP.DOWN[d][2]) == (gate, down), name


@pytest.mark.compile
@pytest.mark.parametrize("arch", [120, 90])
@pytest.mark.parametrize("pair", FUSED_PAIRS, ids=["+".join(p) for p in FUSED_PAIRS])
def test_fused_pairs_compile(pair, arch):
    rep = _compile(*pair, arch=arch)
    rep.require_no_local().require_smem()
    rep.require_sass(r"\bHMMA\.16816\.F32\.BF16\b").require_sass(r"\bHMUL2\b|\bHFMA2\b")
    # The protocol: a ticket per program, the gate_up items' release, the down items' acquire loads (Triton makes
    # the add of 0 a load), the counts of
    # the top-k sum and the finish count; the down weights prefetched to L2; the intermediate and the route rows
    # read from L2.
    rep.require_ptx(r"atom\.global\.gpu\.relaxed\.add").require_ptx(r"atom\.global\.gpu\.release\.add")
    rep.require_ptx(r"ld\.global\.gpu\.acquire").require_ptx(r"atom\.global\.gpu\.acq_rel\.add")
    rep.require_ptx(r"prefetch\.global\.L2").require_ptx(r"ld\.global\.cg")
    gt, dt = SWEEP.GATE_UP[pair[0]], SWEEP.DOWN[pair[1]][2]
    if gt.max_regs is not None:
        assert rep.registers <= gt.max_regs
    # sm_90 makes no wgmma of these tiles (the shift decode feeds mma_v2 operands only).
    if arch == 90:
        assert not re.search(r"\bHGMMA\b", rep.sass)


@pytest.mark.compile
@pytest.mark.parametrize("pair", FUSED_PAIRS, ids=["+".join(p) for p in FUSED_PAIRS])
def test_fused_pairs_compile_with_the_native_convert(pair):
    # What an sm_120 GPU runs: both items decode by the e2m1 and e4m3 converts (no shift decode).
    rep = _compile(*pair, decode=md.DECODE_CVT)
    rep.require_ptx(r"cvt\.rn\.bf16x2\.e2m1x2").require_ptx(r"cvt\.rn\.bf16x2\.e4m3x2")
    rep.require_sass(r"\bF2FP\.BF16\.E2M1\.UNPACK_B\b").require_sass(r"\bHMMA\.16816\.F32\.BF16\b")
    rep.require_no_local().require_smem()
    gt = SWEEP.GATE_UP[pair[0]]
    if gt.max_regs is not None:
        assert rep.registers <= gt.max_regs


@pytest.mark.compile
@pytest.mark.parametrize("extra,dtype", [
    ((("ACTIVATION", "gelu_tanh"), ("BY_EXPERT", True), ("HAS_MAP", True), ("S_BLOCK", 1024)), "bf16"),
    ((("EVEN_H", False), ("EVEN_I", False), ("HAS_MAP", True)), "fp16"),
], ids=["gelu-by-expert-map", "fp16-tails"])
def test_switches_compile_for_sm120(extra, dtype):
    rep = _compile("gu-n32k128-w2-st3-shift", "exp-n64k256-w2-st2-shift-fused", 120, extra, dtype)
    rep.require_no_local().require_smem().require_sass(r"\bHMMA\.16816\.F32\b")


# ---------------------------------------------------------------------------------------------------------------
# GPU: real checkpoint shapes
# ---------------------------------------------------------------------------------------------------------------
GPU_PAIRS = SWEEP.FUSED_PAIRS


def _gpu_tiles(pair):
    g, d = GPU_PAIRS[pair]
    return SWEEP.GATE_UP[g], SWEEP.DOWN[d][2]


@pytest.mark.gpu
@pytest.mark.parametrize("pair", list(GPU_PAIRS))
@pytest.mark.parametrize("t", [1, 2, 3, 5, 16, 64])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "qwen3-next-80b", "odd"])
def test_gpu_layer(name, t, pair):
    from test_moe_decode import _gpu_problem_and_ref

    h, i, p, ref = _gpu_problem_and_ref(name, t)
    gate, down = _gpu_tiles(pair)
    out = _fused(p, gate, down)
    assert_moe_close(out, ref)
    assert torch.equal(out, _two_launch(p, gate, down))


@pytest.mark.gpu
@pytest.mark.parametrize("pair", ["t1", "t4"])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3", "odd"])
def test_gpu_fp16_gelu_map_skewed(name, pair):
    from test_moe_decode import _gpu_problem_and_ref

    h, i, p, ref = _gpu_problem_and_ref(name, 5, "gelu_tanh", skewed=True, dtype=torch.float16, with_map=True)
    gate, down = _gpu_tiles(pair)
    assert_moe_close(_fused(p, gate, down, "gelu_tanh"), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("pair", ["t1", "t4"])
def test_gpu_graph_replay_and_shared_control(pair):
    # Two "layers" (other banks, other routings) captured in one graph on one control block, replayed three times:
    # the bits of eager runs every time.
    gate, down = _gpu_tiles(pair)
    h, i, p1 = _gpu_problem("qwen3-30b-a3b", 4, with_map=True)
    _, _, p2 = _gpu_problem("qwen3-30b-a3b", 4, skewed=True)
    control = fused_workspace(4, 8, 128, h, down, "cuda")
    eager = [_fused(p, gate, down, control=control) for p in (p1, p2)]
    outs = [torch.empty_like(e) for e in eager]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for p, o in zip((p1, p2), outs):
            _fused(p, gate, down, control=control, out=o)
    for _ in range(3):
        for o in outs:
            o.fill_(7.0)
        graph.replay()
        torch.cuda.synchronize()
        for o, e in zip(outs, eager):
            assert torch.equal(o, e)
    assert torch.count_nonzero(control) == 0
    assert_moe_close(eager[0], _ref(p1))


@pytest.mark.gpu
def test_gpu_empty_batch():
    h, i, p = _gpu_problem("qwen3-30b-a3b", 0)
    gate, down = _gpu_tiles("t4")
    assert _fused(p, gate, down).shape == (0, h)
