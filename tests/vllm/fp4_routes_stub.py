"""A stand-in for ``kernels/fp4_routes.py`` (being written in parallel) with the names the glue calls.

Used only when the real module lacks them; on CPU the op computes the torch reference and never calls the
route functions, so the stub only has to get the load-time layout right.
"""

from __future__ import annotations

import importlib
import sys
import types

import torch
import torch.nn.functional as F

from vllm_nvfp4_sm120.format import round_up, swizzle_128x4

NAMES = ("cublas_refusal", "scaled_mm_nvfp4", "b12x_refusal", "prepare_b12x_weight", "b12x_linear")


def _prepare_b12x_weight(codes: torch.Tensor, scales: torch.Tensor):
    n, k = codes.shape[0], codes.shape[1] * 2
    np_, kp = round_up(n, 32), round_up(k, 32)
    codes_p = F.pad(codes, (0, (kp - k) // 2, 0, np_ - n))
    scales_p = F.pad(scales.view(torch.uint8), (0, (kp - k) // 16, 0, np_ - n)).view(torch.float8_e4m3fn)
    return codes_p, swizzle_128x4(scales_p)


def _not_on_cpu(*args, **kwargs):
    raise NotImplementedError("fp4_routes stub: GPU route called")


def install(mp) -> types.ModuleType:
    """Make ``vllm_nvfp4_sm120.kernels.fp4_routes`` provide :data:`NAMES` (real module if it has them)."""
    name = "vllm_nvfp4_sm120.kernels.fp4_routes"
    try:
        real = importlib.import_module(name)
        if all(hasattr(real, n) for n in NAMES):
            return real
    except ImportError:
        pass
    stub = types.ModuleType(name)
    stub.cublas_refusal = lambda n, k, device: None
    stub.b12x_refusal = lambda n, k, device: None
    stub.prepare_b12x_weight = _prepare_b12x_weight
    stub.scaled_mm_nvfp4 = stub.b12x_linear = _not_on_cpu
    mp.setitem(sys.modules, name, stub)
    mp.setattr(importlib.import_module("vllm_nvfp4_sm120.kernels"), "fp4_routes", stub, raising=False)
    return stub
