"""Which launcher runs a plan: one entry per plan kind.

* :data:`LINEAR_KERNELS`: ``LinearKernel`` → an adapter with the linear op's arguments (the weight as the layer
  keeps it, the route's swizzled scales and activation scales) and the plan's tile as keywords.
* :data:`MOE_KERNELS`: ``(MoeKernel, Impl)`` → the ``(gate_up, down)`` launchers of the MoE layer flow; the Gluon
  ones take the Triton ones' arguments; the decode pair (``Impl.DECODE``, W4A16 only) takes the routing tensors
  directly (no alignment), its down one of the two down kernels by the plan's ``by_expert``.

* :func:`prepare_linear`: a plan's *ready* launcher for one shape, what the linear op caches per shape: the grid,
  compile-time arguments and derived sizes fixed once, the launch checking nothing (the op validated its inputs).
  Kernels without a ready form (the vendor routes) run their validating adapter with the plan's tile bound.

* :func:`prepare_moe`: the same for the MoE flow, per call signature (:data:`READY_MOE`: the decode plan's one,
  two or three launches, the tiers' align, (input quantization,) GEMMs and sum).

Plus the Gluon gemv on the tile the dispatch picks (:func:`gemv`), for tools and tests that call it directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels import (fp4_routes, gluon_gemv, gluon_gemv_stream, gluon_moe_decode, gluon_moe_w4a4, gluon_moe_w4a16,
                       moe_align, moe_decode, moe_decode_fused, moe_w4a4, moe_w4a16)
from ..kernels.act_quant import prepare_act_quant, quantize_act_nvfp4
from ..kernels.launch import StreamCounters
from ..kernels.w4a4_gemm import prepare_w4a4_gemm, w4a4_gemm
from ..kernels.w4a16_dequant import prepare_w4a16_dequant_mm, w4a16_dequant_mm
from ..kernels.w4a16_linear import prepare_w4a16_gemm, prepare_w4a16_gemv, w4a16_gemm, w4a16_gemv
from . import vendor
from .hw import capability_of
from .linear import GLUON_GEMV_MAX_T, LinearKernel, Route, act_quant_config, gluon_gemv_plan
from .moe import DecodeDown, Impl, MoeKernel


def _logical(w_codes, w_scales, n, k):
    """Views of the first N rows and K columns: a route may have padded the weight in place (b12x pads to 32)."""
    return w_codes[:n, : k // 2], w_scales[:n, : k // 16]


def _require(route: Route, x: torch.Tensor, n: int, k: int, **kw) -> None:
    """The vendor route's requirement, for a call with work on a GPU (CPU tensors and T = 0 are the launchers'
    own cases: they refuse the former, return the empty output for the latter)."""
    if x.is_cuda and x.shape[0]:
        vendor.require(route, x, n, k, **kw)


# ---- linear: one adapter per LinearKernel, all with the op's arguments ------------------------------------------

def _w4a4_triton(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, **tile):
    a_codes, a_scales = quantize_act_nvfp4(x, in_enc, **act_quant_config(*x.shape))
    codes, scales = _logical(w_codes, w_scales, w_dec_rows.shape[0], x.shape[1])
    return w4a4_gemm(a_codes, a_scales, codes, scales, alpha, x.dtype, bias=bias, **tile)


def _w4a4_cublas(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias):
    _require(Route.CUBLAS, x, w_codes.shape[0], x.shape[1])
    a_codes, a_scales = quantize_act_nvfp4(x, in_enc, swizzled=True, **act_quant_config(*x.shape, swizzled=True))
    return fp4_routes.scaled_mm_nvfp4(a_codes, a_scales, w_codes, w_scales_swizzled, alpha, x.dtype, bias=bias)


def _w4a4_b12x(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias):
    n = w_dec_rows.shape[0]
    _require(Route.B12X, x, n, x.shape[1])
    return fp4_routes.b12x_linear(x, w_codes, w_scales_swizzled, in_enc, alpha, n=n, bias=bias,
                                  quant_tile=act_quant_config(*x.shape, swizzled=True))


def _w4a16(launch):
    def run(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, **tile):
        codes, scales = _logical(w_codes, w_scales, w_dec_rows.shape[0], x.shape[1])
        return launch(x, codes, scales, w_dec_rows, bias, **tile)

    return run


def _gluon(tile_cls, launch):
    def run(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, **tile):
        codes, scales = _logical(w_codes, w_scales, w_dec_rows.shape[0], x.shape[1])
        return launch(x, codes, scales, w_dec_rows, bias=bias, tile=tile_cls(**tile))

    return run


def run_flashinfer_w4a16(x, b, sf, alpha, bias, n: int, backend: str):
    """Route flashinfer_w4a16: ``mm_bf16_fp4`` on FlashInfer's prepared ``(b, sf, alpha)`` for ``backend``."""
    _require(Route.FLASHINFER_W4A16, x, n, x.shape[1], backend=backend)
    return fp4_routes.flashinfer_w4a16_linear(x, (b, sf, alpha), n, backend=backend, bias=bias)


