"""The one-launch decode MoE layer with the down split over I (kernels/moe_decode_split_i.py) against moe_ref.

CPU: the kernel in the interpreter (fp16) on tiny shapes: T = 0-16, E 8 / 60, top_k 1-4, I not a multiple of the
tiles, H not a power of two, both activations, ``expert_map`` with -1 (a token with no local expert), skewed routing
(several route chunks per program), copies of the sums, one workspace over calls (left zero); the checks.
``compile``: the sweep's pairs for sm_120 (no local memory, smem, the vector fp32 reductions, the count, the
decode instructions; also with the native convert) and sm_90.  ``gpu``: the real checkpoint shapes, fp16 and maps,
graph replay equal to eager within the reference's tolerance (the sums' order varies), a workspace shared by layers.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import pytest
import torch
from moe_gpu_common import assert_moe_close
from test_moe_decode import SWEEP, _gpu_problem, _problem, _ref

from vllm_nvfp4_sm120.kernels import moe_decode as md
from vllm_nvfp4_sm120.kernels import moe_decode_split_i as ms
from vllm_nvfp4_sm120.kernels.aot import compile_kernel
from vllm_nvfp4_sm120.kernels.gluon_moe_decode import MoeStreamTile
from vllm_nvfp4_sm120.kernels.moe_decode import DecodeTile
from vllm_nvfp4_sm120.kernels.moe_decode_split_i import SplitIDown, moe_decode_split_i, split_i_workspace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

GATE = DecodeTile(16, 32, 16, num_warps=4, num_stages=2, use_dot=True)  # 32 stacked rows
GATE_KW = DecodeTile(16, 64, 16, num_warps=2, num_stages=2, use_dot=True, k_warps=2)
GATE_N32 = DecodeTile(32, 32, 16, num_warps=4, num_stages=2, use_dot=True)

# (T, E, top_k, H, I, activation, gate tile, down, options)
CASES = [
    (0, 8, 2, 80, 96, "silu", GATE, SplitIDown(16, 1), {}),
    (1, 8, 1, 80, 96, "silu", GATE, SplitIDown(16, 1), {}),
    (1, 60, 4, 112, 176, "gelu_tanh", GATE_N32, SplitIDown(32, 2), {}),  # I % 32 != 0: the last block short
    (2, 8, 2, 112, 176, "silu", GATE_KW, SplitIDown(64, 1), {"ids_dtype": torch.int64}),
    (3, 60, 2, 80, 96, "gelu_tanh", GATE, SplitIDown(32, 3), {"with_map": True}),
    (5, 8, 2, 112, 96, "silu", GATE, SplitIDown(16, 1), {"with_map": True}),  # 10 slots > 8 experts
    (5, 60, 4, 80, 176, "silu", GATE_KW, SplitIDown(32, 4), {"skewed": True}),
    (16, 8, 4, 80, 96, "gelu_tanh", GATE, SplitIDown(64, 2), {"skewed": True}),  # 16 routes per expert
]


def _split(p, gate, down, activation="silu", workspace=None, out=None):
    x, w13, d13, w2, d2, tw, ti, emap = p
    return moe_decode_split_i(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, gate_up_tile=gate,
                              down=down, expert_map=emap, activation=activation, workspace=workspace, out=out)


def _case_id(c):
    t, e, k, h, i, act, gate, down, opts = c
    extra = "-".join(n for n, v in opts.items() if v is True) + ("-i64" if "ids_dtype" in opts else "")
    return (f"T{t}-E{e}-k{k}-H{h}-I{i}-{act}-n{gate.block_n}{'-kw' if gate.k_warps > 1 else ''}-h{down.block_h}"
            f"-c{down.copies}" + (f"-{extra}" if extra else ""))


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_layer_matches_reference(case):
    t, e, k, h, i, act, gate, down, opts = case
    p = _problem(t, e, k, h, i, **opts)
    ws = split_i_workspace(t, h, down, p[0].device)
    out = _split(p, gate, down, act, workspace=ws)
    assert out.shape == (t, h) and out.dtype == p[0].dtype
    assert_moe_close(out, _ref(p, act))
    assert torch.count_nonzero(ws[0]) == 0 and int(ws[1]) == 0  # left zero for the next call


def test_workspace_serves_later_calls():
    # One workspace over calls of other routings and token counts: each call right, the workspace left zero.
    down = SplitIDown(32, 2)
    ws = split_i_workspace(5, 80, down, DEVICE)
    for t, seed in ((5, 0), (3, 1), (5, 2), (1, 3)):
        p = _problem(t, 60, 4, 80, 96, with_map=seed % 2 == 1, seed=seed)
        assert_moe_close(_split(p, GATE, down, workspace=ws), _ref(p))
        assert torch.count_nonzero(ws[0]) == 0 and int(ws[1]) == 0


def test_token_without_local_expert_is_zero():
    p = _problem(3, 8, 2, 80, 96, with_map=True)
    x, w13, d13, w2, d2, tw, ti, emap = p
    ti = ti.clone()
    ti[1] = 0  # expert 0 is on another rank (the map holds the odd ones here)
    p = (x, w13, d13, w2, d2, tw, ti, emap)
    out = _split(p, GATE, SplitIDown(16, 1), out=torch.full_like(x, 3.0))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert_moe_close(out, _ref(p))


def test_workspace_numel():
    assert ms.workspace_numel(3, 200, SplitIDown(64, 4)) == 4 * 3 * 200
    sums, count = split_i_workspace(2, 64, SplitIDown(copies=2), "cpu")
    assert sums.shape == (256,) and sums.dtype == torch.float32 and count.shape == (1,) and count.dtype == torch.int32


def _bad_input_cases():
    p = _problem(2, 8, 2, 80, 96)
    x, w13, d13, w2, d2, tw, ti, _ = p
    down = SplitIDown(16, 2)
    run = functools.partial(moe_decode_split_i, gate_up_tile=GATE, down=down)
    args = (w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti)
    return [
        ("x", lambda: run(x.float(), *args)),
        ("x", lambda: run(torch.zeros(ms.MAX_TOKENS + 1, 80, dtype=x.dtype),
                          *args[:6], tw.repeat(9, 1)[:17], ti.repeat(9, 1)[:17])),
        ("w13_codes", lambda: run(x, w13.codes[:, :, :8], *args[1:])),
        ("w2_codes", lambda: run(x, *args[:3], w2.codes[:, :40], *args[4:])),
        ("w2_codes", lambda: run(x, *args[:3], w2.codes[:4], w2.scales[:4], d2[:4], tw, ti)),
        ("w2_scales", lambda: run(x, *args[:4], w2.scales[:, :, :2], *args[5:])),
        ("topk_weights", lambda: run(x, *args[:6], tw.half(), ti)),
        ("topk_ids", lambda: run(x, *args[:7], ti + 8, check_ids=True)),
        ("workspace.sums", lambda: run(x, *args, workspace=(torch.zeros(3), torch.zeros(1, dtype=torch.int32)))),
        ("workspace.sums", lambda: run(x, *args, workspace=(torch.zeros(2 * 2 * 80, dtype=torch.float64),
                                                           torch.zeros(1, dtype=torch.int32)))),
        ("workspace.count", lambda: run(x, *args, workspace=(torch.zeros(2 * 2 * 80), torch.zeros(1)))),
        ("gate_up_tile", lambda: moe_decode_split_i(x, *args, gate_up_tile=replace(GATE, use_tma=True, block_k=256),
                                                    down=down)),
        ("gate_up_tile", lambda: moe_decode_split_i(x, *args, gate_up_tile=replace(GATE, split_k=2), down=down)),
        ("gate_up_tile", lambda: moe_decode_split_i(x, *args, gate_up_tile=replace(GATE, block_n=8), down=down)),
        ("gate_up_tile", lambda: moe_decode_split_i(x, *args, gate_up_tile=replace(GATE, use_dot=False, block_t=1),
                                                    down=down)),
        ("gate_up_tile", lambda: moe_decode_split_i(x, *args, gate_up_tile=MoeStreamTile(64, 8, row_warps=2),
                                                    down=down)),
        ("down", lambda: moe_decode_split_i(x, *args, gate_up_tile=GATE, down=GATE)),
        ("SplitIDown", lambda: SplitIDown(48, 1)),
        ("SplitIDown", lambda: SplitIDown(64, 0)),
        ("activation", lambda: run(x, *args, activation="relu")),
        ("out", lambda: run(x, *args, out=x[:1])),
    ]


@pytest.mark.parametrize("case", range(len(_bad_input_cases())))
def test_bad_input_names_the_tensor(case):
    name, call = _bad_input_cases()[case]
    with pytest.raises((ValueError, TypeError), match=name):
        call()


# ---------------------------------------------------------------------------------------------------------------
# Compiles: the sweep's split-I pairs
# ---------------------------------------------------------------------------------------------------------------
# Each compiles without local memory for sm_90 and sm_120 (below; the 128-register cap with 128-row down steps uses
# 56-96 bytes of stack on sm_120, so it has 64-row steps).
SPLIT_PAIRS = [("gu-n16k256-kw4-st3-shift-r128", "spl-h64"), ("gu-n16k256-kw4-st3-shift-r128", "spl-h64-pf"),
               ("gu-n16k256-kw4-st3-shift", "spl-h128-pf-c4"), ("gu-n16k256-kw4-st3-shift", "spl-h256-pf"),
               ("gu-n32k256-kw4-st2-shift-r168", "spl-h64"), ("gu-n16k128-w2-st3", "spl-h128-c4")]


@functools.cache
def _compile(gname: str, dname: str, arch: int = 120, extra: tuple = (), dtype: str = "bf16",
             decode: int = md.DECODE_PTX):
    gt, down = SWEEP.GATE_UP[gname], SWEEP.ANY_DOWN[dname][2]
    sig = ms.MOE_DECODE_SPLIT_I_SIGNATURE
    if dtype != "bf16":
        sig = {k: v.replace("bf16", dtype) for k, v in sig.items()}
    return compile_kernel("vllm_nvfp4_sm120.kernels.moe_decode_split_i:_moe_decode_split_i_kernel", sig,
                          ms.compile_constexprs(gt, down, fast_decode=decode) | dict(extra),
                          divisible=ms.MOE_DECODE_SPLIT_I_DIVISIBLE, arch=arch, num_warps=gt.num_warps,
                          num_stages=gt.num_stages, maxnreg=gt.max_regs)


def test_the_sweep_split_pairs_are_valid():
    for g, d in SPLIT_PAIRS:
        assert SWEEP.ANY_DOWN[d][0] == "split_i"
        ms.check_split_i_tiles(SWEEP.GATE_UP[g], SWEEP.ANY_DOWN[d][2])


@pytest.mark.compile
@pytest.mark.parametrize("arch", [120, 90])
@pytest.mark.parametrize("pair", SPLIT_PAIRS, ids=["+".join(p) for p in SPLIT_PAIRS])
def test_split_pairs_compile(pair, arch):
    rep = _compile(*pair, arch=arch)
    rep.require_no_local().require_smem()
    rep.require_sass(r"\bHMMA\.16816\.F32\.BF16\b").require_sass(r"\bHMUL2\b|\bHFMA2\b")
    # The down products as 16-byte fp32 reductions (no returned value), the count (acq_rel), the cast's L2 reads.
    rep.require_sass(r"\bREDG\.E\.ADD\.F32x4\b").require_ptx(r"atom\.global\.gpu\.acq_rel\.add")
    rep.require_ptx(r"ld\.global\.cg")
    gt = SWEEP.GATE_UP[pair[0]]
    if gt.max_regs is not None:
        assert rep.registers <= gt.max_regs


@pytest.mark.compile
@pytest.mark.parametrize("pair", SPLIT_PAIRS, ids=["+".join(p) for p in SPLIT_PAIRS])
def test_split_pairs_compile_with_the_native_convert(pair):
    # What an sm_120 GPU runs: both parts decode by the e2m1 and e4m3 converts (no shift decode).
    rep = _compile(*pair, decode=md.DECODE_CVT)
    rep.require_ptx(r"cvt\.rn\.bf16x2\.e2m1x2").require_ptx(r"cvt\.rn\.bf16x2\.e4m3x2")
    rep.require_sass(r"\bF2FP\.BF16\.E2M1\.UNPACK_B\b").require_sass(r"\bHMMA\.16816\.F32\.BF16\b")
    rep.require_sass(r"\bREDG\.E\.ADD\.F32x4\b").require_no_local().require_smem()
    gt = SWEEP.GATE_UP[pair[0]]
    if gt.max_regs is not None:
        assert rep.registers <= gt.max_regs


@pytest.mark.compile
@pytest.mark.parametrize("decode", [md.DECODE_CVT, md.DECODE_PTX], ids=["cvt", "ptx"])
@pytest.mark.parametrize("extra,dtype", [
    ((("ACTIVATION", "gelu_tanh"), ("BY_EXPERT", True), ("HAS_MAP", True), ("S_BLOCK", 1024)), "bf16"),
    ((("EVEN_H", False), ("EVEN_I", False), ("HAS_MAP", True)), "fp16"),
], ids=["gelu-by-expert-map", "fp16-tails"])
def test_switches_compile_for_sm120(extra, dtype, decode):
    # The uncapped pair: with an expert map or gelu the register-capped pairs spill 8-48 bytes on sm_120 (so they
    # are sweep candidates, not table rows, until they do not).
    rep = _compile("gu-n16k256-kw4-st3-shift", "spl-h256-pf", 120, extra, dtype, decode)
    rep.require_no_local().require_smem().require_sass(r"\bHMMA\.16816\.F32\b")


# ---------------------------------------------------------------------------------------------------------------
# GPU: real checkpoint shapes
# ---------------------------------------------------------------------------------------------------------------
def _gpu_tiles(pair):
    g, d = SPLIT_PAIRS[pair]
    return SWEEP.GATE_UP[g], SWEEP.ANY_DOWN[d][2]


@pytest.mark.gpu
@pytest.mark.parametrize("pair", range(len(SPLIT_PAIRS)), ids=["+".join(p) for p in SPLIT_PAIRS])
@pytest.mark.parametrize("t", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "qwen3-next-80b", "odd"])
def test_gpu_layer(name, t, pair):
    from test_moe_decode import _gpu_problem_and_ref

    h, i, p, ref = _gpu_problem_and_ref(name, t)
    gate, down = _gpu_tiles(pair)
    ws = split_i_workspace(t, h, down, "cuda")
    assert_moe_close(_split(p, gate, down, workspace=ws), ref)
    assert torch.count_nonzero(ws[0]) == 0 and int(ws[1]) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("pair", [1, 4])
@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3", "odd"])
def test_gpu_fp16_gelu_map_skewed(name, pair):
    from test_moe_decode import _gpu_problem_and_ref

    h, i, p, ref = _gpu_problem_and_ref(name, 5, "gelu_tanh", skewed=True, dtype=torch.float16, with_map=True)
    gate, down = _gpu_tiles(pair)
    assert_moe_close(_split(p, gate, down, "gelu_tanh"), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("pair", [1, 2])
def test_gpu_graph_replay_and_shared_workspace(pair):
    # Two "layers" (other banks, other routings) captured in one graph on one workspace, replayed three times:
    # each replay within the reference's tolerance of eager (the sums' order is the arrival order), the
    # workspace left zero.
    gate, down = _gpu_tiles(pair)
    h, i, p1 = _gpu_problem("qwen3-30b-a3b", 4, with_map=True)
    _, _, p2 = _gpu_problem("qwen3-30b-a3b", 4, skewed=True)
    ws = split_i_workspace(4, h, down, "cuda")
    eager = [_split(p, gate, down, workspace=ws) for p in (p1, p2)]
    outs = [torch.empty_like(e) for e in eager]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for p, o in zip((p1, p2), outs):
            _split(p, gate, down, workspace=ws, out=o)
    for _ in range(3):
        for o in outs:
            o.fill_(7.0)
        graph.replay()
        torch.cuda.synchronize()
        for o, e in zip(outs, eager):
            assert_moe_close(o, e)
    assert torch.count_nonzero(ws[0]) == 0 and int(ws[1]) == 0
    assert_moe_close(eager[0], _ref(p1))
    assert_moe_close(eager[1], _ref(p2))


@pytest.mark.gpu
def test_gpu_empty_batch():
    h, i, p = _gpu_problem("qwen3-30b-a3b", 0)
    gate, down = _gpu_tiles(0)
    assert _split(p, gate, down).shape == (0, h)
