"""W4A16 NVFP4 MoE grouped GEMMs: bf16/fp16 activations x expert weights decoded to 16 bits in registers.

Both GEMMs walk the rows laid out by :func:`.moe_align.moe_align` (one expert per ``BLOCK_M``-row block) and
read the experts' weights as vLLM loads them, untouched:

* ``_moe_w4a16_gate_up_kernel``: ``x[token] @ w13[e]^T`` for the gate rows ``n`` and the up rows ``I + n`` of
  the same output columns in one program (two accumulators), so the epilogue applies the gated activation
  ``act(gate) * up`` in fp32 and stores only the intermediate ``[R, I]`` (``x.dtype``, one row per route).
* ``_moe_w4a16_down_kernel``: ``inter[route] @ w2[e]^T``; the epilogue multiplies by the routing weight and
  adds the row into the token's fp32 output (atomics, or a per-route buffer in deterministic mode; see
  :func:`.moe_align.moe_route_store`).

Weights are decoded to ``e2m1 * e4m3`` (exact in bf16/fp16) and multiplied with fp32 accumulation; each expert's
decode global is applied once in the epilogue, as the torch reference does.

Tiles and switches (all constexpr, all chosen by ``dispatch/moe.py``):
  ``FAST_DECODE``  lop3/prmt inline-PTX e2m1 decode (GPU only) instead of the pure-``tl`` one (interpreter).
  ``USE_TMA``      packed weight tiles through a TMA tensor descriptor (sm_90+, needs K % 32 == 0 and contiguous
                   codes; the dispatch enables it for K % 256 == 0) instead of pointer loads.
  ``STREAM_W``     small batches (M <= 16 per expert): every weight byte is read once, so weight loads are marked
                   evict-first to keep L2 for the activations and the intermediate.
  ``EVEN_K``       K % BLOCK_K == 0: no K masks, so the loads stay 16-byte vectors.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp4_decode import dequant_rows_16bit
from .moe_align import MoeAlignment, moe_block_rows, moe_route_store
from .moe_common import (  # noqa: F401  (gated_activation_f32 is also this module's API)
    ALIGN_SIGNATURE,
    check_w4a16_down_inputs,
    check_w4a16_gate_up_inputs,
    gated_activation_f32,
)

MOE_W4A16_GATE_UP_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*u8", "w_desc": "*u8", "w_sf_ptr": "*u8", "w_dec_ptr": "*fp32", "out_ptr": "*bf16",
    **ALIGN_SIGNATURE,
    "R": "i32", "I": "i32", "K": "i32", "top_k": "i32", "max_blocks": "i32",
    "stride_xm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_wse": "i32", "stride_wsn": "i32",
    "stride_om": "i32",
    "ACTIVATION": "constexpr", "USE_TMA": "constexpr", "FAST_DECODE": "constexpr", "STREAM_W": "constexpr",
    "EVEN_K": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
    "GROUP_M": "constexpr",
}
MOE_W4A16_DOWN_SIGNATURE = {
    "a_ptr": "*bf16", "w_ptr": "*u8", "w_desc": "*u8", "w_sf_ptr": "*u8", "w_dec_ptr": "*fp32", "topk_w_ptr": "*fp32",
    "out_ptr": "*fp32", **ALIGN_SIGNATURE,
    "R": "i32", "N": "i32", "K": "i32", "top_k": "i32", "max_blocks": "i32",
    "stride_am": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_wse": "i32", "stride_wsn": "i32",
    "stride_om": "i32",
    "DETERMINISTIC": "constexpr", "USE_TMA": "constexpr", "FAST_DECODE": "constexpr", "STREAM_W": "constexpr",
    "EVEN_K": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
    "GROUP_M": "constexpr",
}
# What the JIT marks divisible by 16 on real checkpoint shapes (H, I multiples of 256; R and top_k are not).
_DIV_INTS = ["I", "N", "K", "stride_xm", "stride_am", "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_om"]
MOE_W4A16_GATE_UP_DIVISIBLE = [k for k, v in MOE_W4A16_GATE_UP_SIGNATURE.items() if v.startswith("*")] + [
    k for k in _DIV_INTS if k in MOE_W4A16_GATE_UP_SIGNATURE]
MOE_W4A16_DOWN_DIVISIBLE = [k for k, v in MOE_W4A16_DOWN_SIGNATURE.items() if v.startswith("*")] + [
    k for k in _DIV_INTS if k in MOE_W4A16_DOWN_SIGNATURE]


def tma_signature(signature: dict, block_n: int, block_k: int) -> dict:
    """The signature with ``w_desc`` the TMA descriptor the launcher passes when ``USE_TMA``."""
    return signature | {"w_desc": f"tensordesc<u8[{block_n},{block_k // 2}]>"}


@triton.jit
def _load_weight_tile(w_desc, w_ptrs, row0, k0, n_ok, kb_ok,
                      USE_TMA: tl.constexpr, STREAM_W: tl.constexpr, EVEN_K: tl.constexpr):
    """Packed codes ``[BLOCK_N, BLOCK_K/2]``: a TMA box at (row0, k0/2), or masked pointer loads."""
    if USE_TMA:
        # Rows past the expert belong to the next part/expert (or are zero-filled past the tensor): their
        # output columns are masked at the store, so they are harmless.
        w = w_desc.load([row0, k0 // 2])
    else:
        mask = n_ok[:, None] if EVEN_K else n_ok[:, None] & kb_ok[None, :]
        if STREAM_W:
            w = tl.load(w_ptrs, mask=mask, other=0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=mask, other=0)
    return w


@triton.jit
def _load_scale_tile(sf_ptrs, n_ok, ks_ok, EVEN_K: tl.constexpr):
    mask = n_ok[:, None] if EVEN_K else n_ok[:, None] & ks_ok[None, :]
    return tl.load(sf_ptrs, mask=mask, other=0)


@triton.jit(do_not_specialize=["R", "max_blocks"])  # token counts vary per call
def _moe_w4a16_gate_up_kernel(
    x_ptr, w_ptr, w_desc, w_sf_ptr, w_dec_ptr, out_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    R, I, K, top_k, max_blocks,
    stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    ACTIVATION: tl.constexpr, USE_TMA: tl.constexpr, FAST_DECODE: tl.constexpr, STREAM_W: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_n = tl.cdiv(I, BLOCK_N)
    live, pid_n, e, route, row_ok = moe_block_rows(
        tl.program_id(0), sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, R, max_blocks, num_n, BLOCK_M, GROUP_M)
    if live:
        dtype = x_ptr.dtype.element_ty
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_kb = tl.arange(0, BLOCK_K // 2)
        offs_ks = tl.arange(0, BLOCK_K // 16)
        n_ok = offs_n < I
        token = route // top_k

        x_ptrs = x_ptr + token[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        # Gate rows n and up rows I + n of expert e: the two halves of one output column live in this program.
        wg_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_kb[None, :]
        wu_ptrs = wg_ptrs + I * stride_wn
        sg_ptrs = w_sf_ptr + e * stride_wse + offs_n[:, None].to(tl.int64) * stride_wsn + offs_ks[None, :]
        su_ptrs = sg_ptrs + I * stride_wsn
        row_g = (e * 2 * I + pid_n * BLOCK_N).to(tl.int32)  # TMA row of the gate tile in the [E*2I, K/2] view

        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            kb_ok = (k0 // 2 + offs_kb) < K // 2
            ks_ok = (k0 // 16 + offs_ks) < K // 16
            # Zero activations, codes and scales past K contribute exactly 0: a K tail needs no special case.
            if EVEN_K:
                a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wg = _load_weight_tile(w_desc, wg_ptrs, row_g, k0, n_ok, kb_ok, USE_TMA, STREAM_W, EVEN_K)
            wu = _load_weight_tile(w_desc, wu_ptrs, row_g + I, k0, n_ok, kb_ok, USE_TMA, STREAM_W, EVEN_K)
            sg = _load_scale_tile(sg_ptrs, n_ok, ks_ok, EVEN_K)
            su = _load_scale_tile(su_ptrs, n_ok, ks_ok, EVEN_K)
            acc_g = tl.dot(a, tl.trans(dequant_rows_16bit(wg, sg, BLOCK_N, BLOCK_K, dtype, FAST_DECODE)), acc_g)
            acc_u = tl.dot(a, tl.trans(dequant_rows_16bit(wu, su, BLOCK_N, BLOCK_K, dtype, FAST_DECODE)), acc_u)
            x_ptrs += BLOCK_K
            wg_ptrs += BLOCK_K // 2
            wu_ptrs += BLOCK_K // 2
            sg_ptrs += BLOCK_K // 16
            su_ptrs += BLOCK_K // 16

        dec = tl.load(w_dec_ptr + e)
        inter = gated_activation_f32(acc_g * dec, acc_u * dec, ACTIVATION)
        out_ptrs = out_ptr + route[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        tl.store(out_ptrs, inter.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["R", "max_blocks"])  # token counts vary per call
def _moe_w4a16_down_kernel(
    a_ptr, w_ptr, w_desc, w_sf_ptr, w_dec_ptr, topk_w_ptr, out_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    R, N, K, top_k, max_blocks,
    stride_am, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    DETERMINISTIC: tl.constexpr, USE_TMA: tl.constexpr, FAST_DECODE: tl.constexpr, STREAM_W: tl.constexpr,
    EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    num_n = tl.cdiv(N, BLOCK_N)
    live, pid_n, e, route, row_ok = moe_block_rows(
        tl.program_id(0), sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, R, max_blocks, num_n, BLOCK_M, GROUP_M)
    if live:
        dtype = a_ptr.dtype.element_ty
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        offs_kb = tl.arange(0, BLOCK_K // 2)
        offs_ks = tl.arange(0, BLOCK_K // 16)
        n_ok = offs_n < N

        a_ptrs = a_ptr + route[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        w_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_kb[None, :]
        s_ptrs = w_sf_ptr + e * stride_wse + offs_n[:, None].to(tl.int64) * stride_wsn + offs_ks[None, :]
        row0 = (e * N + pid_n * BLOCK_N).to(tl.int32)  # TMA row in the [E*H, I/2] view

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            kb_ok = (k0 // 2 + offs_kb) < K // 2
            ks_ok = (k0 // 16 + offs_ks) < K // 16
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = _load_weight_tile(w_desc, w_ptrs, row0, k0, n_ok, kb_ok, USE_TMA, STREAM_W, EVEN_K)
            s = _load_scale_tile(s_ptrs, n_ok, ks_ok, EVEN_K)
            acc = tl.dot(a, tl.trans(dequant_rows_16bit(w, s, BLOCK_N, BLOCK_K, dtype, FAST_DECODE)), acc)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 16

        weight = tl.load(topk_w_ptr + route, mask=row_ok, other=0.0)
        y = (acc * tl.load(w_dec_ptr + e)) * weight[:, None]
        moe_route_store(out_ptr, y, route, row_ok, offs_n, n_ok, top_k, stride_om, DETERMINISTIC)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------


def _weight_arg(codes, use_tma: bool, block_n: int, block_k: int):
    """``w_desc``: a TMA descriptor over the codes' [E * rows, K/2] view, or the codes again (unused)."""
    if not use_tma:
        return codes
    from triton.tools.tensor_descriptor import TensorDescriptor

    e, n, kh = codes.shape
    if not codes.is_contiguous() or kh % 16 or codes.data_ptr() % 16:
        raise ValueError(f"use_tma: the weight codes must be contiguous with K/2 % 16 == 0 and 16-byte aligned, "
                         f"got shape {list(codes.shape)} strides {codes.stride()}")
    return TensorDescriptor.from_tensor(codes.view(e * n, kh), [block_n, block_k // 2])


def moe_w4a16_gate_up(
    x, w13_codes, w13_scales, w13_dec, align: MoeAlignment, *,
    block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int, activation: str = "silu",
    use_tma: bool = False, fast_decode: bool = False, stream_weights: bool = False, out=None,
):
    """``act(x[token] @ w13[e, :I]^T) * (x[token] @ w13[e, I:]^T)`` per route → intermediate ``[R, I]`` x.dtype.

    Rows of routes that no local expert takes are left unwritten (the down GEMM never reads them).
    """
    w_sf, h, i, r, out = check_w4a16_gate_up_inputs(x, w13_codes, w13_scales, w13_dec, align, activation, out)
    if r == 0:
        return out
    run = prepare_moe_w4a16_gate_up(h, i, align.max_blocks, align.block_m, block_n=block_n, block_k=block_k,
                                    group_m=group_m, num_warps=num_warps, num_stages=num_stages,
                                    activation=activation, use_tma=use_tma, fast_decode=fast_decode,
                                    stream_weights=stream_weights)
    return run(x, w13_codes, w_sf, w13_dec, align, out)


def moe_w4a16_down(
    inter, w2_codes, w2_scales, w2_dec, topk_weights, align: MoeAlignment, out, *,
    block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int, deterministic: bool = False,
    use_tma: bool = False, fast_decode: bool = False, stream_weights: bool = False,
):
    """``topk_weight * (inter[route] @ w2[e]^T)`` summed into ``out``.

    ``out`` is fp32 and zeroed by the caller: ``[T, H]`` (atomic adds) or, with ``deterministic``, the per-route
    buffer ``[R, H]`` that :func:`.moe_align.moe_sum` reduces in slot order.
    """
    w_sf, h, i, r = check_w4a16_down_inputs(inter, w2_codes, w2_scales, w2_dec, topk_weights, align, out,
                                            deterministic)
    if r == 0:
        return out
    run = prepare_moe_w4a16_down(h, i, align.max_blocks, align.block_m, block_n=block_n, block_k=block_k,
                                 group_m=group_m, num_warps=num_warps, num_stages=num_stages,
                                 deterministic=deterministic, use_tma=use_tma, fast_decode=fast_decode,
                                 stream_weights=stream_weights)
    return run(inter, w2_codes, w_sf, w2_dec, topk_weights, align, out)


# Ready launches: grid and compile-time arguments fixed once for an alignment's ``max_blocks`` and ``block_m``;
# the returned runs check nothing (their inputs are what the launchers above pass: scales as uint8 bytes, R > 0).

def prepare_moe_w4a16_gate_up(h: int, i: int, max_blocks: int, block_m: int, *, block_n: int, block_k: int,
                              group_m: int, num_warps: int, num_stages: int, activation: str, use_tma: bool,
                              fast_decode: bool, stream_weights: bool):
    """``run(x, w13_codes, w13_scales_u8, w13_dec, align, out) -> out`` (the intermediate ``[R, I]``)."""
    from .launch import ReadyKernel

    launch = ReadyKernel(
        _moe_w4a16_gate_up_kernel, (max_blocks * triton.cdiv(i, block_n),), ACTIVATION=activation, USE_TMA=use_tma,
        FAST_DECODE=fast_decode, STREAM_W=stream_weights, EVEN_K=h % block_k == 0, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=num_warps, num_stages=num_stages,
    )

    def run(x, w13_codes, w_sf, w13_dec, align, out):
        launch(x, w13_codes, _weight_arg(w13_codes, use_tma, block_n, block_k), w_sf, w13_dec, out,
               align.sorted_ids, align.expert_ids, align.num_padded,
               align.num_routes, i, h, align.top_k, max_blocks,
               x.stride(0), w13_codes.stride(0), w13_codes.stride(1), w_sf.stride(0), w_sf.stride(1), out.stride(0))
        return out

    return run


def prepare_moe_w4a16_down(h: int, i: int, max_blocks: int, block_m: int, *, block_n: int, block_k: int,
                           group_m: int, num_warps: int, num_stages: int, deterministic: bool, use_tma: bool,
                           fast_decode: bool, stream_weights: bool):
    """``run(inter, w2_codes, w2_scales_u8, w2_dec, topk_weights, align, out) -> out`` (the fp32 sums)."""
    from .launch import ReadyKernel

    launch = ReadyKernel(
        _moe_w4a16_down_kernel, (max_blocks * triton.cdiv(h, block_n),), DETERMINISTIC=deterministic,
        USE_TMA=use_tma, FAST_DECODE=fast_decode, STREAM_W=stream_weights, EVEN_K=i % block_k == 0,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=num_warps,
        num_stages=num_stages,
    )

    def run(inter, w2_codes, w_sf, w2_dec, topk_weights, align, out):
        launch(inter, w2_codes, _weight_arg(w2_codes, use_tma, block_n, block_k), w_sf, w2_dec,
               topk_weights.contiguous(), out, align.sorted_ids, align.expert_ids, align.num_padded,
               align.num_routes, h, i, align.top_k, max_blocks,
               inter.stride(0), w2_codes.stride(0), w2_codes.stride(1), w_sf.stride(0), w_sf.stride(1), out.stride(0))
        return out

    return run
