"""Argument checks of the align-free MoE decode launchers (Triton and Gluon): the routing, an expert bank, the down's
inputs.  Each runs once per metadata signature (shapes, strides, dtypes, devices): a layer's banks and its routing
keep theirs from call to call, so later calls look the signature up (bounded, as the MoE flow's cache)."""

from __future__ import annotations

# One program holds every route id of the call in a vector: T * top_k is bounded (decode sizes only).
MAX_ROUTES = 1024


def check_topk_ids(topk_ids, global_experts: int) -> None:
    """ValueError if an id is outside ``[0, global_experts)``.  Reads the ids on the host: a synchronizing check,
    not for CUDA-graph capture (the kernels themselves treat such ids as another rank's expert)."""
    if topk_ids.numel() == 0:
        return
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= global_experts:
        raise ValueError(f"topk_ids: expected expert ids in [0, {global_experts}), got values in [{lo}, {hi}]")


# Metadata signatures (shapes, strides, dtypes, devices) whose checks passed, with what the checks derived: a
# layer's banks and its routing keep theirs from call to call, so the launchers check them once per signature
# (bounded, as the MoE flow's cache).
_BANKS: dict[tuple, tuple[int, int, int]] = {}
_ROUTINGS: dict[tuple, tuple[int, int, int]] = {}
_MAX_CHECKED = 1 << 16


def _meta(t):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _remember(cache: dict, key: tuple, value):
    if len(cache) >= _MAX_CHECKED:
        cache.clear()
    cache[key] = value
    return value


def _check_routing(topk_ids, topk_weights, expert_map, num_experts: int, t: int | None, check_ids: bool, device):
    """topk ids/weights ``[T, top_k]`` (contiguous: the kernels index them flat) and the optional map; returns
    ``(T, top_k, global E, map or a dummy, has_map)``.  The id range check reads the ids (CPU, or ``check_ids``):
    it runs on every call."""
    key = (_meta(topk_ids), _meta(topk_weights), _meta(expert_map), num_experts, t, device)
    dims = _ROUTINGS.get(key)
    if dims is None:
        dims = _remember(_ROUTINGS, key, _check_routing_meta(topk_ids, topk_weights, expert_map, num_experts, t,
                                                             device))
    t, k, global_e = dims
    if check_ids or topk_ids.device.type == "cpu":
        check_topk_ids(topk_ids, global_e)
    emap = expert_map if expert_map is not None else topk_ids
    return t, k, global_e, emap, expert_map is not None


def _check_routing_meta(topk_ids, topk_weights, expert_map, num_experts: int, t: int | None, device):
    import torch

    from ..format.checks import check_tensor

    check_tensor("topk_ids", topk_ids, dtype=(torch.int32, torch.int64), ndim=2, device=device)
    if t is not None:
        check_tensor("topk_ids", topk_ids, shape=[t, None])
    t, k = topk_ids.shape
    if not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids: expected a contiguous [{t}, {k}] tensor, got strides {topk_ids.stride()}")
    if k < 1:
        raise ValueError(f"topk_ids: expected top_k >= 1, got shape {list(topk_ids.shape)}")
    if t * k > MAX_ROUTES:
        raise ValueError(f"topk_ids: T * top_k = {t * k} routes; the decode kernels take at most {MAX_ROUTES}")
    if topk_weights is not None:
        check_tensor("topk_weights", topk_weights, dtype=torch.float32, shape=[t, k], device=topk_ids.device)
        if not topk_weights.is_contiguous():
            raise ValueError(f"topk_weights: expected a contiguous [{t}, {k}] tensor, got strides "
                             f"{topk_weights.stride()}")
    global_e = num_experts
    if expert_map is not None:
        check_tensor("expert_map", expert_map, dtype=torch.int32, ndim=1, device=topk_ids.device)
        if not expert_map.is_contiguous():
            raise ValueError("expert_map: expected a contiguous 1-D tensor")
        global_e = expert_map.shape[0]
    return t, k, global_e


