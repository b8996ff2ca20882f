"""The MoE flow's ready layer launchers (``registry.prepare_moe``: the decode plan, the tiers) against the flow's
validating path.

CPU: the interpreter runs both on the same tensors (the flow with an explicit plan runs the validating launchers
there; the Gluon GEMMs do not run in it); the results must be bit-identical.  GPU (``-m gpu``): the flow's second
call of a signature takes the ready launcher, and gives the first call's bits (token-major and deterministic
plans; the Triton and Gluon tiers too), also on another layer's banks of the same signature and under CUDA-graph
capture.
"""

from dataclasses import replace

import pytest
import torch

from vllm_nvfp4_sm120.dispatch import moe_flow
from vllm_nvfp4_sm120.dispatch.hw import Capability
from vllm_nvfp4_sm120.dispatch.moe import (DECODE_FUSED_PAIRS, Impl, MoeKernel, decode_tier_plan, fused_decode_plan,
                                           tier_plan)
from vllm_nvfp4_sm120.dispatch.registry import READY_MOE, MoeReady, prepare_moe
from vllm_nvfp4_sm120.format import GlobalScale, make_moe_bank, topk_route
from vllm_nvfp4_sm120.kernels.gluon_compat import HAS_GLUON
from vllm_nvfp4_sm120.kernels.moe_decode import DecodeTile

SM90, SM120 = Capability(90), Capability(120)
ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture(autouse=True)
def fresh():
    moe_flow.clear()
    yield
    moe_flow.clear()


def _plan(case: str):
    """(plan, H, I, deterministic, expert_map) per case; small shapes for the interpreter (TMA needs K % 256)."""
    if case == "expert-atomic-tma":
        return decode_tier_plan(SM90, 1, hidden=4096, intermediate=4096), 256, 256, False, False
    if case == "expert-det":
        return decode_tier_plan(SM90, 1, hidden=112, intermediate=96), 112, 96, True, False
    if case == "token-map":
        return decode_tier_plan(SM90, 8, hidden=112, intermediate=512), 112, 80, False, True
    if case == "split-k":  # on the T = 2 tile (the T = 1 one has warps over K, whose slices need block_k >= 128)
        plan = decode_tier_plan(SM90, 2, hidden=112, intermediate=96)
        return replace(plan, gate_up=replace(plan.gate_up, block_k=32, split_k=2)), 112, 96, False, False
    if case.startswith("prefetch"):  # the gate_up tile's down prefetch (the down bank through both paths)
        token = case.endswith("-token")  # token-major from T = 8 where I <= 512; expert-major (atomic) at T = 4
        plan = decode_tier_plan(SM90, 8 if token else 4, hidden=112, intermediate=96)
        assert plan.decode_down == ("token" if token else "expert")
        return replace(plan, gate_up=replace(plan.gate_up, prefetch_down=True)), 112, 96, False, False
    if case.startswith("fused"):  # one launch: gate_up of 16 stacked rows, a 16-row down, 4 warps each
        plan = fused_decode_plan(SM90, DecodeTile(8, 32, 16, num_warps=4, num_stages=2, use_dot=True),
                                 DecodeTile(16, 32, 16, num_warps=4, num_stages=2, use_dot=True), hidden=112,
                                 intermediate=96)
        return plan, 112, 96, False, case.endswith("-map")
    if case.startswith("tiers"):  # the Triton tiers: pure-tl decode, pointer loads in the interpreter
        kernel = MoeKernel.W4A4 if case.startswith("tiers-w4a4") else MoeKernel.W4A16
        plan = tier_plan(SM90, kernel, 32, hidden=128, intermediate=64, impl=Impl.TRITON)
        plan = replace(plan, fast_decode=False, decode=True, gate_up=replace(plan.gate_up, use_tma=False),
                       down=replace(plan.down, use_tma=False))
        return plan, 128, 64, case.endswith("-det"), case.endswith("-map")
    raise AssertionError(case)


