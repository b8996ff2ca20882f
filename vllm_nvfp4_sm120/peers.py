"""Peer kernels timed side by side with ours in the benchmarks.  Never a dependency: each factory returns a
callable ``x -> out`` when the peer is importable and takes the layer, else a one-line reason to print.

gemlite (``gemlite.helper.A16W4_NVFP``, weight-only NVFP4) is built from the checkpoint's own tensors, no repack:
its NVFP4 layout is ours.  What its source (0.6.0.post2) does with them, and so what we pass:

- ``weight_packed``: our codes ``[N, K/2]`` uint8 as they are.  ``GemLiteLinearTriton.pack(..., packed=True)``
  only views them as ``[K/2, N]`` (``.t()``, not made contiguous for MX types; the unpacked route packs element
  ``2i`` into the low nibble of byte ``i`` and ends in the same ``[K/2, N]`` view), and the kernel hands that tile
  to ``tl.dot_scaled`` as ``e2m1`` packed along K, first element in the low bits: our nibble order and code table.
  The layer keeps a view of our codes, not a copy.
- ``scales``: our linear (unswizzled) e4m3 block scales ``[N, K/16]``; ``uint8`` is viewed as ``float8_e4m3fn``.
  It stores them K-major (``[K/16, N]`` contiguous, then a ``[N, K/16]`` view: what ``dot_scaled`` takes for the
  rhs), as e4m3, group 16.
- ``meta_scale``: the **encode** global (``W = W_q * scale / meta_scale``): the helper stores ``1 / meta_scale``
  and the kernel multiplies the fp32 accumulator by it.  We pass ``1 / dec`` in float64 so that the stored
  fp32 value is our decode global to the bit.  One global per layer: a fused layer whose parts have different
  globals cannot be expressed, and the factory says so.

Its output is **not** our reference's to the last bit, and the difference is its reduction, not the weight: for
NVFP4 it always runs ``gemm_splitK_MX_kernel`` (``get_matmul_type``: ``GEMM_SPLITK`` for M < 64, also at M = 1,
``GEMM`` above; its GEMV MX kernel is never picked, and would be wrong for NVFP4 if forced: its code table is
doubled for the e8m0 scale's ``* 0.5``, which e4m3 scales do not get, and it ignores the global).  With
``SPLIT_K > 1`` (half of its "default" configs, most of its "fast" ones) each K-split rounds its partial sum to
the output dtype and ``tl.atomic_add``s it into a bf16 output (``gpu_supports_bfloat16_atomicadd`` on sm_90+).
Output elements that are small next to the partials (sums that cancel) then differ from the once-rounded
reference by many times their own size: an elementwise check with a 1-2 % rtol and a tiny atol fails at real
shapes (greatest relative differences of 2 to 150 at T = 1 and 16) while every column of the weight comes out
bit-exact.  :func:`gemlite_split_k_ref` is that arithmetic (``benchmarks/gemlite_check.py``) up to the fp32 order
inside each split, which on the H200 still moved outputs near zero by a bf16 step of the partials (so the
benchmark checks gemlite against our reference with an allowance of ``SPLIT_K`` bf16 steps of the largest
output); with ``SPLIT_K = 1`` it is :func:`~.format.linear_w4a16_ref` up to fp32 summation order.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from .format.checks import ACT_DTYPES, check_tensor
from .format.reference import unit_values
from .format.scales import GlobalScale, per_row_decode

PEERS = ("gemlite",)  # what ``bench linear --peers`` accepts
GEMLITE_AUTOTUNE = ("default", "fast", "max")


def _import_gemlite():
    """gemlite's helper class, or the reason it is unavailable (any import failure: not installed, no GPU)."""
    try:
        from gemlite.helper import A16W4_NVFP
    except Exception as e:  # ImportError, or gemlite's import-time CUDA queries failing without a GPU
        return None, f"gemlite not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return A16W4_NVFP, None


def gemlite_factory(autotune: str = "default") -> tuple[Callable | None, str | None]:
    """``(gemlite_nvfp4_linear, None)``, or ``(None, reason)`` when gemlite cannot be imported.

    gemlite reads its autotune setting when its kernel modules load, so the setting is made here, before the first
    import ("default": its 2-config list, what ``set_autotune(False)`` selects; "fast": its ~23-config search,
    minutes of compiles per shape; "max").  Without effect once gemlite is imported (or stubbed in ``sys.modules``)."""
    if autotune not in GEMLITE_AUTOTUNE:
        raise ValueError(f"autotune: expected one of {GEMLITE_AUTOTUNE}, got {autotune!r}")
    if "gemlite" not in sys.modules:
        try:
            spec = importlib.util.find_spec("gemlite")
            if spec is None:
                return None, "gemlite not importable (not installed; without a package index: source .carry/peers.sh)"
            cfg_path = Path(spec.origin).parent / "triton_kernels" / "config.py"
            cfg_spec = importlib.util.spec_from_file_location("gemlite.triton_kernels.config", cfg_path)
            cfg = importlib.util.module_from_spec(cfg_spec)
            cfg_spec.loader.exec_module(cfg)
            cfg.set_autotune(autotune)
            sys.modules["gemlite.triton_kernels.config"] = cfg
        except Exception as e:  # a broken install, or its import-time CUDA queries failing without a GPU
            return None, f"gemlite not importable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    _, reason = _import_gemlite()
    return (None, reason) if reason else (gemlite_nvfp4_linear, None)


