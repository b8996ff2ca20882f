"""W4A4 NVFP4 MoE: FP4 x FP4 grouped GEMMs on ``tl.dot_scaled``, intermediate quantized in the epilogue.

Flow (rows laid out by :func:`.moe_align.moe_align`):

* :func:`.act_quant.quantize_act_nvfp4`: the layer input ``x [T, H]`` → NVFP4 codes ``[T, H/2]`` + e4m3 scales
  ``[T, H/16]`` with the gate_up input's static encode scale ``a13_enc`` (once per token, not per route).
* ``_moe_w4a4_gate_up_kernel``: gate rows ``n`` and up rows ``I + n`` of expert e in one program (two
  accumulators); the epilogue applies ``alpha = w13_dec[e] * (1 / a13_enc)``, the gated activation in fp32, and
  quantizes the result straight to NVFP4 with the down input's static encode scale ``a2_enc``: codes
  ``[R, I/2]`` + scales ``[R, I/16]``.  No bf16 intermediate in memory, no separate activation or quant kernel.
* ``_moe_w4a4_down_kernel``: ``alpha = w2_dec[e] * (1 / a2_enc)``, times the routing weight, summed over the top-k
  routes into the fp32 output (atomics, or the deterministic per-route buffer; :func:`.moe_align.moe_route_store`).

Both quantizations are :func:`.act_quant.quantize_blocks_nvfp4`, bit-exact with ``format.quantize_nvfp4`` given
the same fp32 values (IEEE divisions via ``tl.div_rn``: a plain ``/`` is approximate on the GPU).  The
intermediate's fp32 values themselves differ from the torch reference in the last ulps (summation order,
``exp``), so a code can still round the other way where a value sits on a rounding midpoint.

``DECODE=False``: native NVFP4 MMA (``OMMA...E2M1.E2M1.UE4M3.4X`` on sm_120; Triton >= 3.8 emulates it exactly
on sm_90).  ``DECODE=True``: exact pure-``tl`` decode + fp16 ``tl.dot`` (the interpreter's path).  Weights are
read as ``[BLOCK_K/2, BLOCK_N]`` (K-packed), as ``kernels/w4a4_gemm.py`` explains.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .act_quant import has_native_e2m1, quantize_act_nvfp4, quantize_blocks_nvfp4
from .fp4_decode import expand_scales_f32, unpack_rows_f32
from .moe_align import MoeAlignment, moe_block_rows, moe_route_store
from .moe_common import (
    ALIGN_SIGNATURE,
    check_enc,
    check_w4a4_down_inputs,
    check_w4a4_gate_up_inputs,
    gated_activation_f32,
)

# ---------------------------------------------------------------------------------------------------------------
# Grouped FP4 x FP4 GEMMs
# ---------------------------------------------------------------------------------------------------------------

MOE_W4A4_GATE_UP_SIGNATURE = {
    "a_ptr": "*u8", "a_sf_ptr": "*u8", "w_ptr": "*u8", "w_sf_ptr": "*u8", "w_dec_ptr": "*fp32",
    "a13_enc_ptr": "*fp32", "a2_enc_ptr": "*fp32", "out_ptr": "*u8", "out_sf_ptr": "*u8", **ALIGN_SIGNATURE,
    "R": "i32", "I": "i32", "K": "i32", "top_k": "i32", "max_blocks": "i32",
    "stride_am": "i32", "stride_asm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_wse": "i32",
    "stride_wsn": "i32", "stride_om": "i32", "stride_osm": "i32",
    "ACTIVATION": "constexpr", "DECODE": "constexpr", "NATIVE_E4M3": "constexpr", "NATIVE_E2M1": "constexpr",
    "BLOCK_M": "constexpr",
    "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr",
}
MOE_W4A4_DOWN_SIGNATURE = {
    "a_ptr": "*u8", "a_sf_ptr": "*u8", "w_ptr": "*u8", "w_sf_ptr": "*u8", "w_dec_ptr": "*fp32",
    "a2_enc_ptr": "*fp32", "topk_w_ptr": "*fp32", "out_ptr": "*fp32", **ALIGN_SIGNATURE,
    "R": "i32", "N": "i32", "K": "i32", "top_k": "i32", "max_blocks": "i32",
    "stride_am": "i32", "stride_asm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_wse": "i32",
    "stride_wsn": "i32", "stride_om": "i32",
    "DETERMINISTIC": "constexpr", "DECODE": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
    "BLOCK_K": "constexpr", "GROUP_M": "constexpr",
}
_DIV_INTS = ["I", "N", "K", "stride_am", "stride_asm", "stride_we", "stride_wn", "stride_wse", "stride_wsn",
             "stride_om", "stride_osm"]
MOE_W4A4_GATE_UP_DIVISIBLE = [k for k, v in MOE_W4A4_GATE_UP_SIGNATURE.items() if v.startswith("*")] + [
    k for k in _DIV_INTS if k in MOE_W4A4_GATE_UP_SIGNATURE]
MOE_W4A4_DOWN_DIVISIBLE = [k for k, v in MOE_W4A4_DOWN_SIGNATURE.items() if v.startswith("*")] + [
    k for k in _DIV_INTS if k in MOE_W4A4_DOWN_SIGNATURE]


@triton.jit
def _fp4_dot(a, a_sf, w, w_sf, acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             DECODE: tl.constexpr):
    """``acc += A @ W^T`` for A codes ``[BM, BK/2]`` and K-packed W codes ``[BK/2, BN]`` with e4m3 scale bytes."""
    if DECODE:
        av = unpack_rows_f32(a, BLOCK_M, BLOCK_K) * expand_scales_f32(a_sf, BLOCK_M, BLOCK_K)
        wv = unpack_rows_f32(tl.trans(w), BLOCK_N, BLOCK_K) * expand_scales_f32(w_sf, BLOCK_N, BLOCK_K)
        acc = tl.dot(av.to(tl.float16), tl.trans(wv.to(tl.float16)), acc)
    else:
        acc = tl.dot_scaled(
            a, a_sf.to(tl.float8e4nv, bitcast=True), "e2m1",
            w, w_sf.to(tl.float8e4nv, bitcast=True), "e2m1", acc,
        )
    return acc


@triton.jit(do_not_specialize=["R", "max_blocks"])  # token counts vary per call
def _moe_w4a4_gate_up_kernel(
    a_ptr, a_sf_ptr, w_ptr, w_sf_ptr, w_dec_ptr, a13_enc_ptr, a2_enc_ptr, out_ptr, out_sf_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    R, I, K, top_k, max_blocks,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_osm,
    ACTIVATION: tl.constexpr, DECODE: tl.constexpr, NATIVE_E4M3: tl.constexpr, NATIVE_E2M1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    num_n = tl.cdiv(I, BLOCK_N)
    live, pid_n, e, route, row_ok = moe_block_rows(
        tl.program_id(0), sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, R, max_blocks, num_n, BLOCK_M, GROUP_M)
    if live:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_kb = tl.arange(0, BLOCK_K // 2)
        offs_ks = tl.arange(0, BLOCK_K // 16)
        n_ok = offs_n < I
        token = (route // top_k)[:, None].to(tl.int64)

        a_ptrs = a_ptr + token * stride_am + offs_kb[None, :]
        a_sf_ptrs = a_sf_ptr + token * stride_asm + offs_ks[None, :]
        # Gate rows n and up rows I + n: both halves of an output column in this program, for the epilogue.
        wg_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_kb[:, None]
        wu_ptrs = wg_ptrs + I * stride_wn
        sg_ptrs = w_sf_ptr + e * stride_wse + offs_n[:, None].to(tl.int64) * stride_wsn + offs_ks[None, :]
        su_ptrs = sg_ptrs + I * stride_wsn

        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            # Zero codes and zero scales past K contribute exactly 0, so a K tail needs no special case.
            kb_ok = (k0 // 2 + offs_kb) < K // 2
            ks_ok = (k0 // 16 + offs_ks) < K // 16
            a = tl.load(a_ptrs, mask=row_ok[:, None] & kb_ok[None, :], other=0)
            a_sf = tl.load(a_sf_ptrs, mask=row_ok[:, None] & ks_ok[None, :], other=0)
            wg = tl.load(wg_ptrs, mask=kb_ok[:, None] & n_ok[None, :], other=0)
            wu = tl.load(wu_ptrs, mask=kb_ok[:, None] & n_ok[None, :], other=0)
            sg = tl.load(sg_ptrs, mask=n_ok[:, None] & ks_ok[None, :], other=0)
            su = tl.load(su_ptrs, mask=n_ok[:, None] & ks_ok[None, :], other=0)
            acc_g = _fp4_dot(a, a_sf, wg, sg, acc_g, BLOCK_M, BLOCK_N, BLOCK_K, DECODE)
            acc_u = _fp4_dot(a, a_sf, wu, su, acc_u, BLOCK_M, BLOCK_N, BLOCK_K, DECODE)
            a_ptrs += BLOCK_K // 2
            a_sf_ptrs += BLOCK_K // 16
            wg_ptrs += BLOCK_K // 2
            wu_ptrs += BLOCK_K // 2
            sg_ptrs += BLOCK_K // 16
            su_ptrs += BLOCK_K // 16

        # alpha as the reference forms it: weight decode x input decode (1 / enc, IEEE division).
        alpha = tl.load(w_dec_ptr + e) * tl.div_rn(1.0, tl.load(a13_enc_ptr))
        inter = gated_activation_f32(acc_g * alpha, acc_u * alpha, ACTIVATION)
        # BLOCK_N and I are multiples of 16, so every NVFP4 block of the intermediate lies in one tile.
        codes, sf = quantize_blocks_nvfp4(tl.reshape(inter, (BLOCK_M, BLOCK_N // 16, 16)), tl.load(a2_enc_ptr),
                                          NATIVE_E4M3, NATIVE_E2M1)
        codes = tl.reshape(codes, (BLOCK_M, BLOCK_N // 2))
        offs_c = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        offs_s = pid_n * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16)
        rows = route[:, None].to(tl.int64)
        tl.store(out_ptr + rows * stride_om + offs_c[None, :], codes,
                 mask=row_ok[:, None] & (offs_c < I // 2)[None, :])
        tl.store(out_sf_ptr + rows * stride_osm + offs_s[None, :], sf,
                 mask=row_ok[:, None] & (offs_s < I // 16)[None, :])


@triton.jit(do_not_specialize=["R", "max_blocks"])  # token counts vary per call
def _moe_w4a4_down_kernel(
    a_ptr, a_sf_ptr, w_ptr, w_sf_ptr, w_dec_ptr, a2_enc_ptr, topk_w_ptr, out_ptr,
    sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
    R, N, K, top_k, max_blocks,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    DETERMINISTIC: tl.constexpr, DECODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    num_n = tl.cdiv(N, BLOCK_N)
    live, pid_n, e, route, row_ok = moe_block_rows(
        tl.program_id(0), sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, R, max_blocks, num_n, BLOCK_M, GROUP_M)
    if live:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_kb = tl.arange(0, BLOCK_K // 2)
        offs_ks = tl.arange(0, BLOCK_K // 16)
        n_ok = offs_n < N
        rows = route[:, None].to(tl.int64)

        a_ptrs = a_ptr + rows * stride_am + offs_kb[None, :]
        a_sf_ptrs = a_sf_ptr + rows * stride_asm + offs_ks[None, :]
        w_ptrs = w_ptr + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_kb[:, None]
        s_ptrs = w_sf_ptr + e * stride_wse + offs_n[:, None].to(tl.int64) * stride_wsn + offs_ks[None, :]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kb_ok = (k0 // 2 + offs_kb) < K // 2
            ks_ok = (k0 // 16 + offs_ks) < K // 16
            a = tl.load(a_ptrs, mask=row_ok[:, None] & kb_ok[None, :], other=0)
            a_sf = tl.load(a_sf_ptrs, mask=row_ok[:, None] & ks_ok[None, :], other=0)
            w = tl.load(w_ptrs, mask=kb_ok[:, None] & n_ok[None, :], other=0)
            s = tl.load(s_ptrs, mask=n_ok[:, None] & ks_ok[None, :], other=0)
            acc = _fp4_dot(a, a_sf, w, s, acc, BLOCK_M, BLOCK_N, BLOCK_K, DECODE)
            a_ptrs += BLOCK_K // 2
            a_sf_ptrs += BLOCK_K // 16
            w_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 16

        alpha = tl.load(w_dec_ptr + e) * tl.div_rn(1.0, tl.load(a2_enc_ptr))
        weight = tl.load(topk_w_ptr + route, mask=row_ok, other=0.0)
        moe_route_store(out_ptr, (acc * alpha) * weight[:, None], route, row_ok, offs_n, n_ok, top_k, stride_om,
                        DETERMINISTIC)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------


def moe_quant_input(x, a13_enc, *, block_t: int, block_k: int, num_warps: int):
    """The gate_up input: ``x [T, H]`` → ``(codes [T, H/2] u8, scales [T, H/16] e4m3)``, one row per token.

    Just :func:`.act_quant.quantize_act_nvfp4` with linear scales (the name the MoE flow calls), on its tile.
    """
    return quantize_act_nvfp4(x, check_enc("a13_enc", a13_enc), block_t=block_t, block_k=block_k,
                              num_warps=num_warps)


def moe_w4a4_gate_up(
    a_codes, a_scales, w13_codes, w13_scales, w13_dec, a13_enc, a2_enc, align: MoeAlignment, *,
    block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int, activation: str = "silu",
    decode: bool = False, out_codes=None, out_scales=None, native_e4m3: bool | None = None,
    native_e2m1: bool | None = None,
):
    """NVFP4 intermediate per route: ``quant_a2(act(gate) * up)`` → ``(codes [R, I/2] u8, scales [R, I/16] u8)``.

    ``a_codes``/``a_scales``: the layer input quantized with ``a13_enc`` (:func:`moe_quant_input`), one row per
    token.  Rows of routes that no local expert takes are left unwritten.  ``native_e4m3``: round the block
    scales with the fp32 → e4m3 convert (sm_89+; default on CUDA) instead of integer arithmetic (the
    interpreter's cast is not round-to-nearest-even); both are exact.  ``native_e2m1``: the codes by the
    hardware fp32 → e2m1 convert (default on sm_120, the only target it is compile-checked for).
    """
    import torch

    if block_k < 64 or block_k % 64 or block_n % 16:
        raise ValueError(f"moe_w4a4_gate_up: block_k ({block_k}) must be a multiple of 64 (dot_scaled K >= 64) "
                         f"and block_n ({block_n}) a multiple of 16")
    w_sf, h, i, r, out_codes, out_scales = check_w4a4_gate_up_inputs(
        a_codes, a_scales, w13_codes, w13_scales, w13_dec, align, activation, out_codes, out_scales)
    if r == 0:
        return out_codes, out_scales
    run = prepare_moe_w4a4_gate_up(h, i, align.max_blocks, align.block_m, a_codes.device, block_n=block_n,
                                   block_k=block_k, group_m=group_m, num_warps=num_warps, num_stages=num_stages,
                                   activation=activation, decode=decode, native_e4m3=native_e4m3,
                                   native_e2m1=native_e2m1)
    return run(a_codes, a_scales.view(torch.uint8), w13_codes, w_sf, w13_dec, check_enc("a13_enc", a13_enc),
               check_enc("a2_enc", a2_enc), align, out_codes, out_scales)


def moe_w4a4_down(
    a_codes, a_scales, w2_codes, w2_scales, w2_dec, a2_enc, topk_weights, align: MoeAlignment, out, *,
    block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int, deterministic: bool = False,
    decode: bool = False,
):
    """``topk_weight * (w2_dec[e] / a2_enc) * (inter_fp4[route] @ w2_fp4[e]^T)`` summed into fp32 ``out``.

    ``out``: zeroed by the caller, ``[T, H]`` (atomic adds) or with ``deterministic`` the per-route ``[R, H]``.
    """
    import torch

    if block_k < 64 or block_k % 64:
        raise ValueError(f"moe_w4a4_down: block_k ({block_k}) must be a multiple of 64 (dot_scaled K >= 64)")
    w_sf, h, i, r = check_w4a4_down_inputs(a_codes, a_scales, w2_codes, w2_scales, w2_dec, topk_weights, align,
                                           out, deterministic)
    if r == 0:
        return out
    run = prepare_moe_w4a4_down(h, i, align.max_blocks, align.block_m, block_n=block_n, block_k=block_k,
                                group_m=group_m, num_warps=num_warps, num_stages=num_stages,
                                deterministic=deterministic, decode=decode)
    return run(a_codes, a_scales.view(torch.uint8), w2_codes, w_sf, w2_dec, check_enc("a2_enc", a2_enc),
               topk_weights, align, out)


# Ready launches: grid and compile-time arguments fixed once for an alignment's ``max_blocks`` and ``block_m``;
# the returned runs check nothing (their inputs are what the launchers above pass: scales as uint8 bytes, the
# encode scales as ``[1]``, R > 0).

def prepare_moe_w4a4_gate_up(h: int, i: int, max_blocks: int, block_m: int, device, *, block_n: int, block_k: int,
                             group_m: int, num_warps: int, num_stages: int, activation: str, decode: bool,
                             native_e4m3: bool | None = None, native_e2m1: bool | None = None):
    """``run(a_codes, a_scales_u8, w13_codes, w13_scales_u8, w13_dec, a13_enc, a2_enc, align, out_codes,
    out_scales) -> (out_codes, out_scales)`` (the FP4 intermediate); ``native_*`` as :func:`moe_w4a4_gate_up`
    resolves them for ``device``."""
    import torch

    from .launch import ReadyKernel

    if native_e4m3 is None:
        native_e4m3 = device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)
    if native_e2m1 is None:
        native_e2m1 = has_native_e2m1(device)

    launch = ReadyKernel(
        _moe_w4a4_gate_up_kernel, (max_blocks * triton.cdiv(i, block_n),), ACTIVATION=activation, DECODE=decode,
        NATIVE_E4M3=native_e4m3, NATIVE_E2M1=native_e2m1, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=group_m, num_warps=num_warps, num_stages=num_stages,
    )

    def run(a_codes, a_sf, w13_codes, w_sf, w13_dec, a13_enc, a2_enc, align, out_codes, out_scales):
        launch(a_codes, a_sf, w13_codes, w_sf, w13_dec, a13_enc, a2_enc, out_codes, out_scales,
               align.sorted_ids, align.expert_ids, align.num_padded,
               align.num_routes, i, h, align.top_k, max_blocks,
               a_codes.stride(0), a_sf.stride(0), w13_codes.stride(0), w13_codes.stride(1), w_sf.stride(0),
               w_sf.stride(1), out_codes.stride(0), out_scales.stride(0))
        return out_codes, out_scales

    return run


def prepare_moe_w4a4_down(h: int, i: int, max_blocks: int, block_m: int, *, block_n: int, block_k: int,
                          group_m: int, num_warps: int, num_stages: int, deterministic: bool, decode: bool):
    """``run(a_codes, a_scales_u8, w2_codes, w2_scales_u8, w2_dec, a2_enc, topk_weights, align, out) -> out``
    (the fp32 sums)."""
    from .launch import ReadyKernel

    launch = ReadyKernel(
        _moe_w4a4_down_kernel, (max_blocks * triton.cdiv(h, block_n),), DETERMINISTIC=deterministic,
        DECODE=decode, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, num_warps=num_warps,
        num_stages=num_stages,
    )

    def run(a_codes, a_sf, w2_codes, w_sf, w2_dec, a2_enc, topk_weights, align, out):
        launch(a_codes, a_sf, w2_codes, w_sf, w2_dec, a2_enc, topk_weights.contiguous(), out,
               align.sorted_ids, align.expert_ids, align.num_padded,
               align.num_routes, h, i, align.top_k, max_blocks,
               a_codes.stride(0), a_sf.stride(0), w2_codes.stride(0), w2_codes.stride(1), w_sf.stride(0),
               w_sf.stride(1), out.stride(0))
        return out

    return run
