"""Program → output tile mapping shared by the GEMM kernels."""

import triton
import triton.language as tl


@triton.jit
def grouped_coords(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """``(pid_m, pid_n)`` in grouped order over a ``num_m x num_n`` tile grid: GROUP_M row tiles share each weight
    column tile while it is in L2, so the weight is fetched from DRAM about once per GROUP_M row tiles."""
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    rows_in_group = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * num_n)) // rows_in_group
    return pid_m, pid_n


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """:func:`grouped_coords` for an ``M x N`` output in ``BLOCK_M x BLOCK_N`` tiles."""
    return grouped_coords(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
