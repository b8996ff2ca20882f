"""What the MoE grouped-GEMM families share (Triton and Gluon, W4A16 and W4A4): the alignment arguments of their
compile signatures, the gated activation of the gate_up epilogue, and the launchers' argument checks.

An expert *bank* is vLLM's loaded tensor: codes ``[E, rows, K/2]`` u8, linear e4m3 scales ``[E, rows, K/16]``,
per-expert decode globals ``[E]`` fp32.  The gate_up bank ``w13`` holds the gate rows, then the up rows.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..format.reference import ACTIVATIONS

# The arguments every grouped GEMM takes from :class:`.moe_align.MoeAlignment`, as the compile harness types them.
ALIGN_SIGNATURE = {"sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "num_padded_ptr": "*i32"}


@triton.jit
def local_expert(topk_ids_ptr, expert_map_ptr, offs, R, E, GLOBAL_E, HAS_MAP: tl.constexpr):
    """Local expert of each route in ``offs``; -1 for padding, another rank's expert, or an id out of range."""
    ids = tl.load(topk_ids_ptr + offs, mask=offs < R, other=-1).to(tl.int32)
    if HAS_MAP:
        known = (ids >= 0) & (ids < GLOBAL_E)
        ids = tl.load(expert_map_ptr + ids, mask=known, other=-1).to(tl.int32)
    return tl.where((ids >= 0) & (ids < E), ids, -1)


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


# Metadata signatures (shapes, strides, dtypes, devices) of MoE layer calls and banks whose checks passed: banks
# keep theirs after load, so the checks run once per layer shape and token count (bounded like the linear op's).
_CHECKED: set[tuple] = set()
_BANKS: dict[tuple, tuple[int, int, int]] = {}
_MAX_CHECKED = 1 << 16


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def check_bank(name: str, codes, scales, dec, rows: int | None, k: int | None):
    """An expert bank ``name`` (``w13``, ``w2``) with ``rows`` rows of ``k`` weights (None: any); returns
    ``(scales as uint8, E, rows, K)``.

    A layer's banks keep their metadata after load, so the checks run once per (bank, expectation) signature;
    later calls look the signature up (every MoE launcher calls this twice per layer call)."""
    import torch

    key = (name, _meta(codes), _meta(scales), _meta(dec), rows, k)
    dims = _BANKS.get(key)
    if dims is None:
        dims = _check_bank(name, codes, scales, dec, rows, k)
        if len(_BANKS) >= _MAX_CHECKED:
            _BANKS.clear()
        _BANKS[key] = dims
    return (scales if scales.dtype == torch.uint8 else scales.view(torch.uint8)), *dims


def _check_bank(name: str, codes, scales, dec, rows: int | None, k: int | None) -> tuple[int, int, int]:
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
    return e, n, kk


def check_enc(name: str, enc):
    """One fp32 encode scale on the device (a static activation scale); returns it as ``[1]``."""
    import torch

    from ..format.checks import check_tensor

    check_tensor(name, enc, dtype=torch.float32)
    if enc.numel() != 1:
        raise ValueError(f"{name}: expected one fp32 encode scale (a device tensor), got shape {list(enc.shape)}")
    return enc.reshape(1)


def check_gate_up_bank(w13_codes, w13_scales, w13_dec, h: int, activation: str, align, t: int, x_name: str):
    """The checks every gate_up launcher shares (W4A16 and W4A4, Triton and Gluon): the w13 bank for hidden size
    ``h``, the activation, and an alignment built for ``t`` tokens of ``x_name``.  Returns ``(w13 scales as e4m3,
    I, routes)``."""
    w_sf, _, two_i, _ = check_bank("w13", w13_codes, w13_scales, w13_dec, None, h)
    if two_i % 32:
        raise ValueError(f"w13_codes: 2I = {two_i} rows must be gate and up halves of I % 16 == 0")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    r = align.num_routes
    if r != t * align.top_k:
        raise ValueError(f"align: built for {r} routes, {x_name} has {t} tokens x top_k {align.top_k}")
    return w_sf, two_i // 2, r


