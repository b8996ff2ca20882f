"""One call of the linear op: its checks, and the cache that makes the hot path a dict lookup and a launch.

Prefill runs outside CUDA graphs, so every call pays its host time.  What a call needs besides its tensors' data
depends only on their *metadata* (shapes, strides, dtypes, devices) and the route: which checks pass, which plan
the dispatch picks for its T, N, K and GPU, and the ready launcher of that plan (grid, compile-time arguments,
derived sizes; ``registry.prepare_linear``).  So the first call with a given metadata signature validates every
tensor (:func:`check_linear_call`, the errors a user sees), selects the plan and builds the launcher; later calls
with the same signature hash it, find the entry and launch.  A layer's weights keep their metadata after load, so
in a model their checks run once per layer shape, and only x changes from call to call (its T is part of the
key: plans change with T at the table's and the measured configs' row bounds).

The plans also depend on the process state the selectors read: the measured config files (``configs.clear_cache``
forgets them, and the cache with them), the numerics policy (``policy.current_policy()``, part of the key) and the
environment variables in :data:`SELECTOR_ENV` (part of the key).
"""

from __future__ import annotations

import os

import torch

from ..format import GlobalScale, linear_w4a16_ref, quantize_nvfp4, unit_values
from ..format.checks import ACT_DTYPES, E4M3_DTYPES, check_tensor
from ..format.swizzle import swizzled_shape
from ..kernels.common import trivial_linear_output
from ..kernels.fp4_routes import B12X_ALIGN
from ..kernels.gluon_compat import ENV_DISABLE
from .hw import SM120_REFERENCE, capability_of
from .linear import ROUTES, LinearPlan, Route, select_linear
from .policy import current_policy
from .registry import Ready, prepare_linear

# Environment variables the selectors read per call (a change takes effect at the next call).
SELECTOR_ENV: tuple[str, ...] = (ENV_DISABLE,)
# Routes whose W4A4 prefill kernel reads the 128x4-swizzled copy of the weight scales.
SWIZZLED_ROUTES = (Route.CUBLAS, Route.B12X)
# Entries are small; the bound only keeps a process that sees unboundedly many shapes from growing without end.
MAX_ENTRIES = 1 << 16

_CACHE: dict[tuple, object] = {}