def _fi_w4a16(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias):
    """Route flashinfer_w4a16's plan, for callers holding FlashInfer's prepared ``(b, sf, alpha)`` of the default
    backend in the w_codes, w_scales and alpha slots.  The vLLM glue calls its own op (``dispatch/ops.py``)."""
    return run_flashinfer_w4a16(x, w_codes, w_scales, alpha, bias, w_dec_rows.shape[0], "cute-dsl")


# The streaming kernel's validating adapter (tools and tune time it) keeps its arrival counters the way the ready
# launch does (one zeroed tensor per stream, here per count and device) and takes fresh partial sums per call, so
# a timed call is the kernel alone, not a memset before it.
_STREAM_COUNTERS: dict[tuple, StreamCounters] = {}


def _stream(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias, *, ctas, **tile):
    codes, scales = _logical(w_codes, w_scales, w_dec_rows.shape[0], x.shape[1])
    tile = gluon_gemv_stream.StreamTile(**tile)
    ws = None
    if x.is_cuda and x.shape[0]:
        grid = gluon_gemv_stream.stream_grid(x.shape[0], codes.shape[0], x.shape[1], tile, ctas)
        key = (grid.counters_numel, x.device)
        if key not in _STREAM_COUNTERS:
            _STREAM_COUNTERS[key] = StreamCounters(*key)
        ws = gluon_gemv_stream.StreamWorkspace(
            torch.empty(grid.partials_numel(tile), dtype=torch.float32, device=x.device), _STREAM_COUNTERS[key].get())
    return gluon_gemv_stream.gemv_stream(x, codes, scales, w_dec_rows, bias=bias, ctas=ctas, tile=tile, workspace=ws)


LINEAR_KERNELS: dict[LinearKernel, Callable[..., torch.Tensor]] = {
    LinearKernel.W4A4_TRITON: _w4a4_triton,
    LinearKernel.W4A4_CUBLAS: _w4a4_cublas,
    LinearKernel.W4A4_B12X: _w4a4_b12x,
    LinearKernel.W4A16_GEMV: _w4a16(w4a16_gemv),
    LinearKernel.W4A16_GEMM: _w4a16(w4a16_gemm),
    LinearKernel.W4A16_DEQUANT_MM: _w4a16(w4a16_dequant_mm),
    LinearKernel.GLUON_GEMV_FMA: _gluon(gluon_gemv.FmaTile, gluon_gemv.gemv_fma),
    LinearKernel.GLUON_GEMV_MMA: _gluon(gluon_gemv.MmaTile, gluon_gemv.gemv_mma),
    LinearKernel.GLUON_GEMV_STREAM: _stream,
    LinearKernel.FI_W4A16: _fi_w4a16,
}


# ---- ready launchers: one shape, inputs already validated by the linear op ----------------------------------------
# Each builder takes (plan kwargs, Ready) and returns run(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled,
# in_enc, alpha, bias) -> out for T, N, K > 0 (the op returns the trivial cases).  What is known from the call's
# metadata is decided here once: whether the codes are a route's padded copy (then the first N rows and K columns
# are viewed per call) and whether the scales need a uint8 view.

@dataclass(frozen=True)
class Ready:
    """What a ready launcher is built for: ``x [t, k]`` of ``dtype`` on ``device``, an ``[n, k]`` weight."""

    t: int
    n: int
    k: int
    device: torch.device
    dtype: torch.dtype
    has_bias: bool
    codes_padded: bool = False
    scales_u8: bool = False  # the scales arrive as uint8 bytes (no view needed)

    def views(self):
        """``(codes, scales) -> (codes, scales as uint8)`` for the kernels, as cheap as the metadata allows."""
        n, kh = self.n, self.k // 2
        if self.codes_padded:
            if self.scales_u8:
                return lambda c, s: (c[:n, :kh], s)
            return lambda c, s: (c[:n, :kh], s.view(torch.uint8))
        if self.scales_u8:
            return lambda c, s: (c, s)
        return lambda c, s: (c, s.view(torch.uint8))


