"""What the launchers of every kernel family share: the sm_120 shared-memory limit, the interpreter switch, the
register-cap launch option, the argument checks of the NVFP4 linear launchers and their no-launch results.

Imports only the standard library at module level: ``aot`` (the compile harness, run in a fresh subprocess per
kernel) takes its shared-memory limit from here.
"""

from __future__ import annotations

import os

# The CUDA programming guide's per-block shared-memory limit for compute capability 12.x (99 KB).
SM120_MAX_SMEM_BYTES = 99 * 1024


def register_cap_option(owner: str, max_regs: int | None) -> dict:
    """A tile's register cap as Triton's ``maxnreg`` launch option (``{}`` without one), checked: the hardware
    allocates registers per thread in units of 8, at most 255."""
    if max_regs is None:
        return {}
    if max_regs % 8 or not 64 <= max_regs <= 255:
        raise ValueError(f"{owner}.max_regs: expected None or a multiple of 8 in [64, 255], got {max_regs}")
    return {"maxnreg": max_regs}


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (the CPU tests): kernels then take their pure-``tl`` paths."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_linear_inputs(fn: str, x, w_codes, w_scales, w_dec_rows, bias, out):
    """The argument checks of every NVFP4 linear launcher (Triton, Gluon, dequant + cuBLAS):
    ``(T, N, K, w_scales as e4m3, out)``, ``out`` allocated here when not given."""
    import torch

    from ..format.checks import ACT_DTYPES, as_e4m3, check_tensor

    check_tensor("x", x, dtype=ACT_DTYPES, ndim=2, last_dim_contiguous=True)
    t, k = x.shape
    check_tensor("w_codes", w_codes, dtype=torch.uint8, ndim=2, last_dim_contiguous=True)
    n = w_codes.shape[0]
    if k % 16:
        raise ValueError(f"{fn}: x: K = {k} must be a multiple of 16 (one e4m3 scale per 16 weights)")
    check_tensor("w_codes", w_codes, shape=[n, k // 2])
    w_scales = as_e4m3("w_scales", w_scales)
    check_tensor("w_scales", w_scales, shape=[n, k // 16], last_dim_contiguous=True)
    check_tensor("w_dec_rows", w_dec_rows, dtype=torch.float32, shape=[n])
    if w_dec_rows.numel() > 1 and w_dec_rows.stride(0) != 1:
        raise ValueError(f"w_dec_rows: must be contiguous, got stride {w_dec_rows.stride()}")
    if bias is not None:
        check_tensor("bias", bias, dtype=(torch.bfloat16, torch.float16, torch.float32), shape=[n])
        if n > 1 and bias.stride(0) != 1:
            raise ValueError(f"bias: must be contiguous, got stride {bias.stride()}")
    for name, tensor in (("w_codes", w_codes), ("w_scales", w_scales), ("w_dec_rows", w_dec_rows), ("bias", bias)):
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"{name}: expected a tensor on {x.device} (where x is), got {tensor.device}")
    if out is None:
        out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    check_tensor("out", out, dtype=x.dtype, shape=[t, n], last_dim_contiguous=True, device=x.device)
    return t, n, k, w_scales, out


def trivial_linear_output(out, k: int, w_dec_rows, bias):
    """What a linear launcher returns without launching, else None: T = 0 or N = 0 (the empty ``out``), K = 0
    (the product is empty; only the bias remains)."""
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.to(out.dtype).expand_as(out))
    return None


def check_workspace(workspace, numel: int, device) -> None:
    """A split-K workspace: contiguous fp32 with at least ``numel`` elements on ``device``."""
    import torch

    from ..format.checks import check_tensor

    check_tensor("workspace", workspace, dtype=torch.float32, device=device)
    if workspace.numel() < numel or not workspace.is_contiguous():
        raise ValueError(
            f"workspace: expected a contiguous fp32 tensor of >= {numel} elements (split_k * T * N), "
            f"got shape {list(workspace.shape)}"
        )
