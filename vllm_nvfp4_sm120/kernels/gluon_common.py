"""What the Gluon kernels share: the e2m1 decode (inline PTX), MoE tile coordinates, the weight-codes TMA
descriptor, the grid, and the MoE down-GEMM epilogue.

e2m1 decode (``DECODE`` constexpr of the Gluon kernels): ``DECODE_CVT`` is the native ``cvt.rn.{f16,bf16}x2.e2m1x2``
(sm_100a/sm_120a; the bf16 form needs PTX ISA 9.2, i.e. Triton >= 3.8); ``DECODE_PORTABLE`` is an exact lop3/prmt
table that runs on any sm_80+ (the H200 tests use it).  Both give, per code byte, one 32-bit register holding two
16-bit floats (low half = low nibble = even k); the asm strings are :data:`E2M1_ASM`, checked bit-exactly on CPU
by a PTX model in ``tests/kernels/test_gluon_gemv.py``.
"""

from __future__ import annotations

import torch

from .gluon_compat import HAS_GLUON, gl, gluon, ptx_isa_version

# ---------------------------------------------------------------------------------------------------------------
# e2m1 decode: inline PTX, 4 code bytes in ($4) -> 4 registers out ($0..$3), output i = byte i as a 16-bit pair.
# ---------------------------------------------------------------------------------------------------------------
DECODE_CVT = 0  # native cvt (sm_100a / sm_120a)
DECODE_PORTABLE = 1  # lop3/prmt table, any sm_80+

_CVT_TEMPLATE = (
    "{ .reg .b8 b<4>; mov.b32 {b0, b1, b2, b3}, $4; "
    "cvt.rn.%s.e2m1x2 $0, b0; cvt.rn.%s.e2m1x2 $1, b1; cvt.rn.%s.e2m1x2 $2, b2; cvt.rn.%s.e2m1x2 $3, b3; }"
)
# prmt(a, b, sel) picks byte sel_nibble from the 8 bytes {b:a}; a code's low 3 bits index the magnitude table,
# (code >> 3) indexes {0x00, 0x80} for the sign byte (the trick of Triton's own FP4ToBP16 lowering).
E2M1_ASM = {
    ("cvt", "f16"): _CVT_TEMPLATE % (("f16x2",) * 4),
    ("cvt", "bf16"): _CVT_TEMPLATE % (("bf16x2",) * 4),
    # fp16 |e2m1| = 0, .5, 1, 1.5, 2, 3, 4, 6 has a zero low byte; high bytes 00 38 3C 3E 40 42 44 46.
    ("portable", "f16"): (
        "{ .reg .b32 a<11>; "
        "and.b32 a0, $4, 0x88888888; shr.u32 a1, a0, 3; shr.u32 a2, a0, 19; "
        "and.b32 a3, $4, 0x77777777; shr.u32 a4, a3, 16; "
        "prmt.b32 a5, 0x3E3C3800, 0x46444240, a3; prmt.b32 a6, 0x3E3C3800, 0x46444240, a4; "
        "prmt.b32 a7, 0x8000, 0, a1; prmt.b32 a8, 0x8000, 0, a2; "
        "or.b32 a9, a5, a7; or.b32 a10, a6, a8; "
        "prmt.b32 $0, a9, 0, 0x1404; prmt.b32 $1, a9, 0, 0x3424; "
        "prmt.b32 $2, a10, 0, 0x1404; prmt.b32 $3, a10, 0, 0x3424; }"
    ),
    # Triton's own bf16 table (Fp4ToFpOpToLLVM), bit-exact on the H200 for all 256 bytes.
    ("portable", "bf16"): (
        "{ .reg .b32 a<13>; "
        "and.b32 a0, $4, 0x88888888; shr.u32 a1, a0, 3; and.b32 a2, $4, 0x77777777; shr.u32 a3, a2, 16; "
        "shr.u32 a4, a0, 19; "
        "prmt.b32 a5, 0xC0800000, 0xC0804000, a2; prmt.b32 a6, 0xC0800000, 0xC0804000, a3; "
        "prmt.b32 a7, 0x3F3F3F00, 0x40404040, a2; prmt.b32 a8, 0x3F3F3F00, 0x40404040, a3; "
        "prmt.b32 a9, 0x8000, 0, a1; prmt.b32 a10, 0x8000, 0, a4; "
        "or.b32 a11, a7, a9; or.b32 a12, a8, a10; "
        "prmt.b32 $0, a5, a11, 0x5140; prmt.b32 $1, a5, a11, 0x7362; "
        "prmt.b32 $2, a6, a12, 0x5140; prmt.b32 $3, a6, a12, 0x7362; }"
    ),
}
E2M1_ASM_CONSTRAINTS = "=r,=r,=r,=r,r"
# Gluon reads asm strings only from constexpr globals.
_ASM_CVT_F16 = gl.constexpr(E2M1_ASM[("cvt", "f16")]) if HAS_GLUON else None
_ASM_CVT_BF16 = gl.constexpr(E2M1_ASM[("cvt", "bf16")]) if HAS_GLUON else None
_ASM_PORTABLE_F16 = gl.constexpr(E2M1_ASM[("portable", "f16")]) if HAS_GLUON else None
_ASM_PORTABLE_BF16 = gl.constexpr(E2M1_ASM[("portable", "bf16")]) if HAS_GLUON else None
_ASM_CONSTRAINTS = gl.constexpr(E2M1_ASM_CONSTRAINTS) if HAS_GLUON else None