def _layer(gen, t, e, h, i, top_k, with_map, dtype=torch.float16):
    w13, d13 = make_moe_bank(e, 2 * i, h, gen=gen)
    w2, d2 = make_moe_bank(e, h, i, gen=gen)
    x = torch.randn(t, h, generator=gen).to(dtype)
    global_e = 2 * e if with_map else e
    tw, ti = topk_route(torch.randn(t, global_e, generator=gen), top_k)
    emap = None
    if with_map:  # every other global expert on this rank
        emap = torch.full((global_e,), -1, dtype=torch.int32)
        emap[::2] = torch.arange(e, dtype=torch.int32)
    tensors = [x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti]
    tensors = [v.to(DEVICE) for v in tensors]
    return tensors, None if emap is None else emap.to(DEVICE)


def _ready(plan, a, emap, deterministic, activation="silu"):
    x, w13c, _, _, w2c, _, _, _, ti = a
    return prepare_moe(plan, MoeReady(
        x.shape[0], x.shape[1], w2c.shape[2] * 2, w13c.shape[0], ti.shape[1],
        emap.shape[0] if emap is not None else w13c.shape[0], x.device, x.dtype, emap is not None, activation,
        deterministic))


def test_ready_moe_kernels():
    assert set(READY_MOE) == {(MoeKernel.W4A16, Impl.DECODE), (MoeKernel.W4A16, Impl.TRITON),
                              (MoeKernel.W4A4, Impl.TRITON), (MoeKernel.W4A16, Impl.GLUON),
                              (MoeKernel.W4A4, Impl.GLUON)}


def _enc(plan, x):
    """The W4A4 plans' encode scales ``(a13_enc, a2_enc)``, else ``(None, None)``."""
    if plan.kernel != MoeKernel.W4A4:
        return None, None
    return GlobalScale.of(x.float().cpu()).enc.reshape(1).to(x.device), GlobalScale.from_amax(8.0).enc.reshape(1).to(
        x.device)


@pytest.mark.parametrize("case", ["expert-atomic-tma", "expert-det", "token-map", "split-k", "prefetch-expert",
                                  "prefetch-token", "fused", "fused-map",
                                  "tiers-atomic",
                                  "tiers-det", "tiers-map", "tiers-w4a4-atomic", "tiers-w4a4-det", "tiers-w4a4-map"])
def test_ready_layer_equals_validating_flow(case, gen):
    if ON_GPU:
        pytest.skip("the interpreter case; the GPU tests below cover CUDA")
    plan, h, i, deterministic, with_map = _plan(case)
    a, emap = _layer(gen, 3, 6, h, i, 2, with_map)
    enc = _enc(plan, a[0])
    want = moe_flow.nvfp4_moe(*a, a13_enc=enc[0], a2_enc=enc[1], expert_map=emap, deterministic=deterministic,
                              plan=plan)
    got = _ready(plan, a, emap, deterministic)(*a, *enc, emap, torch.empty_like(a[0]))
    assert torch.equal(got, want)


def test_flow_keeps_no_ready_launcher_on_cpu(gen):
    plan, h, i, deterministic, _ = _plan("expert-det")
    a, _ = _layer(gen, 2, 4, h, i, 2, False)
    for _ in range(2):
        moe_flow.nvfp4_moe(*a, deterministic=True, plan=plan)
    assert all(entry.ready is None for entry in moe_flow._CACHE.values())


