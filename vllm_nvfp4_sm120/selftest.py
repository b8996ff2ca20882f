"""``vllm-nvfp4-sm120 selftest``: every check this machine can run, as a pass/fail table and a shareable report.

Three kinds of check, matching the proof chain of every kernel:
  format   the torch references agree with themselves and with vLLM's emulation (CPU)
  compile  each kernel compiles for sm_120 with the intended instructions, no spills, smem ≤ 99 KB (CPU)
  gpu      each kernel available on this GPU against the torch reference (needs CUDA)
What cannot run here is reported as SKIP with the reason, never as a pass.  The JSON report adds the machine
(:func:`environment`) and, for each failure, the whole message and its traceback.
"""

from __future__ import annotations

import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from . import __version__
from .format import (
    GlobalScale,
    dequantize_nvfp4,
    linear_w4a4_ref,
    linear_w4a16_ref,
    make_linear,
    quantize_nvfp4,
    swizzle_128x4,
    unswizzle_128x4,
)


class Skip(Exception):
    """Raised by a check that cannot run on this machine; the message says why."""


@dataclass
class Result:
    kind: str
    name: str
    status: str  # PASS, FAIL, SKIP
    detail: str  # one line, for the table
    seconds: float
    message: str | None = None  # FAIL: the whole error message
    traceback: str | None = None  # FAIL: where it was raised


CHECKS: list[tuple[str, str, Callable[[], str]]] = []


def check(kind: str, name: str):
    def deco(fn: Callable[[], str]):
        CHECKS.append((kind, name, fn))
        return fn

    return deco


# ---- format -----------------------------------------------------------------------------------------------------

@check("format", "quantize → dequantize error within one block step")
def _format_roundtrip() -> str:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=gen)
    gs = GlobalScale.of(x)
    q = quantize_nvfp4(x, gs)
    step = (q.scales.to(torch.float32) * gs.dec).repeat_interleave(16, dim=1)
    err = (dequantize_nvfp4(*q, gs) - x).abs()
    if not bool((err <= step + 1e-6).all()):
        raise AssertionError(f"max error {float((err - step).max()):.3g} above one grid step")
    return f"max |err| / amax = {float(err.max() / x.abs().max()):.3f}"


@check("format", "128x4 swizzle round trip (odd shapes)")
def _format_swizzle() -> str:
    s = torch.arange(130 * 13, dtype=torch.int32).reshape(130, 13).remainder(251).to(torch.uint8)
    if not torch.equal(unswizzle_128x4(swizzle_128x4(s), 130, 13), s):
        raise AssertionError("unswizzle(swizzle(s)) != s")
    return "130 x 13 scales"