def decode_for(cc_major: int, dtype: torch.dtype, ptx_isa: int) -> int:
    """The native cvt where the GPU has it (sm_100+, incl. sm_120) *and* the PTX ISA Triton will emit accepts it
    (bf16 needs 9.2, fp16 8.7), else the portable table.  The ISA follows the ptxas Triton uses, which an
    import can change: FlashInfer points ``TRITON_PTXAS_BLACKWELL_PATH`` at a system CUDA >= 13 ptxas, and CUDA
    13.0's emits PTX 9.0, which rejects the bf16 cvt."""
    needed = 92 if dtype == torch.bfloat16 else 87
    return DECODE_CVT if cc_major >= 10 and ptx_isa >= needed else DECODE_PORTABLE


def default_decode(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> int:
    """:func:`decode_for` the GPU of ``device`` and the ptxas Triton would use for it."""
    major = torch.cuda.get_device_capability(device)[0]
    return decode_for(major, dtype, ptx_isa_version(major * 10) if major >= 10 else 0)


# ---------------------------------------------------------------------------------------------------------------
# Host side of the Gluon MoE GEMMs: the weight-codes TMA descriptor, the compile signature pieces, the grid
# ---------------------------------------------------------------------------------------------------------------
def codes_smem_layout_args(block_k: int) -> dict:
    """NVMMASharedLayout of a codes slot ``[BLOCK_N, BLOCK_K/2]`` u8 (TMA's destination): swizzle = row bytes."""
    return dict(swizzle_byte_width=min(128, block_k // 2), element_bitwidth=8, rank=2)


def codes_desc_type(block_n: int, block_k: int) -> str:
    """The compile-harness type of the weight-codes TMA descriptor (both Gluon MoE kernels)."""
    lay = ", ".join(f"{k}={v}" for k, v in codes_smem_layout_args(block_k).items())
    return f"tensordesc<u8[{block_n},{block_k // 2}],NVMMASharedLayout({lay})>"


def divisible_args(names: list[str], use_tma: bool) -> list[str]:
    """``names`` without the weight descriptor when it is a TMA descriptor (not a pointer to mark divisible)."""
    return [d for d in names if not (use_tma and d == "w_desc")]


def weight_desc(codes, use_tma: bool, block_n: int, block_k: int):
    """The gluon TMA descriptor over the codes' [E * rows, K/2] view, or the codes themselves (unused)."""
    if not use_tma:
        return codes
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    e, n, kh = codes.shape
    if not codes.is_contiguous() or (2 * kh) % block_k or codes.data_ptr() % 16:
        raise ValueError(f"use_tma: the weight codes must be contiguous, 16-byte aligned, with K % block_k == 0; "
                         f"got shape {list(codes.shape)} strides {codes.stride()} block_k {block_k}")
    layout = gl.NVMMASharedLayout(**codes_smem_layout_args(block_k))
    return TensorDescriptor.from_tensor(codes.view(e * n, kh), [block_n, block_k // 2], layout)


def moe_grid(max_blocks: int, num_n: int, persistent: bool, device) -> tuple[int]:
    """One program per tile of the worst-case grid, or (``persistent``) one per SM, at most one per tile."""
    tiles = max_blocks * num_n
    if not persistent:
        return (tiles,)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return (max(1, min(sms, tiles)),)


# ---------------------------------------------------------------------------------------------------------------
# Device side
# ---------------------------------------------------------------------------------------------------------------
if HAS_GLUON:

    @gluon.jit
    def e2m1_pairs(codes, DECODE: gl.constexpr, F16: gl.constexpr):
        """uint8 codes -> int32 of the same shape and layout: two 16-bit floats per byte, low half = low nibble."""
        if DECODE == 0:
            if F16:
                pairs = gl.inline_asm_elementwise(_ASM_CVT_F16, _ASM_CONSTRAINTS, [codes], gl.int32, True, 4)
            else:
                pairs = gl.inline_asm_elementwise(_ASM_CVT_BF16, _ASM_CONSTRAINTS, [codes], gl.int32, True, 4)
        else:
            if F16:
                pairs = gl.inline_asm_elementwise(_ASM_PORTABLE_F16, _ASM_CONSTRAINTS, [codes], gl.int32, True, 4)
            else:
                pairs = gl.inline_asm_elementwise(_ASM_PORTABLE_BF16, _ASM_CONSTRAINTS, [codes], gl.int32, True, 4)
        return pairs

    @gluon.jit
    def split_pairs(pairs, dtype: gl.constexpr):
        """int32 pairs -> (low-nibble values, high-nibble values) as ``dtype`` (fp16 or bf16)."""
        lo = pairs.to(gl.int16).to(dtype, bitcast=True)
        hi = (pairs >> 16).to(gl.int16).to(dtype, bitcast=True)
        return lo, hi

    @gluon.jit
    def decode_tile(codes, scales, DECODE: gl.constexpr, F16: gl.constexpr, DT: gl.constexpr,
                    BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
        """codes [BLOCK_N, G, 8] u8 + scales [BLOCK_N, G] → weights [BLOCK_N, BLOCK_K] (exact: e2m1 × e4m3)."""
        lo, hi = split_pairs(e2m1_pairs(codes, DECODE, F16), DT)
        s16 = scales[:, :, None]
        return gl.join(lo * s16, hi * s16).reshape([BLOCK_N, BLOCK_K])  # element 2b + h: memory order of k

    @gluon.jit
    def tile_coords(tile, max_blocks, num_n, PERSISTENT: gl.constexpr, GROUP_M: gl.constexpr):
        """Tile index → (row block, column tile).  Persistent: row-major (the live tiles are a prefix)."""
        if PERSISTENT:
            pid_m = tile // num_n
            pid_n = tile % num_n
        else:  # GROUP_M row blocks share a column tile while it is in L2 (moe_align.moe_block_coords)
            group = tile // (GROUP_M * num_n)
            first = group * GROUP_M
            rows_in_group = gl.minimum(max_blocks - first, GROUP_M)
            pid_m = first + (tile % (GROUP_M * num_n)) % rows_in_group
            pid_n = (tile % (GROUP_M * num_n)) // rows_in_group
        return pid_m, pid_n

    @gluon.jit
    def tile_range(num_padded_ptr, max_blocks, num_n, BLOCK_M: gl.constexpr, PERSISTENT: gl.constexpr):
        """(first tile, end, step) of this program: every partition walks the same sequence."""
        if PERSISTENT:
            end = (gl.load(num_padded_ptr) // BLOCK_M) * num_n
        else:
            end = max_blocks * num_n
        return gl.program_id(0), end, gl.num_programs(0)

    @gluon.jit
    def down_epilogue(acc, alpha, topk_w_ptr, out_ptr, sorted_ids_ptr, pid_m, pid_n, R, N, top_k, stride_om,
                      DETERMINISTIC: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """``routing weight x alpha x acc`` of one down-GEMM tile, in ``acc``'s layout → fp32 atomics into
        ``[T, H]``, or the route's own row of ``[R, H]`` (deterministic)."""
        L: gl.constexpr = acc.type.layout
        route = gl.load(sorted_ids_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L)))
        row_ok = route < R
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, L))
        mask = row_ok[:, None] & (cols < N)[None, :]
        weight = gl.load(topk_w_ptr + route, mask=row_ok, other=0.0)
        y = (acc * alpha) * weight[:, None]
        if DETERMINISTIC:
            gl.store(out_ptr + route[:, None].to(gl.int64) * stride_om + cols[None, :], y, mask=mask)
        else:
            ptrs = out_ptr + (route // top_k)[:, None].to(gl.int64) * stride_om + cols[None, :]
            gl.atomic_add(ptrs, y, mask=mask, sem="relaxed")