def _gpu_plan(kind: str):
    """(plan, T, I) on H = 2048: a decode plan with either down kernel, or the W4A16 Triton tiers."""
    if kind.startswith("tiers") or kind.startswith("gluon"):
        kernel = MoeKernel.W4A4 if kind.endswith("w4a4") else MoeKernel.W4A16
        if kind.startswith("gluon"):  # the sm_120 tiers' Gluon GEMMs (persistent), which also run on sm_90
            return tier_plan(SM120, kernel, 64, hidden=2048, intermediate=768, impl=Impl.GLUON), 64, 768
        return tier_plan(SM90, kernel, 32, hidden=2048, intermediate=768, impl=Impl.TRITON), 64, 768
    if kind == "fused":  # the T = 4 pair of the Triton rows as one launch (capped at 248 registers: no spills)
        return fused_decode_plan(SM90, *DECODE_FUSED_PAIRS["t4"], hidden=2048, intermediate=768), 4, 768
    if kind == "expert-triton":  # the T = 2 row at H = 2048: the Triton gate_up and the Triton expert-major down
        plan = decode_tier_plan(SM90, 2, hidden=2048, intermediate=768)
        assert plan.decode_down == "expert" and isinstance(plan.gate_up, DecodeTile) and plan.stream_down is None
        return plan, 4, 768
    if kind == "stream-down":  # T = 4 at H = 2048: the streaming gate_up and the streaming late-cast down
        plan = decode_tier_plan(SM90, 4, hidden=2048, intermediate=768)
        assert plan.decode_down == "expert" and plan.stream_down is not None
        return plan, 4, 768
    i = 768 if kind == "expert" else 512
    plan = decode_tier_plan(SM90, 8, hidden=2048, intermediate=i)  # T = 8: the token-major rule
    assert plan.decode_down == kind
    if HAS_GLUON:  # and the streaming Gluon gate_up
        assert "/stream" in plan.tier
    # The expert-major case is the row's Triton down (what deterministic mode runs) beside the streaming gate_up.
    return replace(plan, stream_down=None, tier=plan.tier.removesuffix("/stream-down")), 4, i


@pytest.mark.gpu
@pytest.mark.parametrize("kind,deterministic", [("token", False), ("fused", False), ("expert", True), ("expert", False),
                                                ("expert-triton", False), ("stream-down", False),
                                                ("stream-down", True), ("tiers", True), ("tiers", False),
                                                ("tiers-w4a4", True), ("gluon", True), ("gluon-w4a4", True)])