@check("format", "quantization bit-exact with vLLM's ref_nvfp4_quant")
def _format_vllm() -> str:
    try:
        from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import ref_nvfp4_quant
    except ImportError as e:
        raise Skip(f"vLLM not importable ({e})") from None
    from .format import decode_e2m1, unpack_e2m1

    x = torch.randn(33, 160, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    gs = GlobalScale.of(x)
    q = quantize_nvfp4(x, gs)
    vals, scales = ref_nvfp4_quant(x, gs.enc, 16)
    if not (torch.equal(decode_e2m1(unpack_e2m1(q.codes)), vals) and torch.equal(q.scales.float(), scales)):
        raise AssertionError("codes or scales differ from vLLM's reference")
    return "codes and scales identical"


# ---- compile for sm_120 -----------------------------------------------------------------------------------------

@check("compile", "W4A4 dot_scaled GEMM → OMMA.SF…E2M1.E2M1.UE4M3.4X (sm_120)")
def _compile_w4a4() -> str:
    from .kernels.aot import SASS_OMMA_NVFP4, compile_kernel
    from .kernels.w4a4_gemm import W4A4_DIVISIBLE, W4A4_SIGNATURE

    rep = compile_kernel(
        "vllm_nvfp4_sm120.kernels.w4a4_gemm:_w4a4_gemm_kernel", W4A4_SIGNATURE,
        dict(HAS_BIAS=False, DECODE=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8),
        divisible=W4A4_DIVISIBLE, num_warps=8,
    )
    rep.require_sass(SASS_OMMA_NVFP4).require_no_local().require_smem()
    return rep.summary()


SASS_HMMA_BF16 = r"HMMA\.16816\.F32\.BF16"


@check("compile", "activation quant (bf16 → NVFP4) → cvt.rn.satfinite.e4m3x2 / .e2m1x2 (sm_120)")
def _compile_act_quant() -> str:
    from .kernels import act_quant as m
    from .kernels.aot import compile_kernel

    rep = compile_kernel("vllm_nvfp4_sm120.kernels.act_quant:_act_quant_kernel", m.ACT_QUANT_SIGNATURE,
                         dict(SWIZZLED=False, NATIVE_E4M3=True, NATIVE_E2M1=True, BLOCK_T=8, BLOCK_K=1024),
                         divisible=m.ACT_QUANT_DIVISIBLE, num_warps=4)
    rep.require_ptx(r"cvt\.rn\.satfinite\.e4m3x2\.f32").require_ptx(r"cvt\.rn\.satfinite\.e2m1x2\.f32")
    rep.require_no_local().require_smem()
    return rep.summary()


@check("compile", "W4A16 GEMV (decode) and GEMM (prefill) → bf16 HMMA, no spills (sm_120)")
def _compile_w4a16() -> str:
    from .dispatch import linear as cfg
    from .kernels import w4a16_linear as m
    from .kernels.aot import compile_kernel

    gv = cfg.W4A16_GEMV_CONFIGS[1]
    gemv = compile_kernel(
        "vllm_nvfp4_sm120.kernels.w4a16_linear:_w4a16_gemv_kernel", m.W4A16_GEMV_SIGNATURE,
        dict(HAS_BIAS=False, SPLIT=True, EVEN_K=True, FAST_DECODE=True, BLOCK_N=gv["block_n"], BLOCK_K=gv["block_k"],
             BLOCK_T=m.GEMV_BLOCK_T),
        divisible=m.W4A16_GEMV_DIVISIBLE, num_warps=gv["num_warps"], num_stages=gv["num_stages"])
    gemv.require_sass(SASS_HMMA_BF16).require_no_local().require_smem()
    gm = cfg.W4A16_GEMM_CONFIGS[1]
    gemm = compile_kernel(
        "vllm_nvfp4_sm120.kernels.w4a16_linear:_w4a16_gemm_kernel", m.W4A16_GEMM_SIGNATURE,
        dict(HAS_BIAS=False, EVEN_K=True, FAST_DECODE=True, BLOCK_M=gm["block_m"], BLOCK_N=gm["block_n"],
             BLOCK_K=gm["block_k"], GROUP_M=gm["group_m"], SWAP_AB=gm["swap_ab"]),
        divisible=m.W4A16_GEMM_DIVISIBLE, num_warps=gm["num_warps"], num_stages=gm["num_stages"])
    gemm.require_sass(SASS_HMMA_BF16).require_no_local().require_smem()
    return f"{gemv.summary()}; {gemm.summary()}"


@check("compile", "MoE W4A4 gate_up (OMMA) and W4A16 down (TMA) at the sm_120 plans' tiles")
def _compile_moe() -> str:
    from .dispatch import moe as plan_mod
    from .dispatch.hw import Capability
    from .kernels import moe_w4a4 as w4
    from .kernels import moe_w4a16 as w16
    from .kernels.aot import PTX_TMA_LOAD, SASS_OMMA_NVFP4, compile_kernel

    shape = dict(top_k=8, global_experts=128, hidden=2048, intermediate=768)  # a Qwen3-30B-A3B layer
    # 32 routes per expert: a BLOCK_M tier the Triton W4A4 kernels serve on sm_120 (64 / 128 go to Gluon).
    p4 = plan_mod.select_moe_plan(Capability(120), num_tokens=512, w4a4=True, **shape)
    t = p4.gate_up
    gate_up = compile_kernel(
        "vllm_nvfp4_sm120.kernels.moe_w4a4:_moe_w4a4_gate_up_kernel", w4.MOE_W4A4_GATE_UP_SIGNATURE,
        dict(DECODE=False, ACTIVATION="silu", NATIVE_E4M3=True, NATIVE_E2M1=True, BLOCK_M=p4.block_m,
             BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m),
        divisible=w4.MOE_W4A4_GATE_UP_DIVISIBLE, num_warps=t.num_warps, num_stages=t.num_stages)
    gate_up.require_sass(SASS_OMMA_NVFP4).require_ptx(r"cvt\.rn\.satfinite\.e2m1x2\.f32")
    gate_up.require_no_local().require_smem()
    assert p4.impl == "triton", p4
    # 4 routes per expert: the BLOCK_M 16 tier (smaller calls run the align-free decode kernels).
    p16 = plan_mod.select_moe_plan(Capability(120), num_tokens=64, w4a4=False, **shape)
    d = p16.down
    sig, div = w16.MOE_W4A16_DOWN_SIGNATURE, list(w16.MOE_W4A16_DOWN_DIVISIBLE)
    if d.use_tma:
        sig, div = w16.tma_signature(sig, d.block_n, d.block_k), [x for x in div if x != "w_desc"]
    down = compile_kernel(
        "vllm_nvfp4_sm120.kernels.moe_w4a16:_moe_w4a16_down_kernel", sig,
        dict(USE_TMA=d.use_tma, FAST_DECODE=p16.fast_decode, STREAM_W=p16.stream_weights, EVEN_K=True,
             DETERMINISTIC=False, BLOCK_M=p16.block_m, BLOCK_N=d.block_n, BLOCK_K=d.block_k, GROUP_M=d.group_m),
        divisible=div, num_warps=d.num_warps, num_stages=d.num_stages)
    if d.use_tma:
        down.require_ptx(PTX_TMA_LOAD)
    down.require_no_local().require_smem()
    return f"{gate_up.summary()}; {down.summary()}"


@check("compile", "Gluon W4A16 GEMV (tensor cores) → cvt e2m1x2 + bf16 HMMA (sm_120)")
def _compile_gluon_gemv() -> str:
    from .kernels import gluon_gemv as gg
    from .kernels.aot import compile_kernel
    from .kernels.gluon_compat import HAS_GLUON

    if not HAS_GLUON:
        raise Skip("this Triton has no Gluon >= 3.6")
    rep = compile_kernel(
        "vllm_nvfp4_sm120.kernels.gluon_gemv:_gemv_mma_kernel", gg.GEMV_MMA_SIGNATURE,
        dict(K=5120, HAS_BIAS=False, DECODE=gg.DECODE_CVT, BLOCK_T=16, WARPS=4),
        divisible=gg.GEMV_MMA_DIVISIBLE, num_warps=4, gluon=True)
    rep.require_ptx(r"cvt\.rn\.bf16x2\.e2m1x2").require_sass(SASS_HMMA_BF16).require_no_local().require_smem()
    return rep.summary()


@check("compile", "Gluon streaming W4A16 decode (the T <= 16 linears) → cvt e2m1x2 + bf16 HMMA, acq_rel counters "
                  "(sm_120)")
def _compile_gluon_gemv_stream() -> str:
    from .kernels import gluon_gemv_stream as gs
    from .kernels.aot import compile_kernel
    from .kernels.gluon_compat import HAS_GLUON

    if not HAS_GLUON:
        raise Skip("this Triton has no Gluon >= 3.6")
    from .dispatch.gemv_stream_plan import stream_plan

    tile = stream_plan(8, 0, 0, 170).tile  # the T <= 8 tile of the built-in plan, with its register cap
    rep = compile_kernel(
        "vllm_nvfp4_sm120.kernels.gluon_gemv_stream:_stream_kernel", gs.STREAM_SIGNATURE,
        dict(HAS_BIAS=False, DECODE=gs.DECODE_CVT, EVEN_K=True, **tile.constexprs),
        divisible=gs.STREAM_DIVISIBLE, num_warps=tile.num_warps, gluon=True, maxnreg=tile.max_regs)
    rep.require_ptx(r"cvt\.rn\.bf16x2\.e2m1x2").require_ptx(r"atom\.global\.gpu\.acq_rel\.add")
    rep.require_sass(SASS_HMMA_BF16).require_no_local().require_smem()
    return rep.summary()


@check("compile", "Gluon warp-specialized MoE W4A4 gate_up + persistent down with epilogue warps → OMMA, TMA, "
                  "setmaxnreg, cvt e2m1x2 (sm_120)")
def _compile_gluon_moe_w4a4() -> str:
    from .kernels import gluon_moe_w4a4 as g4
    from .kernels.aot import PTX_TMA_LOAD, SASS_OMMA_NVFP4, compile_kernel

    done = []
    for gated in (True, False):
        consts = dict(GATED=gated, ACTIVATION="silu", DETERMINISTIC=False, USE_TMA=True, DECODE=False,
                      PERSISTENT=not gated, EPILOGUE_WARPS=0 if gated else g4.EPILOGUE_WARPS, STAGES=3, BLOCK_M=64,
                      BLOCK_N=64, BLOCK_K=128, GROUP_M=8, MMA_WARPS_M=2)
        rep = compile_kernel("vllm_nvfp4_sm120.kernels.gluon_moe_w4a4:_gluon_moe_w4a4_kernel",
                             g4.signature(gated, True, 64, 128), consts, divisible=g4.divisible(True), gluon=True,
                             num_warps=4)
        rep.require_sass(SASS_OMMA_NVFP4).require_ptx(PTX_TMA_LOAD).require_ptx("setmaxnreg")
        rep.require_no_local().require_smem()
        if gated:  # the intermediate's e2m1 rounding by the hardware convert
            rep.require_ptx(r"cvt\.rn\.satfinite\.e2m1x2\.f32")
        done.append(rep.summary())
    return "; ".join(done)


# ---- on this GPU ------------------------------------------------------------------------------------------------

def _need_gluon(min_major: int = 8, why: str = "") -> None:
    """Skip unless the Gluon kernels are on and the GPU is at least sm_<min_major>0 (call after :func:`_need_cuda`)."""
    from .kernels.gluon_compat import ENV_DISABLE, gluon_enabled

    if not gluon_enabled():
        raise Skip(f"Gluon kernels are off (Triton without Gluon >= 3.6, or {ENV_DISABLE}=1)")
    if torch.cuda.get_device_capability()[0] < min_major:
        raise Skip(f"needs sm_{min_major}0 or newer{why}")


def _need_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise Skip("no CUDA GPU on this machine")
    return torch.device("cuda")


@check("gpu", "W4A4 Triton GEMM vs torch reference (native FP4 MMA on sm_120, decomposed elsewhere)")
def _gpu_w4a4() -> str:
    dev = _need_cuda()
    from .dispatch.hw import capability_of
    from .dispatch.linear import select_linear
    from .kernels.w4a4_gemm import w4a4_gemm

    gen = torch.Generator().manual_seed(2)
    p = make_linear(512, 1024, gen=gen)
    x = torch.randn(100, 1024, generator=gen).to(torch.bfloat16)
    ref = linear_w4a4_ref(x, p.codes, p.scales, p.weight_gs, p.input_gs)
    xq = quantize_nvfp4(x, p.input_gs)
    alpha = (p.input_gs.dec * p.weight_gs.dec).to(dev)
    worst = 0.0
    tile = select_linear(capability_of(dev), "triton", 100, 512, 1024).kwargs
    for decode in (False, True):
        out = w4a4_gemm(xq.codes.to(dev), xq.scales.to(dev), p.codes.to(dev), p.scales.to(dev), alpha,
                        torch.bfloat16, decode=decode, **tile)
        torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=1e-2, atol=1e-2)
        worst = max(worst, float((out.cpu().float() - ref.float()).abs().max()))
    return f"T=100 N=512 K=1024, max |err| {worst:.3g} on {torch.cuda.get_device_name()}"