def _ready_w4a4_triton(tile, r: Ready):
    t, n, k, device, dtype = r.t, r.n, r.k, r.device, r.dtype
    quant = prepare_act_quant(t, k, device, **act_quant_config(t, k))
    gemm = prepare_w4a4_gemm(t, n, k, has_bias=r.has_bias, **tile)
    views = r.views()

    def run(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias):
        a_codes, a_scales = quant(x, in_enc)
        codes, scales = views(w_codes, w_scales)
        out = torch.empty((t, n), dtype=dtype, device=device)
        return gemm(a_codes, a_scales.view(torch.uint8), codes, scales, alpha, bias, out)

    return run


def _ready_weight_only(launch, r: Ready):
    """The ready run of a weight-only kernel: the weight's views decided once, a fresh output per call."""
    t, n, device, dtype = r.t, r.n, r.device, r.dtype
    views = r.views()

    def run(x, w_codes, w_scales, w_dec_rows, w_scales_swizzled, in_enc, alpha, bias):
        codes, scales = views(w_codes, w_scales)
        return launch(x, codes, scales, w_dec_rows, bias, torch.empty((t, n), dtype=dtype, device=device))

    return run


def _ready_w4a16(prepare):
    def build(tile, r: Ready):
        return _ready_weight_only(prepare(r.t, r.n, r.k, has_bias=r.has_bias, **tile), r)

    return build


def _ready_gluon(kind, tile_cls):
    def build(tile, r: Ready):
        return _ready_weight_only(gluon_gemv.prepare_gemv(kind, r.t, r.n, r.k, r.device, r.dtype, tile=tile_cls(**tile),
                                                          has_bias=r.has_bias), r)

    return build


def _ready_stream(tile, r: Ready):
    tile = dict(tile)
    ctas = tile.pop("ctas")
    return _ready_weight_only(gluon_gemv_stream.prepare_gemv_stream(
        r.t, r.n, r.k, r.device, r.dtype, tile=gluon_gemv_stream.StreamTile(**tile), ctas=ctas,
        has_bias=r.has_bias), r)


READY_LINEAR: dict[LinearKernel, Callable[..., Callable[..., torch.Tensor]]] = {
    LinearKernel.W4A4_TRITON: _ready_w4a4_triton,
    LinearKernel.W4A16_GEMV: _ready_w4a16(prepare_w4a16_gemv),
    LinearKernel.W4A16_GEMM: _ready_w4a16(prepare_w4a16_gemm),
    LinearKernel.W4A16_DEQUANT_MM: _ready_w4a16(prepare_w4a16_dequant_mm),
    LinearKernel.GLUON_GEMV_FMA: _ready_gluon("fma", gluon_gemv.FmaTile),
    LinearKernel.GLUON_GEMV_MMA: _ready_gluon("mma", gluon_gemv.MmaTile),
    LinearKernel.GLUON_GEMV_STREAM: _ready_stream,
}


def prepare_linear(plan, ready: Ready):
    """The ready launcher of ``plan`` for ``ready``'s shape, with the linear op's arguments; inputs must have
    passed the op's checks and ``t, n, k > 0``.  Kernels without a ready form run their validating adapter."""
    build = READY_LINEAR.get(plan.kernel)
    if build is None:
        return functools.partial(LINEAR_KERNELS[plan.kernel], **plan.kwargs)
    return build(plan.kwargs, ready)


def gemv(x, w_codes, w_scales, w_dec_rows, *, bias=None, decode: int | None = None, out=None):
    """The Gluon gemv with the kernel and tile the dispatch picks for x's GPU (T <= ``GLUON_GEMV_MAX_T``)."""
    if x.shape[0] > GLUON_GEMV_MAX_T:
        raise ValueError(f"x: T = {x.shape[0]} tokens is more than a gemv handles (<= {GLUON_GEMV_MAX_T}); "
                         "use the GEMM")
    plan = gluon_gemv_plan(capability_of(x.device), x.shape[0], w_codes.shape[0], x.shape[1])
    kernel, tile = {LinearKernel.GLUON_GEMV_FMA: (gluon_gemv.gemv_fma, gluon_gemv.FmaTile),
                    LinearKernel.GLUON_GEMV_MMA: (gluon_gemv.gemv_mma, gluon_gemv.MmaTile)}[plan.kernel]
    return kernel(x, w_codes, w_scales, w_dec_rows, tile=tile(**plan.kwargs), bias=bias, decode=decode, out=out)