def test_flow_second_call_takes_ready_launcher(kind, deterministic, gen):
    if (kind.startswith("gluon") or kind == "stream-down") and not HAS_GLUON:
        pytest.skip("needs Gluon (Triton >= 3.8)")
    plan, t, i = _gpu_plan(kind)
    a, _ = _layer(gen, t, 8, 2048, i, 4, False, dtype=torch.bfloat16)
    a13, a2 = _enc(plan, a[0])
    kw = dict(a13_enc=a13, a2_enc=a2, deterministic=deterministic, plan=plan)
    first = moe_flow.nvfp4_moe(*a, **kw)
    (entry,) = moe_flow._CACHE.values()
    assert entry.ready is not None
    exact = kind in ("token", "fused") or deterministic  # else fp32 atomics: the add order varies run to run

    def same(got, want):
        if exact:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, rtol=2**-7, atol=1e-3)

    same(moe_flow.nvfp4_moe(*a, **kw), first)
    # Another layer's banks of the same signature: the ready launcher reads the new weights.
    b, _ = _layer(torch.Generator().manual_seed(99), t, 8, 2048, i, 4, False, dtype=torch.bfloat16)
    other = moe_flow.nvfp4_moe(*a[:1], *b[1:7], *a[7:], **kw)
    moe_flow.clear()
    same(other, moe_flow.nvfp4_moe(*a[:1], *b[1:7], *a[7:], **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["token", "fused", "stream-down"])
def test_flow_ready_launcher_under_cuda_graph(kind, gen):
    if kind == "stream-down" and not HAS_GLUON:
        pytest.skip("needs Gluon (Triton >= 3.8)")
    plan, t, i = _gpu_plan(kind)
    a, _ = _layer(gen, t, 8, 2048, i, 4, False, dtype=torch.bfloat16)
    want = moe_flow.nvfp4_moe(*a, plan=plan)
    out = torch.empty_like(a[0])
    moe_flow.nvfp4_moe(*a, plan=plan, out=out)  # the out= signature's validating call, outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    out.zero_()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            moe_flow.nvfp4_moe(*a, plan=plan, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):  # the fused plan's control block (the streaming down's count) is left zero for the next replay
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        if kind == "stream-down":  # fp32 atomics: the add order may vary
            torch.testing.assert_close(out, want, rtol=2**-7, atol=1e-3)
        else:
            assert torch.equal(out, want)


def test_flow_hit_runs_the_entrys_ready_launcher(gen):
    """The flow's wiring: a signature whose entry holds a ready launcher calls it with nvfp4_moe's arguments (and
    a fresh ``out`` when none is given); another signature does not."""
    plan, h, i, _, _ = _plan("expert-det")
    a, _ = _layer(gen, 2, 4, h, i, 2, False)
    moe_flow.nvfp4_moe(*a, plan=plan)
    (entry,) = moe_flow._CACHE.values()
    seen = []

    def spy(*args):
        seen.append(args)
        return args[-1].fill_(7)

    entry.ready = spy
    got = moe_flow.nvfp4_moe(*a, plan=plan)
    assert len(seen) == 1 and torch.equal(got, torch.full_like(a[0], 7))
    assert all(x is y for x, y in zip(seen[0][:9], a)) and seen[0][9:12] == (None, None, None)
    assert seen[0][12].shape == a[0].shape and seen[0][12].dtype == a[0].dtype
    moe_flow.nvfp4_moe(*a, plan=plan, deterministic=True)  # another signature: its own entry, no ready launcher
    assert len(seen) == 1


class _Recorder:
    """Stands for a kernel: records each launch's grid and its arguments' metadata (the kernels do not run)."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        def launch(*args, **kw):
            meta = [(tuple(a.shape), a.stride(), a.dtype) if isinstance(a, torch.Tensor)
                    else (tuple(a.shape), tuple(a.strides), tuple(a.block_shape)) if hasattr(a, "block_shape")
                    else a for a in args]
            self.log.append((self.name, tuple(grid), meta, kw))

        return launch


@pytest.mark.parametrize("kernel", [MoeKernel.W4A16, MoeKernel.W4A4])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_gluon_tiers_ready_layer_launches_what_the_flow_launches(kernel, deterministic, gen, monkeypatch):
    """The Gluon GEMMs do not run in the interpreter: every kernel of the layer is recorded instead, and the ready
    layer must make the validating flow's launches, grids, argument layouts and compile-time arguments alike."""
    from vllm_nvfp4_sm120.kernels import act_quant, gluon_moe_w4a4, gluon_moe_w4a16, moe_align

    log = []
    for mod in (gluon_moe_w4a16, gluon_moe_w4a4, moe_align, act_quant):
        for name in [n for n in vars(mod) if n.startswith("_") and n.endswith("_kernel")]:
            monkeypatch.setattr(mod, name, _Recorder(name, log))
    for mod in (gluon_moe_w4a16, gluon_moe_w4a4):
        monkeypatch.setattr(mod, "require_gluon", lambda fn: None)
    monkeypatch.setattr(gluon_moe_w4a16, "default_decode", lambda device, dtype: 1)  # GPU queries, on CPU
    monkeypatch.setattr(gluon_moe_w4a4, "default_decode", lambda device: True)
    plan = tier_plan(SM120, kernel, 64, hidden=2048, intermediate=768, impl=Impl.GLUON)
    plan = replace(plan, gate_up=replace(plan.gate_up, persistent=False, use_tma=False),  # no SM count, no TMA
                   down=replace(plan.down, persistent=False, use_tma=False, epilogue_warps=0))
    a, _ = _layer(gen, 5, 4, 256, 128, 2, False)
    enc = (torch.ones(1), torch.ones(1)) if kernel == MoeKernel.W4A4 else (None, None)
    moe_flow.nvfp4_moe(*a, a13_enc=enc[0], a2_enc=enc[1], deterministic=deterministic, plan=plan)
    flow = list(log)
    log.clear()
    _ready(plan, a, None, deterministic)(*a, *enc, None, torch.empty_like(a[0]))
    assert [c[0] for c in flow].count(f"_gluon_moe_{kernel}_kernel") == 2
    assert log == flow