def _check_down_out(topk_weights, align, out, deterministic: bool, h: int) -> None:
    import torch

    from ..format.checks import check_tensor

    r = align.num_routes
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=[r // max(align.top_k, 1), align.top_k])
    rows = r if deterministic else r // max(align.top_k, 1)
    check_tensor("out", out, dtype=torch.float32, shape=[rows, h], last_dim_contiguous=True)


def check_w4a16_gate_up_inputs(x, w13_codes, w13_scales, w13_dec, align, activation, out):
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


def check_w4a16_down_inputs(inter, w2_codes, w2_scales, w2_dec, topk_weights, align, out, deterministic):
    """The W4A16 down launchers' argument checks (Triton and Gluon): ``(w2 scales as e4m3, H, I, routes)``."""
    from ..format.checks import ACT_DTYPES, check_tensor

    r = align.num_routes
    check_tensor("inter", inter, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    w_sf, _, h, i = check_bank("w2", w2_codes, w2_scales, w2_dec, None, inter.shape[1])
    check_tensor("inter", inter, shape=[r, i])
    _check_down_out(topk_weights, align, out, deterministic, h)
    return w_sf, h, i, r


def check_w4a4_gate_up_inputs(a_codes, a_scales, w13_codes, w13_scales, w13_dec, align, activation, out_codes,
                              out_scales):
    """The W4A4 gate_up launchers' argument checks (Triton and Gluon); allocates the FP4 intermediate if not given.

    Returns ``(w13 scales as e4m3, H, I, routes, out_codes, out_scales)``.
    """
    import torch

    from ..format.checks import check_tensor

    check_tensor("a_codes", a_codes, dtype=torch.uint8, ndim=2, last_dim_contiguous=True)
    t, hh = a_codes.shape
    h = 2 * hh
    check_tensor("a_scales", a_scales, dtype=(torch.uint8, torch.float8_e4m3fn), shape=[t, h // 16],
                 last_dim_contiguous=True)
    w_sf, i, r = check_gate_up_bank(w13_codes, w13_scales, w13_dec, h, activation, align, t, "a_codes")
    if out_codes is None:
        out_codes = torch.empty((r, i // 2), dtype=torch.uint8, device=a_codes.device)
    if out_scales is None:
        out_scales = torch.empty((r, i // 16), dtype=torch.uint8, device=a_codes.device)
    check_tensor("out_codes", out_codes, dtype=torch.uint8, shape=[r, i // 2], last_dim_contiguous=True)
    check_tensor("out_scales", out_scales, dtype=torch.uint8, shape=[r, i // 16], last_dim_contiguous=True)
    return w_sf, h, i, r, out_codes, out_scales


def check_w4a4_down_inputs(a_codes, a_scales, w2_codes, w2_scales, w2_dec, topk_weights, align, out, deterministic):
    """The W4A4 down launchers' argument checks (Triton and Gluon): ``(w2 scales as e4m3, H, I, routes)``."""
    import torch

    from ..format.checks import check_tensor

    r = align.num_routes
    check_tensor("a_codes", a_codes, dtype=torch.uint8, ndim=2, last_dim_contiguous=True)
    i = 2 * a_codes.shape[1]
    check_tensor("a_codes", a_codes, shape=[r, i // 2])
    check_tensor("a_scales", a_scales, dtype=(torch.uint8, torch.float8_e4m3fn), shape=[r, i // 16],
                 last_dim_contiguous=True)
    w_sf, _, h, _ = check_bank("w2", w2_codes, w2_scales, w2_dec, None, i)
    _check_down_out(topk_weights, align, out, deterministic, h)
    return w_sf, h, i, r


def check_moe_layer(x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids,
                    a13_enc=None, a2_enc=None, expert_map=None) -> None:
    """Every tensor of one MoE layer call, on CPU and GPU alike, before anything reads them: ``x [T, H]``
    bf16/fp16; the gate_up bank ``[E, 2I, H/2]`` / ``[E, 2I, H/16]`` / ``[E]``; the down bank ``[E, H, I/2]`` /
    ``[E, H, I/16]`` / ``[E]`` of the same E; the routing ``[T, top_k]``; the encode scales (one fp32 value each);
    ``expert_map [global_E]`` int32; all on x's device."""
    key = tuple(map(_meta, (x, w13_codes, w13_scales, w13_dec, w2_codes, w2_scales, w2_dec, topk_weights, topk_ids,
                            a13_enc, a2_enc, expert_map)))
    if key in _CHECKED:
        return
    import torch

    from ..format.checks import ACT_DTYPES, check_tensor

    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    t, h = x.shape
    dev = x.device
    _, e, two_i, _ = check_bank("w13", w13_codes, w13_scales, w13_dec, None, h)
    if two_i % 32:
        raise ValueError(f"w13_codes: 2I = {two_i} rows must be gate and up halves of I % 16 == 0, "
                         f"got shape {list(w13_codes.shape)}")
    i = two_i // 2
    check_tensor("w2_codes", w2_codes, dtype=torch.uint8, ndim=3)
    if list(w2_codes.shape) != [e, h, i // 2]:
        raise ValueError(f"w2_codes: expected shape [{e}, {h}, {i // 2}] (E of w13, H of x, I/2 with 2I = {two_i} "
                         f"rows of w13), got {list(w2_codes.shape)}")
    check_bank("w2", w2_codes, w2_scales, w2_dec, h, i)
    check_tensor("topk_ids", topk_ids, dtype=(torch.int32, torch.int64), ndim=2)
    check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=[t, topk_ids.shape[1]])
    check_tensor("topk_ids", topk_ids, shape=[t, None])
    for name, enc in (("a13_enc", a13_enc), ("a2_enc", a2_enc)):
        if enc is not None:
            check_enc(name, enc)
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtype=torch.int32, ndim=1)
    named = (("w13_codes", w13_codes), ("w13_scales", w13_scales), ("w13_dec", w13_dec), ("w2_codes", w2_codes),
             ("w2_scales", w2_scales), ("w2_dec", w2_dec), ("topk_weights", topk_weights), ("topk_ids", topk_ids),
             ("a13_enc", a13_enc), ("a2_enc", a2_enc), ("expert_map", expert_map))
    for name, tensor in named:
        if tensor is not None and tensor.device != dev:
            raise ValueError(f"{name}: expected a tensor on {dev} (where x is), got {tensor.device}")
    if len(_CHECKED) >= _MAX_CHECKED:
        _CHECKED.clear()
    _CHECKED.add(key)