# ---- MoE: (gate_up, down) per (MoeKernel, Impl) ----------------------------------------------------------------

def _decode_down(inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, workspace, *, tile, by_expert: bool,
                 expert_map=None, deterministic: bool = False, out=None):
    """The decode plan's down kernel: expert-major into ``workspace`` (``moe_decode.down_expert_workspace``), or
    token-major (no workspace; bit-identical run to run in either mode)."""
    if by_expert:
        return moe_decode.moe_decode_down_expert(inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, workspace,
                                                 tile=tile, expert_map=expert_map, deterministic=deterministic,
                                                 out=out)
    return moe_decode.moe_decode_down_token(inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, tile=tile,
                                            expert_map=expert_map, out=out)


def _prepare_decode_gate_up(plan, r, zero_numel):
    """The ready gate_up launch of the plan's tile.  Both ready launchers take ``run(x, w13_codes, w13_sf, w13_dec,
    topk_ids, emap, out, zero, w2_codes, w2_sf)``."""
    dims = (r.t, r.h, r.i, r.e, r.top_k, r.global_e, r.device)
    if not isinstance(plan.gate_up, gluon_moe_decode.MoeStreamTile):
        return moe_decode.prepare_moe_decode_gate_up(*dims, tile=plan.gate_up, activation=r.activation,
                                                     has_map=r.has_map, zero_numel=zero_numel)
    return gluon_moe_decode.prepare_moe_stream_gate_up(*dims, r.dtype, tile=plan.gate_up,
                                                       ctas=plan.gate_up.ctas(r.device), activation=r.activation,
                                                       has_map=r.has_map, zero_numel=zero_numel)


MOE_KERNELS: dict[tuple[MoeKernel, Impl], tuple[Callable, Callable]] = {
    (MoeKernel.W4A16, Impl.TRITON): (moe_w4a16.moe_w4a16_gate_up, moe_w4a16.moe_w4a16_down),
    (MoeKernel.W4A4, Impl.TRITON): (moe_w4a4.moe_w4a4_gate_up, moe_w4a4.moe_w4a4_down),
    (MoeKernel.W4A16, Impl.GLUON): (gluon_moe_w4a16.gluon_moe_w4a16_gate_up, gluon_moe_w4a16.gluon_moe_w4a16_down),
    (MoeKernel.W4A4, Impl.GLUON): (gluon_moe_w4a4.gluon_moe_w4a4_gate_up, gluon_moe_w4a4.gluon_moe_w4a4_down),
    (MoeKernel.W4A16, Impl.DECODE): (moe_decode.decode_gate_up, _decode_down),
}


@dataclass(frozen=True)
class MoeReady:
    """What a ready MoE layer launcher is built for: ``x [t, h]``, banks of ``e`` experts with intermediate
    size ``i``, ``top_k`` routes per token over ``global_e`` global experts (``has_map``: an ``expert_map``)."""

    t: int
    h: int
    i: int
    e: int
    top_k: int
    global_e: int
    device: torch.device
    dtype: torch.dtype  # x's
    has_map: bool
    activation: str
    deterministic: bool


