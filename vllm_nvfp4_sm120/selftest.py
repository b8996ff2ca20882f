"""``vllm-nvfp4-sm120 selftest``: every check this machine can run, as a pass/fail table and a shareable report.

Three kinds of check, matching the proof chain of every kernel:
  format   the torch references agree with themselves and with vLLM's emulation (CPU)
  compile  each kernel compiles for sm_120 with the intended instructions, no spills, smem ≤ 99 KB (CPU)
  gpu      each kernel available on this GPU against the torch reference (needs CUDA)
What cannot run here is reported as SKIP with the reason, never as a pass.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from . import __version__
from .format import (
    GlobalScale,
    dequantize_nvfp4,
    linear_w4a4_ref,
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
    detail: str
    seconds: float


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


# ---- on this GPU ------------------------------------------------------------------------------------------------

def _need_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise Skip("no CUDA GPU on this machine")
    return torch.device("cuda")


@check("gpu", "W4A4 Triton GEMM vs torch reference (native FP4 MMA on sm_120, decomposed elsewhere)")
def _gpu_w4a4() -> str:
    dev = _need_cuda()
    from .kernels.w4a4_gemm import w4a4_gemm

    gen = torch.Generator().manual_seed(2)
    p = make_linear(512, 1024, gen=gen)
    x = torch.randn(100, 1024, generator=gen).to(torch.bfloat16)
    ref = linear_w4a4_ref(x, p.codes, p.scales, p.weight_gs, p.input_gs)
    xq = quantize_nvfp4(x, p.input_gs)
    alpha = (p.input_gs.dec * p.weight_gs.dec).to(dev)
    worst = 0.0
    for decode in (False, True):
        out = w4a4_gemm(xq.codes.to(dev), xq.scales.to(dev), p.codes.to(dev), p.scales.to(dev), alpha,
                        torch.bfloat16, decode=decode)
        torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=1e-2, atol=1e-2)
        worst = max(worst, float((out.cpu().float() - ref.float()).abs().max()))
    return f"T=100 N=512 K=1024, max |err| {worst:.3g} on {torch.cuda.get_device_name()}"


def run(kinds: tuple[str, ...] = ("format", "compile", "gpu")) -> list[Result]:
    results = []
    for kind, name, fn in CHECKS:
        if kind not in kinds:
            continue
        t0 = time.perf_counter()
        try:
            status, detail = "PASS", fn()
        except Skip as e:
            status, detail = "SKIP", str(e)
        except Exception as e:  # a selftest reports every failure and goes on
            status, detail = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        results.append(Result(kind, name, status, detail, time.perf_counter() - t0))
    return results


def environment() -> dict[str, str]:
    import triton

    env = {
        "package": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
    }
    if torch.cuda.is_available():
        env["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability())
    return env


def format_table(results: list[Result]) -> str:
    width = max(len(r.name) for r in results)
    lines = [f"{'kind':8} {'check':{width}}  status  detail"]
    lines += [f"{r.kind:8} {r.name:{width}}  {r.status:6}  {r.detail}" for r in results]
    counts = {s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIP")}
    lines.append(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return "\n".join(lines)


def write_report(results: list[Result], path: str) -> None:
    with open(path, "w") as f:
        json.dump({"environment": environment(), "results": [asdict(r) for r in results]}, f, indent=2)