def gemlite_copies(build: Callable, weights: list[tuple[torch.Tensor, torch.Tensor]], weight_gs, *,
                   dtype: torch.dtype) -> list[Callable] | str:
    """gemlite's layer (``build``, :func:`gemlite_nvfp4_linear`) on each ``(codes, scales)`` of ``weights`` (the
    benchmarks' copies beyond L2), or the first build's reason string: the other copies are built only once the
    first is taken."""
    first = build(*weights[0], weight_gs, dtype=dtype)
    if isinstance(first, str):
        return first
    return [first] + [build(codes, scales, weight_gs, dtype=dtype) for codes, scales in weights[1:]]


def gemlite_config() -> tuple[int, int]:
    """``(SPLIT_K, BLOCK_SIZE_K)`` of gemlite's NVFP4 kernel (``gemm_splitK_MX_kernel``, what it runs for M < 64)
    in its last call: what its output's rounding depends on."""
    from gemlite.triton_kernels import gemm_splitK_kernels as gk

    cfg = gk.gemm_splitK_MX_kernel.best_config.kwargs
    return cfg["SPLIT_K"], cfg["BLOCK_SIZE_K"]


def gemlite_allowance(want: torch.Tensor, split_k: int) -> float:
    """The absolute difference from our reference that gemlite's split-K output may have.

    Each of its ``split_k`` partial sums is rounded to the output dtype and added by a 16-bit atomic add (which
    rounds again), so an output can miss the once-rounded reference by a few 16-bit steps of the partials; on the
    H200 it also missed its own split-K model (:func:`gemlite_split_k_ref`) at outputs near zero (the partials'
    fp32 order).  ``split_k + 1`` bf16 steps of the largest output: a wrong weight gives errors of the output's
    own size, far beyond it (its one-hot columns are bit-exact: ``benchmarks/gemlite_check.py``)."""
    return (split_k + 1) * 2.0**-8 * float(want.float().abs().max())


def check_gemlite(got: torch.Tensor, want: torch.Tensor) -> tuple[str, str | None]:
    """gemlite's output ``got`` (from the call just made) against our reference ``want`` within
    :func:`gemlite_allowance`.

    Returns ``(label, None)``, the label naming the split-K that call ran (its autotuner picks it per shape and
    batch), or ``(label, why)``: a one-line reason not to time it."""
    split_k, _ = gemlite_config()
    label = f"gemlite (split {split_k})"
    if got.shape != want.shape or got.dtype != want.dtype:
        return label, f"output {list(got.shape)} {got.dtype}, expected {list(want.shape)} {want.dtype}"
    try:
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=gemlite_allowance(want, split_k))
    except AssertionError as e:
        lines = str(e).strip().splitlines()
        return label, f"differs from our reference beyond its split-K allowance ({lines[0]}; {lines[-1].strip()})"
    return label, None


def gemlite_nvfp4_linear(codes: torch.Tensor, scales: torch.Tensor, weight_gs: GlobalScale | torch.Tensor, *,
                         dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
                         ) -> Callable[[torch.Tensor], torch.Tensor] | str:
    """gemlite's NVFP4 weight-only layer on our weight, or why it cannot be built.

    ``weight_gs``: the layer's one global (a :class:`GlobalScale`), or per-row decode globals ``[N]`` that must all
    be equal (the benchmarks' form); different per-part globals give a reason instead of a wrong layer.
    """
    check_tensor("codes", codes, dtype=torch.uint8, ndim=2)
    n, half_k = codes.shape
    check_tensor("scales", scales, dtype=(torch.float8_e4m3fn, torch.uint8), shape=[n, half_k // 8])
    if isinstance(weight_gs, torch.Tensor):
        check_tensor("weight_gs", weight_gs, dtype=torch.float32, shape=[n])
        if n and not bool((weight_gs == weight_gs[0]).all()):
            return "gemlite: one global per layer; this weight has different per-part globals"
        weight_gs = GlobalScale.from_decode(weight_gs[0] if n else torch.tensor(1.0))
    a16w4_nvfp, reason = _import_gemlite()
    if reason:
        return reason
    helper = a16w4_nvfp(device=codes.device, dtype=dtype)
    # gemlite stores 1 / meta_scale in fp32: the float64 reciprocal of our decode global inverts back to it exactly
    # (the fp32 encode global need not).
    meta_scale = 1.0 / weight_gs.dec.to(device=codes.device, dtype=torch.float64)
    layer = helper.from_packed_weights(codes, scales=scales, meta_scale=meta_scale, bias=bias)
    return layer


def gemlite_split_k_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                        weight_dec: torch.Tensor | float, *, split_k: int, block_k: int,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """What gemlite's ``gemm_splitK`` NVFP4 kernel returns for our weight, rounding included.

    Split ``s`` of ``split_k`` sums the ``block_k``-wide K blocks ``b`` with ``b % split_k == s`` in fp32 (products
    of the exact weight), multiplies by the global, rounds to ``x.dtype`` and adds into a zeroed ``x.dtype`` output,
    each add rounding again (its ``tl.atomic_add``, here in split order; the GPU's order varies, which matters only
    for ``split_k > 2``); ``bias`` is added last in ``x.dtype``.  Without a bias, ``split_k = 1`` is
    :func:`~.format.linear_w4a16_ref` up to fp32 summation order.
    """
    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2)
    if split_k < 1 or block_k < 1:
        raise ValueError(f"split_k, block_k: expected >= 1, got {split_k}, {block_k}")
    w = unit_values(codes, scales)
    dec = per_row_decode(weight_dec, None, w.shape[0]).to(x.device)
    split_of = torch.arange(w.shape[1], device=x.device) // block_k % split_k
    out = torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    for s in range(split_k):
        part = (x.to(torch.float32) * (split_of == s)) @ w.t() * dec
        out = (out.to(torch.float32) + part.to(x.dtype).to(torch.float32)).to(x.dtype)
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out
