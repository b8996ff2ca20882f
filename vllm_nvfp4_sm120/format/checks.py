"""Input validation shared by the format layer and the kernel launchers.

Every error names the tensor and says what was expected, so a wrong checkpoint or a wrong call fails with a
message a user can act on instead of a wrong answer or an illegal memory access.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

E4M3_DTYPES = (torch.float8_e4m3fn, torch.uint8)
ACT_DTYPES = (torch.bfloat16, torch.float16)


def _fmt_dtypes(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = False,
) -> torch.Tensor:
    """Validate ``t``; ``None`` entries in ``shape`` match any size."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        dtypes = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in dtypes:
            raise TypeError(f"{name}: expected dtype {_fmt_dtypes(dtypes)}, got {str(t.dtype).removeprefix('torch.')}")
    if ndim is not None:
        ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in ndims:
            raise ValueError(f"{name}: expected {' or '.join(map(str, ndims))}-D tensor, got shape {tuple(t.shape)}")
    if shape is not None:
        if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    if last_dim_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous (stride 1), got strides {t.stride()}")
    return t


def check_multiple(name: str, value: int, multiple: int, what: str = "size") -> None:
    if value % multiple:
        raise ValueError(f"{name}: {what} {value} is not a multiple of {multiple}")


def check_finite(name: str, t: torch.Tensor) -> None:
    """Reject NaN/inf: NVFP4 has no encoding for them, and a saturated NaN would corrupt a whole block."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = (~torch.isfinite(t)).nonzero()[0].tolist()
        raise ValueError(f"{name}: contains NaN or inf (first at index {bad}); NVFP4 cannot represent it")


def as_e4m3(name: str, t: torch.Tensor) -> torch.Tensor:
    """Block scales arrive as float8_e4m3fn (vLLM) or as raw uint8 bytes (FlashInfer); view both as e4m3."""
    check_tensor(name, t, dtype=E4M3_DTYPES)
    return t.view(torch.float8_e4m3fn) if t.dtype == torch.uint8 else t
