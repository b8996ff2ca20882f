"""What the MoE GPU tests share (Triton and Gluon kernels alike): the real checkpoint shapes, random NVFP4 expert
banks made on the GPU (the CPU quantizer loop would take minutes at these sizes), routing, the tolerance, and the
W4A4 reference in steps.

W4A4 in steps: the input quantization is bit-exact with ``quantize_nvfp4`` (the tests check it against the CPU
reference).  The intermediate is quantized by the same exact quantizer, but from fp32 values that differ from the
reference's in the last ulps (summation order, ``exp``), so a code may round the other way where the value sits on
a rounding midpoint: :func:`fp4_flips` checks that every difference is explained (and rare), and
:func:`w4a4_reference` forms the output from the kernel's own intermediate.  Runs on torch 2.11 (the H200 image)
as well as 2.14.
"""

from __future__ import annotations

import torch

from vllm_nvfp4_sm120.format import GlobalScale, NvFp4, quantize_nvfp4, unit_values
from vllm_nvfp4_sm120.format.reference import gated_activation

SHAPES = {  # name: (H, I, E, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "qwen3-next-80b": (2048, 512, 512, 10),
    "odd": (336, 80, 6, 3),  # H, I not multiples of 256 (no TMA), I not a multiple of the tile
}
_BANKS: dict = {}
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def bank(e: int, rows: int, k: int, seed: int):
    """Random codes, valid e4m3 scales in [0.25, 2) and per-expert decode globals; a few banks kept (GPU memory)."""
    key = (e, rows, k, seed)
    if key not in _BANKS:
        if len(_BANKS) > 4:
            _BANKS.clear()
        g = torch.Generator(device="cuda").manual_seed(seed)
        codes = torch.randint(0, 256, (e, rows, k // 2), generator=g, device="cuda", dtype=torch.uint8)
        scales = (0.25 + 1.75 * torch.rand(e, rows, k // 16, generator=g, device="cuda")).to(torch.float8_e4m3fn)
        dec = 0.004 + 0.004 * torch.rand(e, generator=g, device="cuda")
        _BANKS[key] = (NvFp4(codes, scales), dec)
    return _BANKS[key]


def layer(name: str):
    """``(H, I, E, top_k, w13, w13_dec, w2, w2_dec)`` of a shape in :data:`SHAPES`."""
    h, i, e, k = SHAPES[name]
    w13, d13 = bank(e, 2 * i, h, 1)
    w2, d2 = bank(e, h, i, 2)
    return h, i, e, k, w13, d13, w2, d2


def routing(t: int, e: int, k: int, skewed: bool, seed: int = 0):
    """Softmax top-k routing; ``skewed``: every token on experts 0..k-1 (a few experts with many row blocks)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(t, e, generator=g, device="cuda")
    if skewed:
        logits[:, :k] += 100.0
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32)


def assert_moe_close(out, ref):
    # Differences are fp32 summation order and last-bit rounding of the 16-bit intermediate that follows from
    # it: absolute in the sums, so the floor scales with the output; plus one bf16 ulp of the output itself.
    atol = 2.0**-8 * float(ref.float().abs().max()) if ref.numel() else 0.0
    torch.testing.assert_close(out, ref, atol=atol, rtol=2.0**-7)


def w4a4_scales(x):
    """Static activation scales as a checkpoint would carry them: the input's amax, and a fixed one for down."""
    a13 = GlobalScale.of(x) if x.numel() else GlobalScale.from_encode(1.0)
    return a13.to("cuda"), GlobalScale.from_amax(24.0).to("cuda")


def fp4_flips(codes, scales, ref_values, gs: GlobalScale) -> int:
    """Kernel NVFP4 ``(codes, scales)`` vs ``quantize_nvfp4(ref_values)``: asserts every difference is explained (a
    block scale one e4m3 step off, or a code whose value sits within fp32 jitter of an e2m1 rounding midpoint,
    both rare) and returns how many there are."""
    q = quantize_nvfp4(ref_values, gs)
    sf_kernel, sf_ref = scales.view(torch.uint8), q.scales.view(torch.uint8)
    bad_sf = sf_kernel != sf_ref
    assert int(bad_sf.sum()) <= max(2, bad_sf.numel() // 10000), f"{int(bad_sf.sum())} block scales differ"
    if bad_sf.any():  # (no ``Tensor.max(initial=...)`` on torch 2.11)
        steps = (sf_kernel.int() - sf_ref.int())[bad_sf].abs()
        assert int(steps.max()) <= 1, f"a block scale is {int(steps.max())} e4m3 steps off"
    enc = gs.enc.to(ref_values.device)
    scaled = ref_values.float().unflatten(-1, (-1, 16)) / (q.scales.float() / enc).unsqueeze(-1)
    kernel_codes = torch.stack((codes & 15, codes >> 4), -1).flatten(-2).unflatten(-1, (-1, 16))
    ref_codes = torch.stack((q.codes & 15, q.codes >> 4), -1).flatten(-2).unflatten(-1, (-1, 16))
    diff = (kernel_codes != ref_codes) & ~bad_sf.unsqueeze(-1)
    if diff.any():
        mid = torch.tensor(_MIDPOINTS, device=scaled.device)
        dist = (scaled[diff].abs().unsqueeze(-1) - mid).abs().min(-1).values
        assert float(dist.max()) < 1e-3, f"code mismatch {float(dist.max())} away from any rounding midpoint"
        assert int(diff.sum()) <= max(4, diff.numel() // 10000), f"{int(diff.sum())} codes differ"
    return int(bad_sf.sum()) + int(diff.sum())


def w4a4_reference(a_codes, a_scales, w13, d13, w2, d2, tw, ti, i_codes, i_scales, a13, a2, activation="silu"):
    """The W4A4 layer's reference output ``[T, H]`` fp32 formed from the kernel's own intermediate, after checking
    that intermediate against ``quantize_nvfp4(reference fp32 intermediate)`` expert by expert; returns
    ``(output, number of explained intermediate differences)``."""
    t, k = ti.shape
    x_in = unit_values(a_codes, a_scales)  # = the reference's quantized input (the callers check it bit-exact)
    out = torch.zeros(t, w2.codes.shape[1], device=a_codes.device)
    routes = ti.reshape(-1).long()
    flips = 0
    for ex in range(w13.codes.shape[0]):
        r = (routes == ex).nonzero().flatten()
        if r.numel() == 0:
            continue
        hh = (x_in[r // k] @ unit_values(w13.codes[ex], w13.scales[ex]).t()) * (d13[ex] * a13.dec)
        flips += fp4_flips(i_codes[r], i_scales[r], gated_activation(hh, activation), a2)
        y = unit_values(i_codes[r], i_scales[r].view(torch.float8_e4m3fn)) @ unit_values(w2.codes[ex],
                                                                                          w2.scales[ex]).t()
        out.index_add_(0, r // k, y * (d2[ex] * a2.dec) * tw.reshape(-1)[r, None])
    return out, flips