def _close(out: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=1e-2, atol=1e-2, msg=lambda m: f"{what}: {m}")
    return float((out.cpu().float() - ref.float()).abs().max())


@check("gpu", "activation quant vs torch reference (bit-exact codes and scales, linear and 128x4 layouts)")
def _gpu_act_quant() -> str:
    dev = _need_cuda()
    from .dispatch.linear import act_quant_config
    from .kernels import act_quant as m

    gen = torch.Generator().manual_seed(3)
    # Every e2m1 rounding midpoint, saturation, -0 and tiny negatives at block scale 1 (amax 6, encode global 1):
    # on sm_120 the codes come from the hardware convert, whose rounding is checked here and nowhere else.
    edge = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.1, -0.0, 0.0, -6.0, 0.5, 3.0, -5.0])
    cases = [(edge.repeat(2, 8).to(torch.bfloat16), GlobalScale.from_encode(1.0))]
    for t, k in ((1, 5120), (37, 512), (300, 2048)):
        x = torch.randn(t, k, generator=gen).to(torch.bfloat16)
        cases.append((x, GlobalScale.of(x)))
    for x, gs in cases:
        t, k = x.shape
        ref = quantize_nvfp4(x, gs)
        codes, scales = m.quantize_act_nvfp4(x.to(dev), gs.enc.to(dev), **act_quant_config(t, k))
        if not (torch.equal(codes.cpu(), ref.codes) and torch.equal(scales.cpu().view(torch.uint8),
                                                                   ref.scales.view(torch.uint8))):
            raise AssertionError(f"T={t} K={k}: codes or scales differ from quantize_nvfp4")
        codes, sw = m.quantize_act_nvfp4(x.to(dev), gs.enc.to(dev), swizzled=True, **act_quant_config(t, k, True))
        if not torch.equal(unswizzle_128x4(sw.cpu(), t, k // 16).view(torch.uint8), ref.scales.view(torch.uint8)):
            raise AssertionError(f"T={t} K={k}: swizzled scales differ from the reference after unswizzling")
    native = m.has_native_e2m1(dev)
    return f"rounding midpoints, T = 1, 37, 300: identical ({'hardware' if native else 'arithmetic'} e2m1 rounding)"


@check("gpu", "W4A16 GEMV / GEMM vs torch reference (fused parts keep their own globals)")
def _gpu_w4a16() -> str:
    dev = _need_cuda()
    from .dispatch.hw import capability_of
    from .dispatch.linear import w4a16_plan
    from .kernels import w4a16_linear as m

    gen = torch.Generator().manual_seed(4)
    p = make_linear(384, 1024, gen=gen, logical_widths=[256, 128])
    worst = 0.0
    for fn, t in ((m.w4a16_gemv, 1), (m.w4a16_gemv, 7), (m.w4a16_gemm, 100)):
        x = torch.randn(t, 1024, generator=gen).to(torch.bfloat16)
        ref = linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows)
        tile = w4a16_plan(capability_of(dev), t, 384, 1024, small=fn is m.w4a16_gemv).kwargs
        out = fn(x.to(dev), p.codes.to(dev), p.scales.to(dev), p.dec_rows.to(dev), **tile)
        worst = max(worst, _close(out, ref, f"{fn.__name__} T={t}"))
    return f"T = 1, 7 (gemv), 100 (gemm), N=384 K=1024: max |err| {worst:.3g}"


@check("gpu", "MoE layer (align → gate_up → down → sum) vs torch reference, W4A16 and W4A4 plans")
def _gpu_moe() -> str:
    dev = _need_cuda()
    from .dispatch import moe_flow as flow
    from .format import make_moe_bank, moe_ref, topk_route

    gen = torch.Generator().manual_seed(5)
    e, h, i, top_k = 8, 256, 128, 2
    w13, w13_dec = make_moe_bank(e, 2 * i, h, gen=gen)
    w2, w2_dec = make_moe_bank(e, h, i, gen=gen)
    a13, a2 = GlobalScale.from_amax(4.0), GlobalScale.from_amax(1.0)
    on = lambda *ts: [t.to(dev) for t in ts]  # noqa: E731
    done = []
    for t, w4a4 in ((3, False), (64, True)):
        x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
        weights, ids = topk_route(torch.randn(t, e, generator=gen), top_k)
        ref = moe_ref(x, w13, w13_dec, w2, w2_dec, weights, ids,
                      a13_gs=a13 if w4a4 else None, a2_gs=a2 if w4a4 else None)
        scales = dict(a13_enc=a13.enc.reshape(1).to(dev), a2_enc=a2.enc.reshape(1).to(dev)) if w4a4 else {}
        xd, c13, s13, d13, c2, s2, d2, wd, idd = on(x, w13.codes, w13.scales, w13_dec, w2.codes, w2.scales, w2_dec,
                                                    weights, ids)
        plan = flow.plan_for(xd, c13, c2, idd, w4a4=w4a4)
        out = flow.nvfp4_moe(xd, c13, s13, d13, c2, s2, d2, wd, idd, **scales)
        # W4A4 quantizes the intermediate: a few e2m1 steps may round the other way in fp32 vs the kernel.
        tol = dict(rtol=5e-2, atol=5e-2) if w4a4 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(out.cpu().float(), ref.float(), **tol,
                                   msg=lambda msg, t=t: f"T={t} ({plan.tier}): {msg}")
        done.append(f"T={t} {plan.tier}")
    return ", ".join(done)


@check("gpu", "Gluon W4A16 GEMV (CUDA-core and tensor-core tiles) vs torch reference")
def _gpu_gluon_gemv() -> str:
    dev = _need_cuda()
    from .dispatch import registry as gg

    _need_gluon()
    gen = torch.Generator().manual_seed(6)
    p = make_linear(256, 2048, gen=gen, logical_widths=[128, 128])
    worst = 0.0
    for t in (1, 2, 8, 32):
        x = torch.randn(t, 2048, generator=gen).to(torch.bfloat16)
        out = gg.gemv(x.to(dev), p.codes.to(dev), p.scales.to(dev), p.dec_rows.to(dev))
        worst = max(worst, _close(out, linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows), f"gemv T={t}"))
    return f"T = 1, 2, 8, 32: max |err| {worst:.3g}"


