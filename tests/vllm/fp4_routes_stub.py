"""Make the cuBLAS and b12x routes selectable on a CPU-only machine.

The refusal functions of ``kernels/fp4_routes.py`` (rightly) refuse a CPU or a missing toolkit; here they are
replaced to accept, while the real load-time layout functions run.  A stand-in module is used only if the real
one lacks a name.  On CPU the op computes the torch reference and never calls the route GEMMs.
"""

from __future__ import annotations

import importlib
import sys
import types

import torch
import torch.nn.functional as F

from vllm_nvfp4_sm120.format import round_up, swizzle_128x4

NAMES = ("cublas_refusal", "prepare_cublas_weight", "scaled_mm_nvfp4", "b12x_refusal", "prepare_b12x_weight",
         "b12x_linear")
REFUSALS = ("cublas_refusal", "b12x_refusal")


def _prepare_b12x_weight(codes: torch.Tensor, scales: torch.Tensor):
    n, k = codes.shape[0], codes.shape[1] * 2
    np_, kp = round_up(n, 32), round_up(k, 32)
    codes_p = F.pad(codes, (0, (kp - k) // 2, 0, np_ - n))
    scales_p = F.pad(scales.view(torch.uint8), (0, (kp - k) // 16, 0, np_ - n)).view(torch.float8_e4m3fn)
    return codes_p, swizzle_128x4(scales_p)


def _not_on_cpu(*args, **kwargs):
    raise NotImplementedError("fp4_routes stub: GPU route called")


def install(mp) -> types.ModuleType:
    """Make ``vllm_nvfp4_sm120.kernels.fp4_routes`` provide :data:`NAMES`, with refusals that accept."""
    name = "vllm_nvfp4_sm120.kernels.fp4_routes"
    try:
        real = importlib.import_module(name)
        if all(hasattr(real, n) for n in NAMES):
            for refusal in REFUSALS:
                mp.setattr(real, refusal, lambda capability, n, k, **kw: None)
            return real
    except ImportError:
        pass
    stub = types.ModuleType(name)
    stub.cublas_refusal = stub.b12x_refusal = lambda capability, n, k, **kw: None
    stub.prepare_b12x_weight = _prepare_b12x_weight
    stub.prepare_cublas_weight = lambda codes, scales: (codes, swizzle_128x4(scales))
    stub.scaled_mm_nvfp4 = stub.b12x_linear = _not_on_cpu
    mp.setitem(sys.modules, name, stub)
    mp.setattr(importlib.import_module("vllm_nvfp4_sm120.kernels"), "fp4_routes", stub, raising=False)
    return stub