def clear() -> None:
    """Forget every cached entry (after anything the selectors read changed)."""
    _CACHE.clear()


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def check_linear_call(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, route) -> tuple:
    """Every check of one linear op call, before anything is sliced: ``(T, N, K)``.

    N is ``len(w_dec_rows)`` and K is x's last dimension; the codes are ``[N, K/2]`` (route b12x: also its padded
    ``[N, K]`` rounded up to 32), the linear scales ``[N, K/16]``.  The same rules hold on CPU (the reference) and
    on a GPU: activations bf16/fp16 (the kernels' only inputs), every tensor on x's device.
    """
    if route not in ROUTES:
        raise ValueError(f"route: expected one of {[str(r) for r in ROUTES]}, got {route!r}")
    if route == Route.FLASHINFER_W4A16:
        raise ValueError("route 'flashinfer_w4a16' runs on FlashInfer's prepared weight: call "
                         "torch.ops.nvfp4_sm120.flashinfer_w4a16, not nvfp4_sm120.linear")
    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    t, k = x.shape
    if k % 16:
        raise ValueError(f"x: K = {k} (shape {list(x.shape)}) must be a multiple of 16 (one e4m3 scale per 16 weights)")
    dev = x.device
    check_tensor("w_dec_rows", w_dec_rows, dtype=torch.float32, ndim=1, device=dev)
    n = w_dec_rows.shape[0]
    if n > 1 and w_dec_rows.stride(0) != 1:
        raise ValueError(f"w_dec_rows: must be contiguous, got stride {w_dec_rows.stride()}")
    check_tensor("w_codes", w_codes, dtype=torch.uint8, ndim=2, device=dev, last_dim_contiguous=True)
    shapes = [[n, k // 2]]
    if route == Route.B12X:
        shapes.append([_round_up(n, B12X_ALIGN), _round_up(k, B12X_ALIGN) // 2])
    if list(w_codes.shape) not in shapes:
        want = " or ".join(map(str, shapes))
        raise ValueError(f"w_codes: expected shape {want} for N = {n} (len(w_dec_rows)) and K = {k} (x's last "
                         f"dimension), got {list(w_codes.shape)}")
    check_tensor("w_scales", w_scales, dtype=E4M3_DTYPES, device=dev, last_dim_contiguous=True)
    if list(w_scales.shape) != [n, k // 16]:
        raise ValueError(f"w_scales: expected shape [{n}, {k // 16}] for N = {n} (len(w_dec_rows)) and K = {k} "
                         f"(x's last dimension), got {list(w_scales.shape)}")
    if w_scales_swizzled is not None or route in SWIZZLED_ROUTES:
        what = f"w_scales_swizzled (route {route!r}: the 128x4-swizzled e4m3 scales)"
        check_tensor(what, w_scales_swizzled, dtype=E4M3_DTYPES, shape=list(swizzled_shape(n, k // 16)), device=dev)
    for name, s in (("in_enc", in_enc), ("alpha", alpha)):
        if s is not None:
            check_tensor(name, s, dtype=torch.float32, device=dev)
            if s.numel() != 1:
                raise ValueError(f"{name}: expected one fp32 value (0-d or [1]), got shape {list(s.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtype=x.dtype, shape=[n], device=dev)
        if n > 1 and bias.stride(0) != 1:
            raise ValueError(f"bias: must be contiguous, got stride {bias.stride()}")
    return t, n, k


def plan_reference(plan: LinearPlan, x, w_codes, w_scales, w_dec_rows, in_enc, alpha, bias):
    n, k = w_dec_rows.shape[0], x.shape[1]
    codes, scales = w_codes[:n, : k // 2], w_scales[:n, : k // 16]  # a route may have padded the weight
    if not plan.is_w4a4:
        return linear_w4a16_ref(x, codes, scales, w_dec_rows, bias=bias)
    xq = quantize_nvfp4(x, GlobalScale.from_encode(in_enc))
    acc = (unit_values(*xq) @ unit_values(codes, scales).t()) * alpha.to(torch.float32)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(x.dtype)


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _build(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, route):
    """The entry of a new signature: every check, the plan, the ready launcher ``run(...) -> out``."""
    t, n, k = check_linear_call(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, route)
    dev, dtype = x.device, x.dtype
    cap = capability_of(dev) if dev.type == "cuda" else SM120_REFERENCE
    plan = select_linear(cap, route, t, n, k)
    if plan.is_w4a4 and (in_enc is None or alpha is None):
        raise ValueError(f"route {route!r} runs W4A4 at T = {t}: in_enc and alpha are required")
    if dev.type != "cuda":
        # The torch reference of the plan an sm_120 GPU runs, so the CPU tests see that kernel's numerics.
        if current_policy().batch_invariant and t > 1:
            # The CPU matmul picks its kernel by M (rows may differ in the last bits between T = 1 and T = 16): one
            # row at a time, as the batch-invariant GPU plan computes each row independently of the others.
            return lambda x, c, s, d, sw, e, a, b: torch.cat([plan_reference(plan, x[i:i + 1], c, s, d, e, a, b)
                                                              for i in range(x.shape[0])])
        return lambda x, c, s, d, sw, e, a, b: plan_reference(plan, x, c, s, d, e, a, b)
    if t == 0 or n == 0 or k == 0:
        def trivial(x, c, s, d, sw, e, a, b):
            return trivial_linear_output(torch.empty((t, n), dtype=dtype, device=dev), k, d, b)

        return trivial
    ready = Ready(t, n, k, dev, dtype, bias is not None, codes_padded=tuple(w_codes.shape) != (n, k // 2),
                  scales_u8=w_scales.dtype == torch.uint8)
    return prepare_linear(plan, ready)


def linear(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, route: str) -> torch.Tensor:
    """The linear op's body: find (or build) the entry of this call's signature and run it."""
    key = (route, _meta(x), _meta(w_codes), _meta(w_scales), _meta(w_dec_rows), _meta(w_scales_swizzled),
           _meta(in_enc), _meta(alpha), _meta(bias), current_policy(), *map(os.environ.get, SELECTOR_ENV))
    run = _CACHE.get(key)
    if run is None:
        run = _build(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, route)
        if len(_CACHE) >= MAX_ENTRIES:
            _CACHE.clear()
        _CACHE[key] = run
    return run(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias)