@check("gpu", "Gluon streaming W4A16 decode (the dispatch's T <= 16 plans, ready launch, CUDA-graph replay) vs torch "
              "reference")
def _gpu_gluon_gemv_stream() -> str:
    dev = _need_cuda()
    from .dispatch.hw import capability_of
    from .dispatch.linear import LinearKernel, select_linear
    from .dispatch.registry import Ready, prepare_linear

    _need_gluon()
    gen = torch.Generator().manual_seed(7)
    n, k = 640, 3072  # 5 row tiles x 24 k-blocks: several CTAs per row tile, so the counters and partials run
    p = make_linear(n, k, gen=gen, logical_widths=[n])
    codes, scales, dec = p.codes.to(dev), p.scales.to(dev), p.dec_rows.to(dev)
    worst, done = 0.0, []
    for t in (1, 5, 16):
        plan = select_linear(capability_of(dev), "w4a16", t, n, k)
        if plan.kernel != LinearKernel.GLUON_GEMV_STREAM:
            raise Skip(f"the dispatch runs {plan.kernel} at T = {t} on this GPU")
        run = prepare_linear(plan, Ready(t, n, k, dev, torch.bfloat16, has_bias=False))
        x = torch.randn(t, k, generator=gen).to(torch.bfloat16)
        ref = linear_w4a16_ref(x, p.codes, p.scales, p.dec_rows)
        xd = x.to(dev)
        eager = run(xd, codes, scales, dec, None, None, None, None)
        worst = max(worst, _close(eager, ref, f"stream T={t}"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = run(xd, codes, scales, dec, None, None, None, None)
        for _ in range(2):  # replays reuse the counters the kernel left zero
            graph.replay()
            torch.cuda.synchronize()
            if not torch.equal(captured, eager):
                raise AssertionError(f"stream T={t}: a CUDA-graph replay differs from the eager call")
        done.append(str(t))
    return f"T = {', '.join(done)}, N={n} K={k}: max |err| {worst:.3g}, graph replays bit-equal"


@check("gpu", "Gluon block-scaled NVFP4 MMA tile (native OMMA; sm_120 only) vs torch reference")
def _gpu_gluon_mma_scaled() -> str:
    dev = _need_cuda()
    if torch.cuda.get_device_capability()[0] != 12:
        raise Skip("the native block-scaled MMA exists on sm_120 only")
    from .format import random_nvfp4, unit_values
    from .kernels import gluon_mma_scaled as ms

    gen = torch.Generator().manual_seed(7)
    bm, bn, bk, k = 64, 64, 128, 256
    a, w = random_nvfp4((bm, k), gen=gen), random_nvfp4((bn, k), gen=gen)
    c = torch.empty(bm, bn, device=dev)
    ad, wd = [t.to(dev) for t in a], [t.to(dev) for t in w]
    ms._mma_scaled_tile_kernel[(1,)](
        ad[0], ad[1].view(torch.uint8), wd[0], wd[1].view(torch.uint8), c,
        ad[0].stride(0), ad[1].stride(0), wd[0].stride(0), wd[1].stride(0), c.stride(0),
        K=k, BM=bm, BN=bn, BK=bk, WARPS_M=2, WARPS_N=2, num_warps=4)
    ref = unit_values(*a) @ unit_values(*w).t()
    torch.testing.assert_close(c.cpu(), ref, rtol=1e-5, atol=1e-5)
    return f"{bm}x{bn}x{k} tile identical within 1e-5 (NUMERICS_VERIFIED_ON_SM120 may be set True now)"


@check("gpu", "Gluon MoE GEMMs (warp-specialized W4A16; W4A4 with native OMMA on sm_120) vs torch reference")
def _gpu_gluon_moe() -> str:
    dev = _need_cuda()
    from .dispatch import moe_flow as flow
    from .dispatch.moe import as_gluon
    from .format import make_moe_bank, moe_ref, topk_route

    _need_gluon(9, " (TMA, warp specialization)")
    gen = torch.Generator().manual_seed(8)
    e, h, i, top_k, t = 8, 512, 256, 2, 256  # 64 routes per expert: the BLOCK_M 64 tier
    w13, w13_dec = make_moe_bank(e, 2 * i, h, gen=gen)
    w2, w2_dec = make_moe_bank(e, h, i, gen=gen)
    a13, a2 = GlobalScale.from_amax(4.0), GlobalScale.from_amax(1.0)
    x = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    weights, ids = topk_route(torch.randn(t, e, generator=gen), top_k)
    xd, c13, s13, d13, c2, s2, d2, wd, idd = [v.to(dev) for v in (
        x, w13.codes, w13.scales, w13_dec, w2.codes, w2.scales, w2_dec, weights, ids)]
    done = []

    plan = as_gluon(flow.plan_for(xd, c13, c2, idd, w4a4=False), i)
    out = flow.nvfp4_moe(xd, c13, s13, d13, c2, s2, d2, wd, idd, plan=plan)
    ref = moe_ref(x, w13, w13_dec, w2, w2_dec, weights, ids)
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=1e-2, atol=1e-2)
    done.append(f"W4A16 {plan.tier}")

    # W4A4: the plan the sm_120 dispatch routes to at this size (BLOCK_M 64, persistent, down GEMM with separate
    # epilogue warps since I < 1024).
    a13_enc, a2_enc = a13.enc.reshape(1).to(dev), a2.enc.reshape(1).to(dev)
    plan = as_gluon(flow.plan_for(xd, c13, c2, idd, w4a4=True), i)
    out = flow.nvfp4_moe(xd, c13, s13, d13, c2, s2, d2, wd, idd, a13_enc=a13_enc, a2_enc=a2_enc, plan=plan)
    ref = moe_ref(x, w13, w13_dec, w2, w2_dec, weights, ids, a13_gs=a13, a2_gs=a2)
    # The intermediate is re-quantized: a few e2m1 codes may round the other way (fp32 order differs).
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=5e-2, atol=5e-2)
    native = torch.cuda.get_device_capability()[0] == 12
    done.append(f"W4A4 {plan.tier} ({'native OMMA' if native else 'exact decode + bf16 MMA'})")
    return f"T={t}, E={e}, H={h}, I={i}: " + ", ".join(done)