def prepare_moe_decode(plan, r: MoeReady):
    """The decode plan's ready layer launcher for one call signature (the flow's checks and the launchers' passed
    on its first call): ``run(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights,
    topk_ids, a13_enc, a2_enc, expert_map, out) -> out`` (the arguments of ``nvfp4_moe``; the encode scales unused
    here), the same launches as the flow's decode path, checking nothing; T > 0."""
    if plan.decode_down == DecodeDown.FUSED:
        return _decode_fused(plan, r)
    by_expert = plan.decode_down == DecodeDown.EXPERT
    # The streaming Gluon down (expert-major, atomic mode only: the flow drops it in deterministic mode).
    stream = plan.stream_down is not None
    # atomic mode: the gate_up kernel zeroes the workspace
    zeroed = by_expert and (stream or not r.deterministic)
    dims = (r.t, r.h, r.i, r.e, r.top_k, r.global_e, r.device)
    if stream:
        numel = gluon_moe_decode.down_workspace_numel(r.t, r.h, plan.stream_down)
    elif by_expert:
        numel = moe_decode.down_expert_workspace_numel(r.t, r.top_k, r.h, plan.down, r.deterministic)
    else:
        numel = 0
    gate_up = _prepare_decode_gate_up(plan, r, numel if zeroed else None)
    has_map, device = r.has_map, r.device
    u8 = torch.uint8
    if by_expert:
        if stream:
            down = gluon_moe_decode.prepare_moe_stream_down(*dims, r.dtype, tile=plan.stream_down,
                                                            ctas=plan.stream_down.ctas(device), has_map=has_map)
        else:
            down = moe_decode.prepare_moe_decode_down_expert(*dims, tile=plan.down, has_map=has_map,
                                                             deterministic=r.deterministic)

        def run(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids, a13_enc,
                a2_enc, expert_map, out):
            topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
            emap = expert_map if has_map else topk_ids
            ws = torch.empty(numel, dtype=torch.float32, device=device)
            inter = gate_up(x, w13_codes, w13_scales.view(u8), w13_dec, topk_ids, emap, None, ws if zeroed else None,
                            w2_codes, w2_scales.view(u8))
            return down(inter, w2_codes, w2_scales.view(u8), w2_dec, topk_ids, emap, topk_weights, ws, out)
    else:
        down = moe_decode.prepare_moe_decode_down_token(*dims, tile=plan.down, has_map=has_map)

        def run(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids, a13_enc,
                a2_enc, expert_map, out):
            topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
            emap = expert_map if has_map else topk_ids
            inter = gate_up(x, w13_codes, w13_scales.view(u8), w13_dec, topk_ids, emap, None, None, w2_codes,
                            w2_scales.view(u8))
            return down(inter, w2_codes, w2_scales.view(u8), w2_dec, topk_ids, emap, topk_weights, out)

    return run


def _decode_fused(plan, r: MoeReady):
    """The fused decode plan's ready layer: one launch, its control block one zeroed tensor per stream (the kernel
    leaves it zero: :class:`~..kernels.launch.StreamCounters`)."""
    launch = moe_decode_fused.prepare_moe_decode_fused(
        r.t, r.h, r.i, r.e, r.top_k, r.global_e, r.device, gate_up_tile=plan.gate_up, down_tile=plan.down,
        activation=r.activation, has_map=r.has_map)
    control = StreamCounters(moe_decode_fused.control_numel(r.t, r.top_k, r.e, r.h, plan.down), r.device)
    has_map, u8 = r.has_map, torch.uint8

    def run(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids, a13_enc, a2_enc,
            expert_map, out):
        topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
        emap = expert_map if has_map else topk_ids
        return launch(x, w13_codes, w13_scales.view(u8), w13_dec, w2_codes, w2_scales.view(u8), w2_dec, topk_ids,
                      emap, topk_weights, control.get(), out)

    return run


def _w4a16_tiers(plan, r: MoeReady):
    """The W4A16 tiers' ready layer (Triton or Gluon GEMMs): align → gate_up → down (fp32 sums) → top-k sum."""
    routes = r.t * r.top_k
    block_m = plan.block_m
    nb = moe_align.max_blocks(routes, r.e, block_m)
    det = r.deterministic
    align = moe_align.prepare_moe_align(routes, r.top_k, r.e, r.global_e, block_m, r.device, has_map=r.has_map)
    if plan.impl == Impl.GLUON:
        gate_up = gluon_moe_w4a16.prepare_gluon_moe_w4a16_gate_up(r.h, r.i, nb, block_m, r.device, r.dtype,
                                                                  activation=r.activation, **plan.gate_up_kwargs())
        down = gluon_moe_w4a16.prepare_gluon_moe_w4a16_down(r.h, r.i, nb, block_m, r.device, r.dtype,
                                                            deterministic=det, **plan.down_kwargs())
    else:
        gate_up = moe_w4a16.prepare_moe_w4a16_gate_up(r.h, r.i, nb, block_m, activation=r.activation,
                                                      **plan.gate_up_kwargs())
        down = moe_w4a16.prepare_moe_w4a16_down(r.h, r.i, nb, block_m, deterministic=det, **plan.down_kwargs())
    total = moe_align.prepare_moe_sum(r.t, r.h, r.top_k if det else 1)
    acc_shape, inter_shape, device = (routes if det else r.t, r.h), (routes, r.i), r.device
    u8 = torch.uint8

    def run(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids, a13_enc, a2_enc,
            expert_map, out):
        acc = torch.zeros(acc_shape, dtype=torch.float32, device=device)
        a = align(topk_ids, expert_map)
        inter = gate_up(x, w13_codes, w13_scales.view(u8), w13_dec, a,
                        torch.empty(inter_shape, dtype=x.dtype, device=device))
        down(inter, w2_codes, w2_scales.view(u8), w2_dec, topk_weights, a, acc)
        return total(acc, out)

    return run


