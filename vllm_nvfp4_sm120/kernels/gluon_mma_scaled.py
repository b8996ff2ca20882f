"""Block-scaled NVFP4 MMA for Gluon on sm_120: the building block the later Gluon GEMMs use.

Gluon (up to Triton 3.9) has no public sm_120 block-scaled ``mma.sync``: ``nvidia.blackwell.tcgen05_mma_scaled`` is
sm_100 only, and Gluon skips the Triton passes that lower ``tl.dot_scaled``.  But Triton's sm_120 op is just
``tt.dot_scaled`` with an ``mma`` v2 accumulator, kWidth-4 dot-operand ``i8`` operands and linear-layout scales,
which the LLVM lowering turns into ``mma.sync.aligned.m16n8k64...kind::mxf4nvf4.block_scale.scale_vec::4X...ue4m3``
(SASS ``OMMA.SF.16864...UE4M3.4X``).  ``mma_scaled_sm120`` builds exactly that op through the private
``_semantic.dot_scaled`` (read from Triton's sources), and ``sm120_scaled_layouts`` gives the operand/scale layouts
Triton's own ``ScaledBlockedToMMA`` would choose (a Python port of ``getSM120DotScaledScaleLayout``).  The CPU
tests compile a Triton ``tl.dot_scaled`` kernel for sm_120 and check that its TTGIR layouts equal these, and that
the Gluon kernel below emits the OMMA.

**Numerics await an sm_120 run** (``NUMERICS_VERIFIED_ON_SM120``; the CLI selftest checks it): compiling proves
the instruction and the layouts, not the values; no sm_120 GPU has run this code.  It does not compile for sm_90
(ptxas: "mma with block scale not supported"); the H200 tests use the decode + bf16 MMA path instead.

Rules the caller must follow (limits of Triton's sm_120 lowering): K per call >= 64 elements (a [M, 32] byte
operand); B packed along K (``[K/2, N]``, i.e. a row-major ``[N, K/2]`` weight viewed transposed); both scales
given, e4m3, one per 16 elements; 2-D operands only (batched 3-D asserts in 3.8.0).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from .gluon_compat import DOT_SCALED_FORMAT_IS_CONSTEXPR, HAS_GLUON, TRITON_VERSION, gl, gluon

NUMERICS_VERIFIED_ON_SM120 = False
# Wheels whose sm_120 TTGIR/PTX for this op was inspected.  Outside them the private API may differ.
TESTED_TRITON = ((3, 6), (3, 7), (3, 8), (3, 9))
MIN_K = 64  # elements per call: K = 32 aborts Triton's sm_120 lowering


def check_version() -> None:
    """Raise on a Triton that cannot build the op; warn on one whose private API we have not inspected."""
    if not HAS_GLUON or TRITON_VERSION[:2] < (3, 6):
        raise RuntimeError(f"mma_scaled_sm120 needs Triton >= 3.6 with Gluon (the native sm_120 lowering of "
                           f"NVFP4 dot_scaled appeared in 3.6); found {'.'.join(map(str, TRITON_VERSION))}")
    from triton.language.semantic import TritonSemantic

    if not hasattr(TritonSemantic, "dot_scaled"):
        raise RuntimeError("mma_scaled_sm120: this Triton has no TritonSemantic.dot_scaled (private API moved)")
    if TRITON_VERSION[:2] not in TESTED_TRITON:
        warnings.warn(f"mma_scaled_sm120: Triton {'.'.join(map(str, TRITON_VERSION))} was not inspected; "
                      "re-run tests/kernels/test_gluon_mma_scaled.py before trusting it", stacklevel=2)


# Callable from host code and, at compile time, from Gluon kernels (layouts are built from constexpr arguments).
_constexpr_function = getattr(gluon, "constexpr_function", None) or (lambda fn: fn)


@_constexpr_function
def _log2(x: int) -> int:
    if x <= 0 or x & (x - 1):
        raise ValueError(f"expected a power of two, got {x}")
    return x.bit_length() - 1


@_constexpr_function
def sm120_scale_bases(op_idx: int, shape: tuple[int, int], mma_warps: tuple[int, int]) -> dict[str, list[list[int]]]:
    """Linear-layout bases of the e4m3 scale tensor ``[M or N, K/16]`` of operand ``op_idx`` (0: A, 1: B).

    Port of Triton's ``getSM120DotScaledScaleLayout`` + ``combineCtaCgaWithShape``: all K-groups of a row in
    registers; in a quad (the 4 lanes that share an MMA row) every lane holds the same scales; lane bits 2..4 walk
    rows 1, 2, 4; for A lane bit 0 is row + 8 (the MMA's second 8-row half), for B it is a broadcast.  A's scales
    are broadcast over the warps along N and B's over the warps along M.  Rows beyond one warp tile repeat in
    registers; bases that would leave the tensor become 0 (broadcast).
    """
    mn, kgroups = shape
    warps_m, warps_n = mma_warps
    reg = [[0, 1 << i] for i in range(_log2(kgroups))]
    if op_idx == 0:
        lane = [[8, 0], [0, 0], [1, 0], [2, 0], [4, 0]]
        rows = 16
        warp = [[0, 0]] * _log2(warps_n) + [[rows << i, 0] for i in range(_log2(warps_m))]
        rows *= warps_m
    else:
        lane = [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]]
        rows = 8
        warp = [[rows << i, 0] for i in range(_log2(warps_n))] + [[0, 0]] * _log2(warps_m)
        rows *= warps_n
    while rows < mn:
        reg.append([rows, 0])
        rows *= 2

    def fit(bases):
        return [[b[0] if b[0] < mn else 0, b[1] if b[1] < kgroups else 0] for b in bases]

    return {"register": fit(reg), "lane": fit(lane), "warp": fit(warp), "block": []}


@dataclass(frozen=True)
class ScaledLayouts:
    acc: object  # NVMMADistributedLayout v2, fp32 [BM, BN]
    a: object  # DotOperandLayout(0, kWidth 4): uint8 codes [BM, BK/2]
    b: object  # DotOperandLayout(1, kWidth 4): uint8 codes [BK/2, BN] (K-packed)
    a_scale: object  # DistributedLinearLayout: e4m3 [BM, BK/16]
    b_scale: object  # DistributedLinearLayout: e4m3 [BN, BK/16]


@_constexpr_function
def sm120_scaled_layouts(block_m: int, block_n: int, block_k: int, warps_per_cta: tuple[int, int]) -> ScaledLayouts:
    """The layouts Triton's sm_120 ``ScaledBlockedToMMA`` gives a ``[BM, BN, BK]`` NVFP4 dot with these MMA warps."""
    if block_k < MIN_K or block_k % MIN_K:
        raise ValueError(f"block_k: the sm_120 block-scaled MMA needs a multiple of {MIN_K}, got {block_k}")
    acc = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=list(warps_per_cta), instr_shape=[16, 8])

    def scale(op_idx, rows):
        bases = sm120_scale_bases(op_idx, (rows, block_k // 16), tuple(warps_per_cta))
        return gl.DistributedLinearLayout(reg_bases=bases["register"], lane_bases=bases["lane"],
                                          warp_bases=bases["warp"], block_bases=[], shape=[rows, block_k // 16])

    return ScaledLayouts(
        acc=acc,
        a=gl.DotOperandLayout(operand_index=0, parent=acc, k_width=4),
        b=gl.DotOperandLayout(operand_index=1, parent=acc, k_width=4),
        a_scale=scale(0, block_m),
        b_scale=scale(1, block_n),
    )


if HAS_GLUON:
    from triton.experimental.gluon.language._core import builtin

    @builtin
    def mma_scaled_sm120(a, a_scale, b, b_scale, acc, _semantic=None):
        """``acc + (a * a_scale) @ (b * b_scale)`` for NVFP4 (e2m1 codes, e4m3 scales per 16) on sm_120.

        ``a`` uint8 ``[BM, BK/2]`` and ``b`` uint8 ``[BK/2, BN]`` (element 2i in the low nibble) in the layouts of
        :func:`sm120_scaled_layouts`, scales ``float8e4nv`` ``[BM, BK/16]`` / ``[BN, BK/16]``.  NUMERICS UNVERIFIED
        on sm_120 (see the module docstring).
        """
        fmt = "e2m1"
        if DOT_SCALED_FORMAT_IS_CONSTEXPR:  # <= 3.7 reads lhs_format.value
            fmt = gl.constexpr(fmt)
        out = _semantic.dot_scaled(a, a_scale, fmt, b, b_scale, fmt, acc, fast_math=False,
                                   lhs_k_pack=True, rhs_k_pack=True, out_dtype=gl.float32)
        return gl.tensor(out.handle, acc.type)

    @gluon.constexpr_function
    def scaled_layout(which, block_m, block_n, block_k, warps_m, warps_n):
        """One field (``"acc"``, ``"a"``, ``"b"``, ``"a_scale"``, ``"b_scale"``) of ``sm120_scaled_layouts``, in a kernel."""
        return getattr(sm120_scaled_layouts(block_m, block_n, block_k, (warps_m, warps_n)), which)

    # For the sm_120 compile tests: C[BM, BN] = A[BM, K] @ W[BN, K]^T for one tile, fp32 out, operands loaded
    # from global memory straight into the MMA layouts (no shared memory: this is a probe, not a fast GEMM).
    MMA_SCALED_TILE_SIGNATURE = {
        "a_ptr": "*u8", "a_sf_ptr": "*u8", "w_ptr": "*u8", "w_sf_ptr": "*u8", "c_ptr": "*fp32",
        "stride_a": "i32", "stride_as": "i32", "stride_w": "i32", "stride_ws": "i32", "stride_c": "i32",
        "K": "constexpr", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr",
        "WARPS_M": "constexpr", "WARPS_N": "constexpr",
    }
    MMA_SCALED_TILE_DIVISIBLE = [k for k, v in MMA_SCALED_TILE_SIGNATURE.items() if v != "constexpr"]

    @gluon.jit
    def _mma_scaled_tile_kernel(
        a_ptr, a_sf_ptr, w_ptr, w_sf_ptr, c_ptr,
        stride_a, stride_as, stride_w, stride_ws, stride_c,
        K: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
        WARPS_M: gl.constexpr, WARPS_N: gl.constexpr,
    ):
        ACC: gl.constexpr = scaled_layout("acc", BM, BN, BK, WARPS_M, WARPS_N)
        LA: gl.constexpr = scaled_layout("a", BM, BN, BK, WARPS_M, WARPS_N)
        LB: gl.constexpr = scaled_layout("b", BM, BN, BK, WARPS_M, WARPS_N)
        LSA: gl.constexpr = scaled_layout("a_scale", BM, BN, BK, WARPS_M, WARPS_N)
        LSB: gl.constexpr = scaled_layout("b_scale", BM, BN, BK, WARPS_M, WARPS_N)
        ma = gl.arange(0, BM, layout=gl.SliceLayout(1, LA))
        ka = gl.arange(0, BK // 2, layout=gl.SliceLayout(0, LA))
        kb = gl.arange(0, BK // 2, layout=gl.SliceLayout(1, LB))
        nb = gl.arange(0, BN, layout=gl.SliceLayout(0, LB))
        msa = gl.arange(0, BM, layout=gl.SliceLayout(1, LSA))
        ksa = gl.arange(0, BK // 16, layout=gl.SliceLayout(0, LSA))
        nsb = gl.arange(0, BN, layout=gl.SliceLayout(1, LSB))
        ksb = gl.arange(0, BK // 16, layout=gl.SliceLayout(0, LSB))
        acc = gl.zeros([BM, BN], gl.float32, ACC)
        for k0 in gl.static_range(0, K, BK):
            a = gl.load(a_ptr + ma[:, None] * stride_a + (k0 // 2 + ka[None, :]))
            b = gl.load(w_ptr + nb[None, :] * stride_w + (k0 // 2 + kb[:, None]))  # [BK/2, BN]: W viewed K-major
            sa = gl.load(a_sf_ptr + msa[:, None] * stride_as + (k0 // 16 + ksa[None, :]))
            sb = gl.load(w_sf_ptr + nsb[:, None] * stride_ws + (k0 // 16 + ksb[None, :]))
            acc = mma_scaled_sm120(a, sa.to(gl.float8e4nv, bitcast=True), b, sb.to(gl.float8e4nv, bitcast=True),
                                   acc)
        mc = gl.arange(0, BM, layout=gl.SliceLayout(1, ACC))
        nc = gl.arange(0, BN, layout=gl.SliceLayout(0, ACC))
        gl.store(c_ptr + mc[:, None] * stride_c + nc[None, :], acc)
else:  # pragma: no cover
    mma_scaled_sm120 = None