def _check_bank(name: str, codes, scales, dec, rows: int | None, k: int | None, device):
    """codes ``[E, rows, K/2]`` u8, scales ``[E, rows, K/16]`` e4m3 (or its bytes), dec ``[E]`` fp32, on
    ``device``, rows contiguous.  Returns ``(scale bytes, E, rows, K)``."""
    import torch

    key = (name, _meta(codes), _meta(scales), _meta(dec), rows, k, device)
    dims = _BANKS.get(key)
    if dims is None:
        dims = _remember(_BANKS, key, _check_bank_meta(name, codes, scales, dec, rows, k, device))
    return scales.view(torch.uint8), *dims


def _check_bank_meta(name: str, codes, scales, dec, rows: int | None, k: int | None, device):
    import torch

    from ..format.checks import as_e4m3, check_tensor

    check_tensor(f"{name}_codes", codes, dtype=torch.uint8, ndim=3, last_dim_contiguous=True, device=device)
    e, n, kh = codes.shape
    want = [e, rows if rows is not None else n, k // 2 if k is not None else kh]
    check_tensor(f"{name}_codes", codes, shape=want)
    kk = 2 * kh
    if kk % 16:
        raise ValueError(f"{name}_codes: K = {kk} must be a multiple of 16 (one e4m3 scale per 16 weights)")
    scales = as_e4m3(f"{name}_scales", scales)
    check_tensor(f"{name}_scales", scales, shape=[e, n, kk // 16], last_dim_contiguous=True, device=device)
    check_tensor(f"{name}_dec", dec, dtype=torch.float32, shape=[e], device=device)
    return e, n, kk


def check_down_inputs(inter, w2_codes, w2_scales, w2_dec, topk_ids, topk_weights, expert_map, check_ids, out):
    """A down launcher's inputs, whatever its tile: ``inter [T * top_k, I]``, the w2 bank for it, the routing with
    weights, ``out [T, H]`` (allocated in ``inter.dtype`` if not given).  Returns ``(w2 scale bytes, E, H, I, T,
    top_k, global E, map or a dummy, has_map, out)``."""
    import torch

    from ..format.checks import ACT_DTYPES, check_tensor

    check_tensor("inter", inter, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    w_sf, e, h, i = _check_bank("w2", w2_codes, w2_scales, w2_dec, None, inter.shape[1], inter.device)
    t, k, global_e, emap, has_map = _check_routing(topk_ids, topk_weights, expert_map, e, None, check_ids,
                                                   inter.device)
    check_tensor("inter", inter, shape=[t * k, i], device=inter.device)
    if out is None:
        out = torch.empty((t, h), dtype=inter.dtype, device=inter.device)
    check_tensor("out", out, dtype=inter.dtype, shape=[t, h], last_dim_contiguous=True, device=inter.device)
    return w_sf, e, h, i, t, k, global_e, emap, has_map, out


def check_gate_up_inputs(x, w13_codes, w13_scales, w13_dec, topk_ids, expert_map, activation: str, out, zero,
                         check_ids: bool):
    """A gate_up launcher's inputs, whatever its tile: ``x [T, H]``, the w13 bank for it (gate and up halves), the
    activation, the routing, ``out [T * top_k, I]`` (allocated in ``x.dtype`` if not given) and the buffer to zero.
    Returns ``(w13 scale bytes, E, H, I, T, top_k, global E, map or a dummy, has_map, out)``."""
    import torch

    from ..format.checks import ACT_DTYPES, check_tensor
    from ..format.reference import ACTIVATIONS

    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    t, h = x.shape
    w_sf, e, two_i, _ = _check_bank("w13", w13_codes, w13_scales, w13_dec, None, h, x.device)
    if two_i % 32:
        raise ValueError(f"w13_codes: 2I = {two_i} rows must be gate and up halves with I % 16 == 0")
    i = two_i // 2
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    t, k, global_e, emap, has_map = _check_routing(topk_ids, None, expert_map, e, t, check_ids, x.device)
    if out is None:
        out = torch.empty((t * k, i), dtype=x.dtype, device=x.device)
    check_tensor("out", out, dtype=x.dtype, shape=[t * k, i], last_dim_contiguous=True, device=x.device)
    if zero is not None:
        check_tensor("zero", zero, dtype=torch.float32, device=x.device)
        if not zero.is_contiguous():
            raise ValueError("zero: expected a contiguous tensor (its storage is zeroed flat)")
    return w_sf, e, h, i, t, k, global_e, emap, has_map, out

