"""Which kernel and tile serve an NVFP4 linear: ``(compute capability, route, T, N, K) → LinearPlan``.

A *route* is what the user names (``--linear-backend nvfp4_sm120_<route>``); it fixes the prefill GEMM.  Small
batches go to a W4A16 kernel on the same weight whatever the route: at decode sizes the GEMM is bound by reading
the weight, and a W4A16 kernel reads the same bytes without quantizing the activation first.

The table is data: one list of rows per (architecture family, route), first row whose ``max_t`` admits T wins.
Tiles were compile-checked for sm_120 (no spills, smem ≤ 99 KB) in ``tests/dispatch/test_linear_dispatch.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROUTES = ("triton", "cublas", "b12x", "w4a16", "flashinfer_w4a16")
W4A4_ROUTES = ("triton", "cublas", "b12x")


@dataclass(frozen=True)
class LinearPlan:
    kernel: str  # a key of dispatch.ops.LINEAR_KERNELS
    params: tuple[tuple[str, object], ...] = ()

    @property
    def kwargs(self) -> dict[str, object]:
        return dict(self.params)

    @property
    def is_w4a4(self) -> bool:
        return self.kernel.startswith("w4a4")


@dataclass(frozen=True)
class Row:
    max_t: int | None  # None: any T
    plan: LinearPlan
    why: str = field(default="", compare=False)


def _p(kernel: str, **params) -> LinearPlan:
    return LinearPlan(kernel, tuple(sorted(params.items())))


# W4A4 tiles of kernels/w4a4_gemm.py.  128x128x128 needs 8 warps (4 warps spill 16 B on sm_120);
# 64x128 keeps more CTAs in flight for mid-sized T.
_W4A4_BIG = _p("w4a4_triton", block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3)
_W4A4_MID = _p("w4a4_triton", block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=3)
_W4A16_SMALL = _p("w4a16_gemv")
_W4A16_BIG = _p("w4a16_gemm")

_SM120: dict[str, list[Row]] = {
    "triton": [
        Row(16, _W4A16_SMALL, "decode sizes: weight-read bound, skip the activation quant"),
        Row(64, _W4A4_MID, "few row tiles: narrower M keeps all SMs busy"),
        Row(None, _W4A4_BIG, "prefill: largest tile that fits without spills"),
    ],
    "cublas": [
        Row(16, _W4A16_SMALL, "cuBLAS FP4 pays the activation quant at decode sizes"),
        Row(None, _p("w4a4_cublas"), "prefill: cuBLAS block-scaled FP4 GEMM"),
    ],
    "b12x": [
        Row(8, _W4A16_SMALL, "b12x is tuned down to small M; below 8 the W4A16 read wins"),
        Row(None, _p("w4a4_b12x"), "prefill: FlashInfer b12x"),
    ],
    "w4a16": [
        Row(16, _W4A16_SMALL, "decode sizes"),
        Row(None, _W4A16_BIG, "prefill, no activation scales (W4A16 checkpoint)"),
    ],
    "flashinfer_w4a16": [Row(None, _p("fi_w4a16"), "FlashInfer mm_bf16_fp4 on its repacked weight (named only)")],
}

# Hopper and older: only the portable kernels.  The W4A4 Triton kernel runs there with the FP4 MMA decomposed by
# Triton (>= 3.8) into an exact decode + wgmma: correct, not fast; it exists for the proofs and benchmarks.
_PORTABLE: dict[str, list[Row]] = {
    "triton": _SM120["triton"],
    "w4a16": _SM120["w4a16"],
}

TABLE: dict[int, dict[str, list[Row]]] = {12: _SM120, 10: _PORTABLE, 9: _PORTABLE, 8: _PORTABLE}


def _rows(cc: int, route: str) -> list[Row]:
    if route not in ROUTES:
        raise ValueError(f"route: expected one of {ROUTES}, got {route!r}")
    family = TABLE.get(cc // 10)
    if family is None or route not in family:
        raise ValueError(f"route {route!r} has no kernels for compute capability {cc}")
    return family[route]


def select_linear(cc: int, route: str, t: int, n: int, k: int) -> LinearPlan:
    """The plan for one call; ``cc`` is e.g. 120 for sm_120."""
    for row in _rows(cc, route):
        if row.max_t is None or t <= row.max_t:
            return row.plan
    raise AssertionError("every route's last row admits any T")


def small_t_threshold(cc: int, route: str) -> int:
    """Largest T that goes to the W4A16 kernel on this route (0 if none)."""
    return max((r.max_t or 0) for r in _rows(cc, route) if not r.plan.is_w4a4 and r.max_t is not None)


def all_linear_plans() -> list[LinearPlan]:
    """Every plan the table can return, for tests that walk them all."""
    seen: dict[LinearPlan, None] = {}
    for family in TABLE.values():
        for rows in family.values():
            for row in rows:
                seen.setdefault(row.plan)
    return list(seen)