def _w4a4_tiers(plan, r: MoeReady):
    """The W4A4 tiers' ready layer (Triton or Gluon GEMMs): align → input quantization → gate_up (FP4
    intermediate) → down (fp32 sums) → top-k sum."""
    routes = r.t * r.top_k
    block_m = plan.block_m
    nb = moe_align.max_blocks(routes, r.e, block_m)
    det = r.deterministic
    align = moe_align.prepare_moe_align(routes, r.top_k, r.e, r.global_e, block_m, r.device, has_map=r.has_map)
    quant = prepare_act_quant(r.t, r.h, r.device, **act_quant_config(r.t, r.h))
    if plan.impl == Impl.GLUON:
        gate_up = gluon_moe_w4a4.prepare_gluon_moe_w4a4_gate_up(r.h, r.i, nb, block_m, r.device,
                                                                activation=r.activation, **plan.gate_up_kwargs())
        down = gluon_moe_w4a4.prepare_gluon_moe_w4a4_down(r.h, r.i, nb, block_m, r.device, deterministic=det,
                                                          **plan.down_kwargs())
    else:
        gate_up = moe_w4a4.prepare_moe_w4a4_gate_up(r.h, r.i, nb, block_m, r.device, activation=r.activation,
                                                    **plan.gate_up_kwargs())
        down = moe_w4a4.prepare_moe_w4a4_down(r.h, r.i, nb, block_m, deterministic=det, **plan.down_kwargs())
    total = moe_align.prepare_moe_sum(r.t, r.h, r.top_k if det else 1)
    acc_shape, device = (routes if det else r.t, r.h), r.device
    codes_shape, scales_shape = (routes, r.i // 2), (routes, r.i // 16)
    u8 = torch.uint8

    def run(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids, a13_enc, a2_enc,
            expert_map, out):
        acc = torch.zeros(acc_shape, dtype=torch.float32, device=device)
        a = align(topk_ids, expert_map)
        a13, a2 = a13_enc.reshape(1), a2_enc.reshape(1)
        a_codes, a_scales = quant(x, a13)
        i_codes, i_scales = gate_up(a_codes, a_scales.view(u8), w13_codes, w13_scales.view(u8), w13_dec, a13, a2, a,
                                    torch.empty(codes_shape, dtype=u8, device=device),
                                    torch.empty(scales_shape, dtype=u8, device=device))
        down(i_codes, i_scales, w2_codes, w2_scales.view(u8), w2_dec, a2, topk_weights, a, acc)
        return total(acc, out)

    return run


# Plans with a ready layer launcher in the MoE flow, by (kernel, impl); the others run their validating launchers.
READY_MOE: dict[tuple[MoeKernel, Impl], Callable] = {
    (MoeKernel.W4A16, Impl.DECODE): prepare_moe_decode,
    (MoeKernel.W4A16, Impl.TRITON): _w4a16_tiers,
    (MoeKernel.W4A4, Impl.TRITON): _w4a4_tiers,
    (MoeKernel.W4A16, Impl.GLUON): _w4a16_tiers,
    (MoeKernel.W4A4, Impl.GLUON): _w4a4_tiers,
}


def prepare_moe(plan, r: MoeReady):
    """The ready layer launcher of ``plan`` for one call signature (see :func:`prepare_moe_decode`), or None
    where the plan has none (:data:`READY_MOE`)."""
    build = READY_MOE.get((plan.kernel, plan.impl))
    return None if build is None else build(plan, r)
