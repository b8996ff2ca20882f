"""Torch references for NVFP4 linears and MoE layers: the oracle every kernel test compares against.

They compute what the kernels compute, in the same places: products of ``e2m1 x e4m3`` values are exact in
fp16/bf16/fp32, so the references multiply the *unit* operands (global = 1), accumulate in fp32 and apply the
global scales once in the epilogue, as a GEMM does.  Intermediates are rounded where the kernels round them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .checks import ACT_DTYPES, check_tensor
from .quant import NvFp4, dequantize_nvfp4, quantize_nvfp4
from .scales import GlobalScale, per_row_decode

_UNIT = GlobalScale.from_decode(1.0)
ACTIVATIONS = ("silu", "gelu_tanh")


def unit_values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``e2m1(code) * e4m3(scale)`` in fp32 without the global: exact, what a tensor core multiplies."""
    return dequantize_nvfp4(codes, scales, _UNIT, torch.float32)


def linear_w4a16_ref(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    weight_dec: torch.Tensor | float,
    *,
    logical_widths: Sequence[int] | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [T, K]`` (bf16/fp16) times the NVFP4 weight ``[N, K/2]``, each fused part with its own decode global."""
    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2)
    n = codes.shape[0]
    w = unit_values(codes, scales)
    acc = x.to(torch.float32) @ w.t()
    acc = acc * per_row_decode(weight_dec, logical_widths, n).to(acc.device)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(x.dtype)


def linear_w4a4_ref(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    weight_gs: GlobalScale,
    input_gs: GlobalScale,
    *,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize ``x`` to NVFP4 with the static input global, then the FP4 x FP4 GEMM with ``alpha`` in the epilogue."""
    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2)
    xq = quantize_nvfp4(x, input_gs)
    acc = unit_values(*xq) @ unit_values(codes, scales).t()
    alpha = (input_gs.dec * weight_gs.dec).to(acc.device)
    acc = acc * alpha
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    return acc.to(x.dtype)


def topk_route(logits: torch.Tensor, top_k: int, *, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: fp32 weights ``[T, top_k]`` and int32 expert ids ``[T, top_k]``."""
    probs = torch.softmax(logits.to(torch.float32), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` for ``[..., 2I]`` with gate in the first half (vLLM's w13 = [w1; w3])."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")


def moe_ref(
    x: torch.Tensor,
    w13: NvFp4,
    w13_dec: torch.Tensor,
    w2: NvFp4,
    w2_dec: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    a13_gs: GlobalScale | None = None,
    a2_gs: GlobalScale | None = None,
    expert_map: torch.Tensor | None = None,
    intermediate_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """An NVFP4 MoE layer: gate_up → gated activation → down → routing-weighted top-k sum.

    Weights are vLLM's banks: ``w13`` codes ``[E, 2I, H/2]`` (gate rows, then up rows), ``w2`` codes
    ``[E, H, I/2]``, linear e4m3 scales, per-expert decode globals ``[E]``.  W4A16 form when the activation
    globals are ``None``: the intermediate is rounded to ``x.dtype`` as a bf16/fp16 buffer would.  W4A4 form with
    ``a13_gs`` and ``a2_gs``: the input is quantized with ``a13_gs``, the activation output (fp32 unless
    ``intermediate_dtype`` rounds it first, as vLLM's emulation does) is quantized with ``a2_gs``.
    ``expert_map`` maps global expert ids to local ones (-1: another rank's expert, contributes nothing).
    """
    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2)
    if (a13_gs is None) != (a2_gs is None):
        raise ValueError("a13_gs and a2_gs: give both (W4A4) or neither (W4A16)")
    w4a4 = a13_gs is not None
    t, k = topk_ids.shape
    check_tensor("topk_weights", topk_weights, shape=[t, k])
    num_local = w13.codes.shape[0]
    local_ids = topk_ids.long() if expert_map is None else expert_map.long()[topk_ids.long()]

    if w4a4:
        x_in = unit_values(*quantize_nvfp4(x, a13_gs))
    else:
        x_in = x.to(torch.float32)
    out = torch.zeros(t, w2.codes.shape[1], dtype=torch.float32, device=x.device)
    for e in range(num_local):
        token, slot = (local_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        g13 = w13_dec[e].to(torch.float32) * (a13_gs.dec if w4a4 else 1.0)
        h = (x_in[token] @ unit_values(w13.codes[e], w13.scales[e]).t()) * g13
        inter = gated_activation(h, activation)
        if w4a4:
            if intermediate_dtype is not None:
                inter = inter.to(intermediate_dtype)
            inter = unit_values(*quantize_nvfp4(inter, a2_gs, name="intermediate"))
            g2 = w2_dec[e].to(torch.float32) * a2_gs.dec
        else:
            inter = inter.to(intermediate_dtype or x.dtype).to(torch.float32)
            g2 = w2_dec[e].to(torch.float32)
        y = (inter @ unit_values(w2.codes[e], w2.scales[e]).t()) * g2
        out.index_add_(0, token, y * topk_weights[token, slot, None].to(torch.float32))
    return out.to(x.dtype)
