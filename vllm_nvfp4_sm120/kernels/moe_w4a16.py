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

Switches (all constexpr, all chosen by ``dispatch/moe.py``):
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

from ..format.reference import ACTIVATIONS
from .fp4_decode import dequant_rows_16bit
from .moe_align import MoeAlignment, moe_block_rows, moe_route_store


_COMMON = {
    "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "num_padded_ptr": "*i32",
}
MOE_W4A16_GATE_UP_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*u8", "w_desc": "*u8", "w_sf_ptr": "*u8", "w_dec_ptr": "*fp32", "out_ptr": "*bf16", **_COMMON,
    "R": "i32", "I": "i32", "K": "i32", "top_k": "i32", "max_blocks": "i32",
    "stride_xm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_wse": "i32", "stride_wsn": "i32",
    "stride_om": "i32",
    "ACTIVATION": "constexpr", "USE_TMA": "constexpr", "FAST_DECODE": "constexpr", "STREAM_W": "constexpr",
    "EVEN_K": "constexpr", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr",
    "GROUP_M": "constexpr",
}
MOE_W4A16_DOWN_SIGNATURE = {
    "a_ptr": "*bf16", "w_ptr": "*u8", "w_desc": "*u8", "w_sf_ptr": "*u8", "w_dec_ptr": "*fp32", "topk_w_ptr": "*fp32",
    "out_ptr": "*fp32", **_COMMON,
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
def gated_activation_f32(gate, up, ACTIVATION: tl.constexpr):
    """``act(gate) * up`` in fp32: SiLU, or GELU with the tanh approximation (tanh(y) = 1 - 2 / (e^2y + 1))."""
    if ACTIVATION == "silu":
        g = gate / (1.0 + tl.exp(-gate))
    else:
        tl.static_assert(ACTIVATION == "gelu_tanh", "ACTIVATION must be 'silu' or 'gelu_tanh'")
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        g = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    return g * up


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


@triton.jit
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


@triton.jit
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


def _check_bank(name: str, codes, scales, dec, rows: int | None, k: int | None):
    """An expert bank: codes [E, rows, K/2] u8, scales [E, rows, K/16] e4m3, dec [E] fp32; returns (E, rows, K)."""
    import torch

    from ..format.checks import as_e4m3, check_tensor

    check_tensor(f"{name}_codes", codes, dtype=torch.uint8, ndim=3, last_dim_contiguous=True)
    e, n, kh = codes.shape
    if (rows is not None and n != rows) or (k is not None and 2 * kh != k):
        raise ValueError(f"{name}_codes: expected shape [E, {rows if rows is not None else '*'}, "
                         f"{k // 2 if k is not None else '*'}], got {list(codes.shape)}")
    kk = 2 * kh
    if kk % 16:
        raise ValueError(f"{name}_codes: K = {kk} must be a multiple of 16 (one e4m3 scale per 16 weights)")
    scales = as_e4m3(f"{name}_scales", scales)
    check_tensor(f"{name}_scales", scales, shape=[e, n, kk // 16], last_dim_contiguous=True)
    check_tensor(f"{name}_dec", dec, dtype=torch.float32, shape=[e])
    return scales.view(torch.uint8), e, n, kk


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
    activation: str = "silu", block_n: int = 64, block_k: int = 128, group_m: int = 8, num_warps: int = 4,
    num_stages: int = 3, use_tma: bool = False, fast_decode: bool = False, stream_weights: bool = False, out=None,
):
    """``act(x[token] @ w13[e, :I]^T) * (x[token] @ w13[e, I:]^T)`` per route → intermediate ``[R, I]`` x.dtype.

    Rows of routes that no local expert takes are left unwritten (the down GEMM never reads them).
    """
    w_sf, h, i, r, out = check_gate_up_inputs(x, w13_codes, w13_scales, w13_dec, align, activation, out)
    if r == 0:
        return out
    grid = (align.max_blocks * triton.cdiv(i, block_n),)
    _moe_w4a16_gate_up_kernel[grid](
        x, w13_codes, _weight_arg(w13_codes, use_tma, block_n, block_k), w_sf, w13_dec, out,
        align.sorted_ids, align.expert_ids, align.num_padded,
        r, i, h, align.top_k, align.max_blocks,
        x.stride(0), w13_codes.stride(0), w13_codes.stride(1), w_sf.stride(0), w_sf.stride(1), out.stride(0),
        ACTIVATION=activation, USE_TMA=use_tma, FAST_DECODE=fast_decode, STREAM_W=stream_weights,
        EVEN_K=h % block_k == 0, BLOCK_M=align.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


def check_gate_up_bank(w13_codes, w13_scales, w13_dec, h: int, activation: str, align, t: int, x_name: str):
    """The checks every gate_up launcher shares (W4A16 and W4A4, Triton and Gluon): the w13 bank for hidden size
    ``h``, the activation, and an alignment built for ``t`` tokens of ``x_name``.  Returns ``(w13 scales as e4m3,
    I, routes)``."""
    w_sf, _, two_i, _ = _check_bank("w13", w13_codes, w13_scales, w13_dec, None, h)
    if two_i % 32:
        raise ValueError(f"w13_codes: 2I = {two_i} rows must be gate and up halves of I % 16 == 0")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    r = align.num_routes
    if r != t * align.top_k:
        raise ValueError(f"align: built for {r} routes, {x_name} has {t} tokens x top_k {align.top_k}")
    return w_sf, two_i // 2, r


def check_gate_up_inputs(x, w13_codes, w13_scales, w13_dec, align, activation, out):
    """The W4A16 gate_up launchers' argument checks (Triton and Gluon); allocates the intermediate if not given.
    Returns ``(w13 scales as e4m3, H, I, routes, out)``."""
    import torch

    from ..format.checks import ACT_DTYPES, check_tensor

    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    t, h = x.shape
    w_sf, i, r = check_gate_up_bank(w13_codes, w13_scales, w13_dec, h, activation, align, t, "x")
    if out is None:
        out = torch.empty((r, i), dtype=x.dtype, device=x.device)
    check_tensor("out", out, dtype=x.dtype, shape=[r, i], last_dim_contiguous=True)
    return w_sf, h, i, r, out


def check_down_inputs(inter, w2_codes, w2_scales, w2_dec, topk_weights, align, out, deterministic):
    """The down GEMM launchers' argument checks (Triton and Gluon): ``(w2 scales as e4m3, H, I, routes)``."""
    import torch

    from ..format.checks import ACT_DTYPES, check_tensor

    r = align.num_routes
    check_tensor("inter", inter, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    w_sf, _, h, i = _check_bank("w2", w2_codes, w2_scales, w2_dec, None, inter.shape[1])
    check_tensor("inter", inter, shape=[r, i])
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=[r // max(align.top_k, 1), align.top_k])
    rows = r if deterministic else r // max(align.top_k, 1)
    check_tensor("out", out, dtype=torch.float32, shape=[rows, h], last_dim_contiguous=True)
    return w_sf, h, i, r


def moe_w4a16_down(
    inter, w2_codes, w2_scales, w2_dec, topk_weights, align: MoeAlignment, out, *,
    deterministic: bool = False, block_n: int = 64, block_k: int = 128, group_m: int = 8, num_warps: int = 4,
    num_stages: int = 3, use_tma: bool = False, fast_decode: bool = False, stream_weights: bool = False,
):
    """``topk_weight * (inter[route] @ w2[e]^T)`` summed into ``out``.

    ``out`` is fp32 and zeroed by the caller: ``[T, H]`` (atomic adds) or, with ``deterministic``, the per-route
    buffer ``[R, H]`` that :func:`.moe_align.moe_sum` reduces in slot order.
    """
    w_sf, h, i, r = check_down_inputs(inter, w2_codes, w2_scales, w2_dec, topk_weights, align, out, deterministic)
    if r == 0:
        return out
    grid = (align.max_blocks * triton.cdiv(h, block_n),)
    _moe_w4a16_down_kernel[grid](
        inter, w2_codes, _weight_arg(w2_codes, use_tma, block_n, block_k), w_sf, w2_dec, topk_weights.contiguous(), out,
        align.sorted_ids, align.expert_ids, align.num_padded,
        r, h, i, align.top_k, align.max_blocks,
        inter.stride(0), w2_codes.stride(0), w2_codes.stride(1), w_sf.stride(0), w_sf.stride(1), out.stride(0),
        DETERMINISTIC=deterministic, USE_TMA=use_tma, FAST_DECODE=fast_decode, STREAM_W=stream_weights,
        EVEN_K=i % block_k == 0, BLOCK_M=align.block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