KINDS = ("format", "compile", "gpu")
REPORT_ENVIRONMENT = ("package", "python", "os", "gpu", "versions", "cuda_toolkit", "flashinfer_checks", "gluon",
                      "plugin")


def selected(kinds: tuple[str, ...] = KINDS, match: str | None = None) -> list[tuple[str, str, Callable[[], str]]]:
    """The checks of ``kinds`` whose name contains ``match`` (case-insensitive), in their order."""
    return [(kind, name, fn) for kind, name, fn in CHECKS
            if kind in kinds and (not match or match.lower() in name.lower())]


def run(kinds: tuple[str, ...] = KINDS, *, progress: bool = False, match: str | None = None) -> list[Result]:
    """Run the :func:`selected` checks; ``progress`` prints each name first."""
    results = []
    for kind, name, fn in selected(kinds, match):
        if progress:
            print(f"[{kind}] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        message = trace = None
        try:
            status, detail = "PASS", fn()
        except Skip as e:
            status, detail = "SKIP", str(e)
        except Exception as e:  # a selftest reports every failure and goes on
            message, trace = f"{type(e).__name__}: {e}", traceback.format_exc()
            status, detail = "FAIL", message.splitlines()[0]
        results.append(Result(kind, name, status, detail, time.perf_counter() - t0, message, trace))
    return results


def environment() -> dict:
    """What the report says about this machine (``envinfo.collect``): GPU and driver, CUDA (torch's build and the
    toolkit FlashInfer would use), torch / Triton / vLLM / FlashInfer versions (vLLM's and FlashInfer's from package
    metadata, neither is imported), Gluon on or off, the plugin switch."""
    from . import envinfo

    try:
        info = envinfo.collect()
    except Exception as e:  # the results matter more than the environment: keep what is known
        return {"package": __version__, "python": platform.python_version(), "torch": torch.__version__,
                "error": f"envinfo.collect() failed: {type(e).__name__}: {e}"}
    return {key: info[key] for key in REPORT_ENVIRONMENT}


def format_table(results: list[Result]) -> str:
    width = max([len(r.name) for r in results], default=5)
    lines = [f"{'kind':8} {'check':{width}}  status  detail"]
    lines += [f"{r.kind:8} {r.name:{width}}  {r.status:6}  {r.detail}" for r in results]
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return "\n".join(lines)


def write_report(results: list[Result], path: str) -> None:
    counts = {s.lower(): sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    with open(path, "w") as f:
        json.dump({"environment": environment(), "summary": counts, "results": [asdict(r) for r in results]}, f,
                  indent=2)
