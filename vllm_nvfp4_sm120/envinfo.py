"""``vllm-nvfp4-sm120 env``: what this machine has, and which of our kernels would serve NVFP4 layers on it.

Fast and safe anywhere: versions come from package metadata (vLLM and FlashInfer are not imported), the CUDA
toolkit is found the way FlashInfer's JIT finds it, and without a GPU the report says so and shows the sm_120
plan instead.  :func:`linear_plan` and :func:`moe_plan` are shared with ``inspect``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from . import __version__
from .dispatch import configs as dispatch_configs
from .dispatch import linear as dispatch_linear
from .dispatch import moe as dispatch_moe
from .dispatch.hw import NO_GPU, Capability, Family
from .dispatch.linear import AUTO_BACKEND, backend_name
from .dispatch.vendor import B12X_MIN_CUDA
from .kernels.gluon_compat import ENV_DISABLE as GLUON_SWITCH
from .kernels.gluon_moe_decode import MoeStreamTile

PLUGIN_SWITCH = "VLLM_NVFP4_SM120"  # vllm/register.py ENV_SWITCH (that module imports vLLM, which `env` avoids)
MOE_BACKEND = AUTO_BACKEND  # --moe-backend: our experts have one name
# Token counts at which the MoE plan is shown (decode, small batch, prefill chunk, large prefill).
MOE_SAMPLE_TOKENS = (1, 16, 256, 4096)
# FlashInfer 0.7.2's CUDA requirements on sm_120: the b12x dense GEMM (dispatch.vendor), and CUDA 13 for the b12x
# fused MoE and the cute-dsl GEMM.
FI_CU13_MIN_CUDA = (13, 0)


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- CUDA toolkit, as FlashInfer's JIT sees it --------------------------------------------------------------------

@dataclass
class CudaToolkit:
    nvcc: str | None  # path, or None
    version: str | None  # "13.0"
    source: str  # "nvcc" or "torch.version.cuda (no nvcc)"


def find_cuda_toolkit() -> CudaToolkit:
    """FlashInfer's ``get_cuda_version``: nvcc under $CUDA_HOME, $CUDA_PATH, PATH or /usr/local/cuda, else torch's."""
    candidates = [os.path.join(os.environ[v], "bin", "nvcc") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    if (on_path := shutil.which("nvcc")) is not None:
        candidates.append(on_path)
    candidates.append("/usr/local/cuda/bin/nvcc")
    for nvcc in candidates:
        if not os.path.isfile(nvcc):
            continue
        try:
            out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        if m := re.search(r"release (\d+\.\d+),", out):
            return CudaToolkit(nvcc, m.group(1), "nvcc")
    return CudaToolkit(None, torch.version.cuda, "torch.version.cuda (no nvcc)")


def _ver(v: str | None) -> tuple[int, int]:  # "12.9" -> (12, 9); None -> (0, 0)
    if not v:
        return (0, 0)
    parts = [int(p) for p in re.findall(r"\d+", v)[:2]]
    return tuple(parts + [0] * (2 - len(parts)))  # type: ignore[return-value]


def flashinfer_checks(tk: CudaToolkit) -> list[tuple[str, bool, str]]:
    """(what, ok, why) for the FlashInfer NVFP4 paths vLLM may pick on sm_120."""
    cuda = _ver(tk.version)
    have = f"CUDA {tk.version or '?'} from {tk.source}"
    return [
        ("vLLM's has_flashinfer() (needs nvcc on PATH or flashinfer-cubin)",
         tk.nvcc is not None or _dist_version("flashinfer-cubin") is not None,
         f"nvcc at {tk.nvcc}" if tk.nvcc else "no nvcc: vLLM skips every FlashInfer kernel"),
        ("FlashInfer JIT of CUDA kernels (cutlass mm_fp4, cutlass_fused_moe; nvcc)", tk.nvcc is not None,
         have),
        (f"b12x dense GEMM (CUDA >= {B12X_MIN_CUDA})", cuda >= _ver(B12X_MIN_CUDA), have),
        ("b12x fused MoE, cute-dsl GEMM (CUDA >= 13.0)", cuda >= FI_CU13_MIN_CUDA, have),
    ]


# ---- our plans -----------------------------------------------------------------------------------------------------

def _t_range(lo: int, hi: int | None) -> str:
    if hi is None:
        return f"T >= {lo}"
    return f"T = {lo}" if lo == hi else f"T {lo}-{hi}"


def _plan_str(plan: dispatch_linear.LinearPlan) -> str:
    kw = plan.kwargs
    if plan.kernel == dispatch_linear.LinearKernel.GLUON_GEMV_STREAM:
        cap = f", <= {kw['max_regs']} registers" if kw.get("max_regs") else ""
        return (f"{plan.kernel} {kw['block_m']}x{kw['block_t']}, {kw['num_warps']} warps ({kw['row_warps']} over "
                f"rows){cap}, {kw['ctas']} CTAs")
    if {"block_m", "block_n", "block_k"} <= kw.keys():
        return f"{plan.kernel} {kw['block_m']}x{kw['block_n']}x{kw['block_k']}, {kw.get('num_warps', '?')} warps"
    return plan.kernel


def linear_plan(cc: int, route: str) -> list[tuple[str, str, str]]:
    """``[(T range, kernel and tile, why), ...]`` of ``dispatch.linear`` for this route on compute capability ``cc``
    (e.g. 120); ValueError if none."""
    cap = Capability(cc)
    dispatch_linear.select_linear(cap, route, 1, 16, 16)  # raises ValueError with the reason when unsupported
    rows = dispatch_linear.TABLE[cap.family][route]
    out, lo = [], 1
    for row in rows:
        # The row's kernel as it resolves at the start of its T range (W4A16 rows pick Gluon or Triton and a tile
        # per shape; a 5120 x 5120 layer stands for "a typical linear").
        plan = dispatch_linear.select_linear(cap, route, lo, 5120, 5120)
        out.append((_t_range(lo, row.max_t), _plan_str(plan), row.why))
        if row.max_t is None:
            break
        lo = row.max_t + 1
    return out


def moe_plan(capability: tuple[int, int] | None, *, w4a4: bool, hidden: int, intermediate: int, top_k: int,
             experts: int, tokens=MOE_SAMPLE_TOKENS) -> list[tuple[str, str]]:
    """``[(T, plan), ...]`` of ``dispatch.moe`` at a few batch sizes on ``capability`` (``(major, minor)``, as torch
    reports it; None: no GPU)."""
    cap = NO_GPU if capability is None else Capability(capability[0] * 10 + capability[1])
    out = []
    for t in tokens:
        p = dispatch_moe.select_moe_plan(cap, num_tokens=t, top_k=top_k, global_experts=experts,
                                         hidden=hidden, intermediate=intermediate, w4a4=w4a4)
        m = dispatch_moe.tokens_per_expert(t, top_k, experts)
        stream = isinstance(p.gate_up, MoeStreamTile)  # the streaming Gluon gate_up
        tma = "TMA " if (not stream and p.gate_up.use_tma) or (p.stream_down is None and p.down.use_tma) else ""
        down = ("gate_up and down in one launch" if p.decode_down == "fused"
                else "streaming expert-major down" if p.stream_down is not None else f"{p.decode_down}-major down")
        kind = (f"{p.kernel} align-free decode ({down})" if p.impl == "decode" else f"{p.kernel} BLOCK_M {p.block_m}")
        gate_up = (f"streaming {p.gate_up.block_m}x{p.gate_up.block_t}" if stream
                   else f"{p.gate_up.block_n}x{p.gate_up.block_k}")
        down_tile = (f"streaming {p.stream_down.block_m}x{p.stream_down.block_t}" if p.stream_down is not None
                     else f"{p.down.block_n}x{p.down.block_k}")
        out.append((f"T = {t} ({m:g} rows/expert)",
                    f"{kind}, gate_up {gate_up} / down {down_tile} {tma}[{p.tier}]"))
    return out


def serving_summary(cap: Capability | None) -> list[str]:
    """Which kernels vLLM would use for NVFP4 layers once the plugin is installed, per checkpoint kind."""
    if cap is None:
        return ["no CUDA GPU: vLLM cannot serve here; the plan below is the one an sm_120 GPU gets"]
    if cap.family is Family.SM120:
        return [
            "W4A4 linears: ours automatically (--linear-backend auto; nvfp4_sm120_triton)",
            "W4A16 linears: vLLM forces Marlin; name ours with --linear-backend nvfp4_sm120 (or nvfp4_sm120_w4a16)",
            f"MoE experts: ours with --moe-backend {MOE_BACKEND}",
        ]
    return [
        f"{cap.name}: vLLM's own kernels unless you name ours (--linear-backend {AUTO_BACKEND}_<route>, "
        f"--moe-backend {MOE_BACKEND}); ours run here for tests and benchmarks (FP4 MMA emulated below sm_120)",
    ]


# ---- the report ----------------------------------------------------------------------------------------------------

def _gpu() -> dict:
    if not torch.cuda.is_available():
        return {"available": False}
    props = torch.cuda.get_device_properties(0)
    info = {
        "available": True,
        "count": torch.cuda.device_count(),
        "name": props.name,
        "capability": f"sm_{props.major}{props.minor}",
        "cc": props.major * 10 + props.minor,
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
    }
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.split()
        info["driver"] = out[0] if out else None
    except (OSError, subprocess.SubprocessError):
        info["driver"] = None
    return info


def _gluon() -> dict:
    from .kernels import gluon_compat

    enabled = gluon_compat.gluon_enabled()
    if enabled:
        why = f"set {GLUON_SWITCH}=1 to turn them off"
    elif not gluon_compat.HAS_GLUON:
        why = f"this Triton has no Gluon >= {'.'.join(map(str, gluon_compat.MIN_TRITON))}"
    else:
        why = f"turned off by {GLUON_SWITCH}={os.environ.get(GLUON_SWITCH)}"
    return {"enabled": enabled, "why": why}


def collect() -> dict:
    """Everything ``env`` prints, as JSON-able data."""
    import triton

    gpu = _gpu()
    cap = Capability(gpu["cc"], gpu["sms"], gpu["name"]) if gpu["available"] else None
    plan_cc = cap.cc if cap is not None else 120  # without a GPU: the plan an sm_120 gets
    tk = find_cuda_toolkit()
    plugin_off = os.environ.get(PLUGIN_SWITCH, "1").strip().lower() in ("0", "false", "off", "no")
    info = {
        "package": __version__,
        "python": platform.python_version(),
        "os": platform.platform(),
        "gpu": gpu,
        "versions": {
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": triton.__version__,
            "vllm": _dist_version("vllm"), "flashinfer": _dist_version("flashinfer-python"),
            "nvidia-cutlass-dsl": _dist_version("nvidia-cutlass-dsl"),
            "compressed-tensors": _dist_version("compressed-tensors"),
        },
        "cuda_toolkit": {"nvcc": tk.nvcc, "version": tk.version, "source": tk.source},
        "flashinfer_checks": [{"what": w, "ok": ok, "detail": d} for w, ok, d in flashinfer_checks(tk)],
        "gluon": _gluon(),
        "plugin": {"enabled": not plugin_off,
                   "why": f"{PLUGIN_SWITCH}={os.environ.get(PLUGIN_SWITCH)}" if plugin_off else f"{PLUGIN_SWITCH} unset or 1",
                   "linear_backends": [AUTO_BACKEND] + [backend_name(r) for r in dispatch_linear.ROUTES],
                   "moe_backend": MOE_BACKEND},
        "plan_for": f"sm_{plan_cc}" + ("" if cap is not None else " (no GPU here: the sm_120 plan)"),
        "serving": serving_summary(cap),
        "linear_plan": {},
        "moe_plan": {},
        "measured_configs": dispatch_configs.describe(cap),
    }
    for route in dispatch_linear.ROUTES:
        try:
            info["linear_plan"][route] = [dict(t=t, kernel=k, why=w) for t, k, w in linear_plan(plan_cc, route)]
        except ValueError as e:
            info["linear_plan"][route] = str(e)
    # A Qwen3-30B-A3B-sized MoE layer (hidden 2048, intermediate 768, 128 experts, top-8) as the example.
    for kind, w4a4 in (("w4a4", True), ("w4a16", False)):
        plans = moe_plan(divmod(plan_cc, 10), w4a4=w4a4, hidden=2048, intermediate=768, top_k=8, experts=128)
        info["moe_plan"][kind] = [dict(t=t, plan=p) for t, p in plans]
    return info


def _yes(ok: bool) -> str:
    return "ok " if ok else "NO "


def format_env(info: dict) -> str:
    g, v = info["gpu"], info["versions"]
    lines = [f"vllm-nvfp4-sm120 {info['package']}  (python {info['python']}, {info['os']})", ""]
    if g["available"]:
        lines.append(f"GPU        {g['name']} ({g['capability']}, {g['sms']} SMs, {g['memory_gib']} GiB) "
                     f"x{g['count']}, driver {g.get('driver') or '?'}")
        if g["cc"] // 10 != 12:
            lines.append("           not an sm_120 GPU: our kernels run only when named; the FP4 MMA is emulated")
    else:
        lines.append("GPU        none (no CUDA device visible): showing the sm_120 plan")
    lines.append(f"torch      {v['torch']} (CUDA {v['torch_cuda']})   triton {v['triton']}")
    lines.append(f"vllm       {v['vllm'] or 'not installed'}   flashinfer {v['flashinfer'] or 'not installed'}   "
                 f"cutlass-dsl {v['nvidia-cutlass-dsl'] or '-'}   compressed-tensors {v['compressed-tensors'] or '-'}")
    tk = info["cuda_toolkit"]
    lines.append(f"CUDA       {tk['version'] or '?'} via {tk['source']}" + (f" ({tk['nvcc']})" if tk["nvcc"] else ""))
    for c in info["flashinfer_checks"]:
        lines.append(f"  {_yes(c['ok'])} {c['what']}: {c['detail']}")
    gl = info["gluon"]
    lines.append(f"Gluon      {'enabled' if gl['enabled'] else 'disabled'} ({gl['why']})")
    pl = info["plugin"]
    lines.append(f"plugin     {'enabled' if pl['enabled'] else 'DISABLED'} ({pl['why']}); "
                 f"--linear-backend {' | '.join(pl['linear_backends'])}; --moe-backend {pl['moe_backend']}")
    lines += ["", f"Serving on {info['plan_for']}:"] + [f"  {s}" for s in info["serving"]]
    lines += ["", f"Linear plan per route ({info['plan_for']}; the built-in table, for a 5120 x 5120 linear):"]
    for route, rows in info["linear_plan"].items():
        if isinstance(rows, str):
            lines.append(f"  {route:17} {rows}")
            continue
        for i, r in enumerate(rows):
            lines.append(f"  {route if i == 0 else '':17} {r['t']:10} {r['kernel']:44} {r['why']}")
    lines += ["", "MoE plan (example: hidden 2048, intermediate 768, 128 experts, top-8):"]
    for kind, rows in info["moe_plan"].items():
        for i, r in enumerate(rows):
            lines.append(f"  {kind + ' ckpt' if i == 0 else '':11} {r['t']:28} {r['plan']}")
    return "\n".join(lines + measured_lines(info["measured_configs"]))


def measured_lines(mc: dict) -> list[str]:
    """The measured configs found and the rows they give this GPU (``dispatch.configs.describe``)."""
    lines = ["", f"Measured configs (${mc['env']}: {mc['user_dir'] or 'unset'}; shipped: {mc['shipped_dir']}):"]
    for f in mc["files"]:
        state = f"IGNORED: {f['error']}" if f["error"] else f"{f['buckets']} shape(s)"
        lines.append(f"  [{f['source']}] {Path(f['path']).name}: {state}"
                     + ("" if f["for_this_gpu"] else " (another GPU)"))
    if not mc["files"]:
        lines.append("  none found")
    if mc["device"] is None:
        lines.append("  no GPU here: measured configs apply per GPU model; the plans above are the built-in tables'")
    elif not mc["rows"]:
        lines.append(f"  none for this GPU ({mc['device']}): every choice is the built-in tables' "
                     "(`vllm-nvfp4-sm120 tune` measures them)")
    else:
        lines.append(f"  rows from measured files on this GPU ({mc['device']}; every other shape and T: the built-in "
                     "tables):")
        lines += [f"    {r['family']:13} {r['bucket']:28} {r['t']:14} {r['choice']}  [{r['source']}]"
                  for r in mc["rows"]]
    return lines
