"""Warp-specialized Gluon W4A16 MoE GEMM (prefill): one source for the gate_up and the down GEMM on sm_120.

Rows come from :func:`.moe_align.moe_align` (one expert per ``BLOCK_M``-row block), weights are the checkpoint's
(codes ``[E, rows, K/2]`` u8, e4m3 scales ``[E, rows, K/16]``), exactly as the Triton kernels in
:mod:`.moe_w4a16` read them; the launchers take the same arguments, so routing is a one-line switch.

Three partitions, connected by mbarrier rings of ``STAGES`` slots (one slot = one ``BLOCK_K`` step):

  loader  (1 warp, few registers)   weight codes ``[BLOCK_N, BLOCK_K/2]`` (gate and up tiles for gate_up) into
                                    shared memory: TMA when ``USE_TMA`` (K % BLOCK_K == 0, contiguous codes), else
                                    masked pointer loads + ``smem.store``.                  codes_ready → decode
  decode  (4 warps)                 codes → e2m1 × e4m3 → bf16/fp16 ``[BLOCK_N, BLOCK_K]`` into shared memory
                                    (``DECODE``: the native cvt on sm_100+/sm_120, the exact lop3/prmt table on
                                    sm_90; :data:`.gluon_common.E2M1_ASM`).  codes_empty → loader, b_ready → mma
  mma     (default, ``num_warps``)  activations gathered by route straight into the ``mma_v2`` operand layout,
                                    B by ``ldmatrix`` from the decoded slot, fp32 accumulation; the epilogue
                                    (gate_up: decode global + gated activation → 16-bit intermediate ``[R, I]``;
                                    down: decode global × routing weight → fp32 atomics into ``[T, H]`` or the
                                    deterministic per-route buffer ``[R, H]``).                b_empty → decode

Every arrive that publishes or releases a slot written/read by several threads follows a ``gl.barrier()`` (a
partition-local named barrier): the arrive itself is issued by one thread.  Producers wait on the "empty"
barriers with the inverted phase, so the first lap passes without a consumer.

``PERSISTENT``: ``min(#SMs, tiles)`` programs walk the live tiles (row-major: row block, then column tile), the
rings running on across tiles, so the loader and the decode warps fetch and decode the next tile while the mma
warps run the epilogue; meant for BLOCK_M 64 with ``STAGES = 3``.  Otherwise one program per tile of the
worst-case grid (``GROUP_M`` row blocks share a column tile), dead blocks (past ``num_padded``) do nothing.

Register budget (``setmaxnreg``): the loader gives registers back (``LOADER_REGS``; ``LOADER_REGS_PTR`` for
pointer loads), the decode warps keep a moderate budget (``DECODE_REGS``); the mma warps get the rest.  BLOCK_K is
64 (the tile compile-checked for sm_120).
"""

from __future__ import annotations

import triton

from .common import SM120_MAX_SMEM_BYTES
from .gluon_common import codes_desc_type, default_decode, divisible_args, moe_grid, weight_desc
from .gluon_compat import HAS_GLUON, ampere, gl, gluon, hopper, mbarrier_expect, require_gluon, tma_async_load
from .moe_align import MoeAlignment
from .moe_common import ALIGN_SIGNATURE, check_w4a16_down_inputs, check_w4a16_gate_up_inputs, gated_activation_f32

LOADER_WARPS = 1
DECODE_WARPS = 4
LOADER_REGS = 40  # TMA: a few scalars
LOADER_REGS_PTR = 88  # pointer loads: a [BLOCK_N, BLOCK_K/2] code tile and its addresses in one warp
DECODE_REGS = 128

# The sm_120 compile harness: argument types as the launchers pass them (bf16 activations).
GLUON_MOE_W4A16_SIGNATURE = {
    "x_ptr": "*bf16", "w_ptr": "*u8", "w_desc": "*u8", "w_sf_ptr": "*u8", "w_dec_ptr": "*fp32",
    "topk_w_ptr": "*fp32", "out_ptr": "*bf16", **ALIGN_SIGNATURE,
    "R": "i32", "N": "i32", "K": "i32", "top_k": "i32", "max_blocks": "i32",
    "stride_xm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_wse": "i32", "stride_wsn": "i32",
    "stride_om": "i32",
    "GATED": "constexpr", "ACTIVATION": "constexpr", "DETERMINISTIC": "constexpr", "USE_TMA": "constexpr",
    "DECODE": "constexpr", "PERSISTENT": "constexpr", "STAGES": "constexpr", "BLOCK_M": "constexpr",
    "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "MMA_WARPS_M": "constexpr",
}
GLUON_MOE_W4A16_DIVISIBLE = [k for k, v in GLUON_MOE_W4A16_SIGNATURE.items() if v.startswith("*")] + [
    "N", "K", "stride_xm", "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_om"]


def signature(gated: bool, use_tma: bool, block_n: int, block_k: int, dtype: str = "bf16") -> dict:
    """The kernel signature for one launch configuration (gate_up: 16-bit output; down: fp32 output)."""
    sig = dict(GLUON_MOE_W4A16_SIGNATURE)
    sig["x_ptr"] = f"*{dtype}"
    sig["out_ptr"] = f"*{dtype}" if gated else "*fp32"
    if use_tma:
        sig["w_desc"] = codes_desc_type(block_n, block_k)
    return sig


def divisible(use_tma: bool) -> list[str]:
    return divisible_args(GLUON_MOE_W4A16_DIVISIBLE, use_tma)


def smem_bytes(gated: bool, block_n: int, block_k: int, stages: int) -> int:
    """Shared memory of the rings (codes + decoded 16-bit weights), without Triton's scratch and barriers."""
    nb = 2 if gated else 1
    return stages * nb * block_n * (block_k // 2 + 2 * block_k)


if HAS_GLUON:
    from .gluon_common import decode_tile, down_epilogue, tile_coords, tile_range

    # ---- loader: weight codes into the codes ring ----------------------------------------------------------
    @gluon.jit
    def _loader_partition(
        w_ptr, w_desc, codes_smem, codes_ready, codes_empty, expert_ids_ptr, num_padded_ptr,
        N, K, max_blocks, stride_we, stride_wn,
        GATED: gl.constexpr, USE_TMA: gl.constexpr, PERSISTENT: gl.constexpr, STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    ):
        NB: gl.constexpr = 2 if GATED else 1
        KB: gl.constexpr = BLOCK_K // 2
        # One warp: each lane a 16-byte (or narrower) row segment.
        CL: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // KB, KB // 16], [1, 1], [1, 0])
        num_n = gl.cdiv(N, BLOCK_N)
        num_padded = gl.load(num_padded_ptr)
        first, end, step = tile_range(num_padded_ptr, max_blocks, num_n, BLOCK_M, PERSISTENT)
        it = 0
        for tile in range(first, end, step):
            pid_m, pid_n = tile_coords(tile, max_blocks, num_n, PERSISTENT, GROUP_M)
            if pid_m * BLOCK_M < num_padded:
                e = gl.load(expert_ids_ptr + pid_m)
                n0 = pid_n * BLOCK_N
                for k0 in range(0, K, BLOCK_K):
                    s = it % STAGES
                    gl.static_assert(STAGES >= 2)
                    mbarrier_wait_phase(codes_empty.index(s), ((it // STAGES) & 1) ^ 1)
                    if USE_TMA:
                        mbarrier_expect(codes_ready.index(s), NB * BLOCK_N * KB)
                        for j in gl.static_range(NB):
                            tma_async_load(w_desc, [e * (NB * N) + j * N + n0, k0 // 2], codes_ready.index(s),
                                           codes_smem.index(s * NB + j))
                    else:
                        rows = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CL))
                        cols = k0 // 2 + gl.arange(0, KB, layout=gl.SliceLayout(0, CL))
                        mask = (rows < N)[:, None] & (cols < K // 2)[None, :]
                        base = (w_ptr + e.to(gl.int64) * stride_we + rows[:, None].to(gl.int64) * stride_wn
                                + cols[None, :])
                        for j in gl.static_range(NB):
                            codes = gl.load(base + j * N * stride_wn, mask=mask, other=0)
                            codes_smem.index(s * NB + j).store(codes)
                        gl.barrier()
                        ampere.mbarrier.arrive(codes_ready.index(s))
                    it += 1

    @gluon.jit
    def mbarrier_wait_phase(bar, phase):
        ampere.mbarrier.wait(bar, phase)

    # ---- decode: codes ring → 16-bit weights ring -------------------------------------------------------------
    @gluon.jit
    def _decode_partition(
        w_sf_ptr, codes_smem, b_smem, codes_ready, codes_empty, b_ready, b_empty, expert_ids_ptr, num_padded_ptr,
        N, K, max_blocks, stride_wse, stride_wsn,
        GATED: gl.constexpr, DECODE: gl.constexpr, DT: gl.constexpr, PERSISTENT: gl.constexpr,
        STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
        GROUP_M: gl.constexpr, WARPS: gl.constexpr,
    ):
        NB: gl.constexpr = 2 if GATED else 1
        G: gl.constexpr = BLOCK_K // 16
        # Codes [BLOCK_N, G, 8 bytes]: a lane holds 4 bytes (one inline-asm call) of one 16-element group.
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32 // (2 * G), G, 2], [WARPS, 1, 1], [2, 1, 0])
        S2: gl.constexpr = gl.SliceLayout(2, L3)
        LC: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (2 * G), 2 * G], [WARPS, 1], [1, 0])
        F16: gl.constexpr = DT == gl.float16
        num_n = gl.cdiv(N, BLOCK_N)
        num_padded = gl.load(num_padded_ptr)
        first, end, step = tile_range(num_padded_ptr, max_blocks, num_n, BLOCK_M, PERSISTENT)
        it = 0
        for tile in range(first, end, step):
            pid_m, pid_n = tile_coords(tile, max_blocks, num_n, PERSISTENT, GROUP_M)
            if pid_m * BLOCK_M < num_padded:
                e = gl.load(expert_ids_ptr + pid_m).to(gl.int64)
                rows = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, S2))
                gs = gl.arange(0, G, layout=gl.SliceLayout(0, S2))
                n_ok = rows < N
                sf_base = w_sf_ptr + e * stride_wse + rows[:, None].to(gl.int64) * stride_wsn + gs[None, :]
                for k0 in range(0, K, BLOCK_K):
                    s = it % STAGES
                    phase = (it // STAGES) & 1
                    # Scales straight from global (tiny): zero past N and K, so garbage rows/columns of the
                    # codes slot (TMA rows of the next expert, zero fill) decode to exactly 0.
                    sf_mask = n_ok[:, None] & ((k0 // 16 + gs) < K // 16)[None, :]
                    sc0 = gl.load(sf_base + k0 // 16, mask=sf_mask, other=0).to(gl.float8e4nv, bitcast=True).to(DT)
                    if GATED:
                        sc1 = gl.load(sf_base + N * stride_wsn + k0 // 16, mask=sf_mask, other=0)
                        sc1 = sc1.to(gl.float8e4nv, bitcast=True).to(DT)
                    mbarrier_wait_phase(codes_ready.index(s), phase)
                    c0 = gl.convert_layout(codes_smem.index(s * NB).load(LC).reshape([BLOCK_N, G, 8]), L3)
                    if GATED:
                        c1 = gl.convert_layout(codes_smem.index(s * NB + 1).load(LC).reshape([BLOCK_N, G, 8]), L3)
                    gl.barrier()
                    ampere.mbarrier.arrive(codes_empty.index(s))
                    w0 = decode_tile(c0, sc0, DECODE, F16, DT, BLOCK_N, BLOCK_K)
                    if GATED:
                        w1 = decode_tile(c1, sc1, DECODE, F16, DT, BLOCK_N, BLOCK_K)
                    mbarrier_wait_phase(b_empty.index(s), phase ^ 1)
                    b_smem.index(s * NB).store(w0)
                    if GATED:
                        b_smem.index(s * NB + 1).store(w1)
                    gl.barrier()
                    ampere.mbarrier.arrive(b_ready.index(s))
                    it += 1

    # ---- mma + epilogue (default partition) ----------------------------------------------------------------
    @gluon.jit
    def _mma_partition(
        x_ptr, w_dec_ptr, topk_w_ptr, out_ptr, b_smem, b_ready, b_empty,
        sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
        R, N, K, top_k, max_blocks, stride_xm, stride_om,
        GATED: gl.constexpr, ACTIVATION: gl.constexpr, DETERMINISTIC: gl.constexpr, PERSISTENT: gl.constexpr,
        STAGES: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
        GROUP_M: gl.constexpr, MMA_WARPS_M: gl.constexpr, WARPS: gl.constexpr,
    ):
        NB: gl.constexpr = 2 if GATED else 1
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[MMA_WARPS_M, WARPS // MMA_WARPS_M],
                                                      instr_shape=[16, 8])
        A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8)
        num_n = gl.cdiv(N, BLOCK_N)
        num_padded = gl.load(num_padded_ptr)
        first, end, step = tile_range(num_padded_ptr, max_blocks, num_n, BLOCK_M, PERSISTENT)
        it = 0
        for tile in range(first, end, step):
            pid_m, pid_n = tile_coords(tile, max_blocks, num_n, PERSISTENT, GROUP_M)
            if pid_m * BLOCK_M < num_padded:
                # Activation rows: the token (gate_up reads x [T, H]) or the route (down reads inter [R, I]).
                ra = gl.load(sorted_ids_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, A_OP)))
                ra_ok = ra < R
                xrow = ra // top_k if GATED else ra
                ka = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, A_OP))
                a_base = x_ptr + xrow[:, None].to(gl.int64) * stride_xm + ka[None, :]
                acc0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
                acc1 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
                for k0 in range(0, K, BLOCK_K):
                    s = it % STAGES
                    # The gather is issued before the wait: its latency hides behind the decode of this slot.
                    a = gl.load(a_base + k0, mask=ra_ok[:, None] & ((k0 + ka) < K)[None, :], other=0.0)
                    mbarrier_wait_phase(b_ready.index(s), (it // STAGES) & 1)
                    b0 = b_smem.index(s * NB).permute((1, 0)).load(B_OP)
                    if GATED:
                        b1 = b_smem.index(s * NB + 1).permute((1, 0)).load(B_OP)
                    gl.barrier()
                    ampere.mbarrier.arrive(b_empty.index(s))
                    acc0 = ampere.mma_v2(a, b0, acc0)
                    if GATED:
                        acc1 = ampere.mma_v2(a, b1, acc1)
                    it += 1

                dec = gl.load(w_dec_ptr + gl.load(expert_ids_ptr + pid_m))
                if GATED:
                    route = gl.load(sorted_ids_ptr + pid_m * BLOCK_M
                                    + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA)))
                    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, MMA))
                    mask = (route < R)[:, None] & (cols < N)[None, :]
                    inter = gated_activation_f32(acc0 * dec, acc1 * dec, ACTIVATION)
                    ptrs = out_ptr + route[:, None].to(gl.int64) * stride_om + cols[None, :]
                    gl.store(ptrs, inter.to(out_ptr.dtype.element_ty), mask=mask)
                else:
                    down_epilogue(acc0, dec, topk_w_ptr, out_ptr, sorted_ids_ptr, pid_m, pid_n, R, N, top_k,
                                  stride_om, DETERMINISTIC, BLOCK_M, BLOCK_N)

    @gluon.jit(do_not_specialize=["R", "max_blocks"])  # token counts vary per call
    def _gluon_moe_w4a16_kernel(
        x_ptr, w_ptr, w_desc, w_sf_ptr, w_dec_ptr, topk_w_ptr, out_ptr,
        sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
        R, N, K, top_k, max_blocks,
        stride_xm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
        GATED: gl.constexpr, ACTIVATION: gl.constexpr, DETERMINISTIC: gl.constexpr, USE_TMA: gl.constexpr,
        DECODE: gl.constexpr, PERSISTENT: gl.constexpr, STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
        MMA_WARPS_M: gl.constexpr,
    ):
        NB: gl.constexpr = 2 if GATED else 1
        DT: gl.constexpr = x_ptr.dtype.element_ty
        CODES_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_K // 2 if BLOCK_K // 2 < 128 else 128,
                                                     element_bitwidth=8, rank=2)
        B_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        codes_smem = gl.allocate_shared_memory(gl.uint8, [STAGES * NB, BLOCK_N, BLOCK_K // 2], CODES_L)
        b_smem = gl.allocate_shared_memory(DT, [STAGES * NB, BLOCK_N, BLOCK_K], B_L)
        codes_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], ampere.mbarrier.MBarrierLayout())
        codes_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], ampere.mbarrier.MBarrierLayout())
        b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], ampere.mbarrier.MBarrierLayout())
        b_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], ampere.mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            ampere.mbarrier.init(codes_ready.index(s), count=1)
            ampere.mbarrier.init(codes_empty.index(s), count=1)
            ampere.mbarrier.init(b_ready.index(s), count=1)
            ampere.mbarrier.init(b_empty.index(s), count=1)
        hopper.fence_async_shared()  # the barrier inits must be visible to the TMA unit
        LOADER_R: gl.constexpr = LOADER_REGS_C if USE_TMA else LOADER_REGS_PTR_C

        gl.warp_specialize([
            (_mma_partition, (x_ptr, w_dec_ptr, topk_w_ptr, out_ptr, b_smem, b_ready, b_empty,
                              sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                              R, N, K, top_k, max_blocks, stride_xm, stride_om,
                              GATED, ACTIVATION, DETERMINISTIC, PERSISTENT, STAGES, BLOCK_M, BLOCK_N, BLOCK_K,
                              GROUP_M, MMA_WARPS_M, gl.num_warps())),
            (_loader_partition, (w_ptr, w_desc, codes_smem, codes_ready, codes_empty, expert_ids_ptr, num_padded_ptr,
                                 N, K, max_blocks, stride_we, stride_wn,
                                 GATED, USE_TMA, PERSISTENT, STAGES, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)),
            (_decode_partition, (w_sf_ptr, codes_smem, b_smem, codes_ready, codes_empty, b_ready, b_empty,
                                 expert_ids_ptr, num_padded_ptr, N, K, max_blocks, stride_wse, stride_wsn,
                                 GATED, DECODE, DT, PERSISTENT, STAGES, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                 DECODE_WARPS_C)),
        ], [LOADER_WARPS_C, DECODE_WARPS_C], [LOADER_R, DECODE_REGS_C])

    LOADER_WARPS_C = gl.constexpr(LOADER_WARPS)
    DECODE_WARPS_C = gl.constexpr(DECODE_WARPS)
    LOADER_REGS_C = gl.constexpr(LOADER_REGS)
    LOADER_REGS_PTR_C = gl.constexpr(LOADER_REGS_PTR)
    DECODE_REGS_C = gl.constexpr(DECODE_REGS)


# ---------------------------------------------------------------------------------------------------------------
# Launchers: the arguments of moe_w4a16.moe_w4a16_gate_up / moe_w4a16_down, plus ``persistent`` and ``decode``.
# ---------------------------------------------------------------------------------------------------------------
def _check_tile(gated: bool, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int):
    if block_k != 64:  # the only BLOCK_K compile-checked for sm_120 (one 128-byte swizzled row per decoded slot)
        raise ValueError(f"block_k: the Gluon W4A16 MoE GEMM takes 64, got {block_k}")
    if block_n % 16 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n: expected a power of two >= 16, got {block_n}")
    if num_warps not in (4, 8) or block_m < 16 * (num_warps // 2):
        raise ValueError(f"num_warps: expected 4 or 8 mma warps with block_m >= 16 * num_warps / 2, got "
                         f"{num_warps} for block_m {block_m}")
    if num_stages < 2:
        raise ValueError(f"num_stages: the mbarrier ring needs >= 2 slots, got {num_stages}")
    need = smem_bytes(gated, block_n, block_k, num_stages)
    if need > SM120_MAX_SMEM_BYTES - 4096:  # room for barriers and the epilogue's layout-conversion scratch
        raise ValueError(f"tile: {num_stages} stages of [{block_n}, {block_k}] need {need} B of shared memory "
                         f"(sm_120 has {SM120_MAX_SMEM_BYTES} B per block); use fewer stages or a smaller block_k")


def _launch(x, codes, w_sf, dec, topk_w, out, align, n, k, stride_we, stride_wn, *, gated, activation,
            deterministic, block_n, block_k, group_m, num_warps, num_stages, use_tma, persistent, decode):
    _check_tile(gated, align.block_m, block_n, block_k, num_warps, num_stages)
    run = _prepare(n, k, align.max_blocks, align.block_m, x.device, x.dtype, gated=gated, activation=activation,
                   deterministic=deterministic, block_n=block_n, block_k=block_k, group_m=group_m,
                   num_warps=num_warps, num_stages=num_stages, use_tma=use_tma, persistent=persistent, decode=decode)
    run(x, codes, w_sf, dec, topk_w, out, align, stride_we, stride_wn)


def _prepare(n, k, max_blocks, block_m, device, dtype, *, gated, activation, deterministic, block_n, block_k,
             group_m, num_warps, num_stages, use_tma, persistent, decode):
    """The ready launch of :func:`_launch` (its tile checked already): ``run(x, codes, w_sf, dec, topk_w, out,
    align, stride_we, stride_wn)``."""
    from .launch import ReadyKernel

    launch = ReadyKernel(
        _gluon_moe_w4a16_kernel, moe_grid(max_blocks, triton.cdiv(n, block_n), persistent, device),
        GATED=gated, ACTIVATION=activation, DETERMINISTIC=deterministic, USE_TMA=use_tma,
        DECODE=default_decode(device, dtype) if decode is None else decode, PERSISTENT=persistent,
        STAGES=num_stages, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        MMA_WARPS_M=num_warps // 2, num_warps=num_warps,
    )

    def run(x, codes, w_sf, dec, topk_w, out, align, stride_we, stride_wn):
        launch(x, codes, weight_desc(codes, use_tma, block_n, block_k), w_sf, dec, topk_w, out,
               align.sorted_ids, align.expert_ids, align.num_padded,
               align.num_routes, n, k, align.top_k, max_blocks,
               x.stride(0), stride_we, stride_wn, w_sf.stride(0), w_sf.stride(1), out.stride(0))

    return run


def gluon_moe_w4a16_gate_up(
    x, w13_codes, w13_scales, w13_dec, align: MoeAlignment, *,
    block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int, activation: str = "silu",
    use_tma: bool = False, fast_decode: bool = True, stream_weights: bool = False, persistent: bool = False,
    decode: int | None = None, out=None,
):
    """Gluon twin of :func:`.moe_w4a16.moe_w4a16_gate_up`: ``act(x @ w13[e, :I]^T) * (x @ w13[e, I:]^T)`` per
    route → intermediate ``[R, I]`` x.dtype.

    ``num_warps``: the mma warps (4 or 8; 1 loader + 4 decode warps come on top); ``num_stages``: ring slots;
    ``persistent``: one program per SM.  ``fast_decode``/``stream_weights`` are accepted for the Triton kwargs
    and ignored (Gluon always decodes with inline PTX; ``decode`` picks cvt vs the portable table, default by GPU).
    """
    require_gluon("gluon_moe_w4a16_gate_up")
    w_sf, h, i, r, out = check_w4a16_gate_up_inputs(x, w13_codes, w13_scales, w13_dec, align, activation, out)
    if r == 0:
        return out
    # The TMA view is [E * 2I, H/2]: gate rows at e*2I + n, up rows at e*2I + I + n (the kernel's NB * N rows).
    _launch(x, w13_codes, w_sf, w13_dec, w13_dec, out, align, i, h, w13_codes.stride(0), w13_codes.stride(1),
            gated=True, activation=activation, deterministic=False, block_n=block_n, block_k=block_k,
            group_m=group_m, num_warps=num_warps, num_stages=num_stages, use_tma=use_tma, persistent=persistent,
            decode=decode)
    return out


def gluon_moe_w4a16_down(
    inter, w2_codes, w2_scales, w2_dec, topk_weights, align: MoeAlignment, out, *,
    block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int, deterministic: bool = False,
    use_tma: bool = False, fast_decode: bool = True, stream_weights: bool = False, persistent: bool = False,
    decode: int | None = None,
):
    """Gluon twin of :func:`.moe_w4a16.moe_w4a16_down`: ``topk_weight * (inter[route] @ w2[e]^T)`` summed into
    the zeroed fp32 ``out`` ``[T, H]`` (atomics) or, ``deterministic``, the per-route ``[R, H]``."""
    require_gluon("gluon_moe_w4a16_down")
    w_sf, h, i, r = check_w4a16_down_inputs(inter, w2_codes, w2_scales, w2_dec, topk_weights, align, out,
                                            deterministic)
    if r == 0:
        return out
    _launch(inter, w2_codes, w_sf, w2_dec, topk_weights.contiguous(), out, align, h, i, w2_codes.stride(0),
            w2_codes.stride(1), gated=False, activation="silu", deterministic=deterministic, block_n=block_n,
            block_k=block_k, group_m=group_m, num_warps=num_warps, num_stages=num_stages, use_tma=use_tma,
            persistent=persistent, decode=decode)
    return out


# Ready launches with the Triton twins' call arguments (``moe_w4a16.prepare_moe_w4a16_gate_up`` / ``_down``), for
# the MoE flow's ready layer; the tile must have passed the launchers above once.

def prepare_gluon_moe_w4a16_gate_up(h: int, i: int, max_blocks: int, block_m: int, device, dtype, *, block_n: int,
                                    block_k: int, group_m: int, num_warps: int, num_stages: int, activation: str,
                                    use_tma: bool, persistent: bool, decode: int | None = None,
                                    fast_decode: bool = True, stream_weights: bool = False):
    """``run(x, w13_codes, w13_scales_u8, w13_dec, align, out) -> out`` (``fast_decode``, ``stream_weights``
    ignored, as by :func:`gluon_moe_w4a16_gate_up`)."""
    launch = _prepare(i, h, max_blocks, block_m, device, dtype, gated=True, activation=activation,
                      deterministic=False, block_n=block_n, block_k=block_k, group_m=group_m, num_warps=num_warps,
                      num_stages=num_stages, use_tma=use_tma, persistent=persistent, decode=decode)

    def run(x, w13_codes, w_sf, w13_dec, align, out):
        launch(x, w13_codes, w_sf, w13_dec, w13_dec, out, align, w13_codes.stride(0), w13_codes.stride(1))
        return out

    return run


def prepare_gluon_moe_w4a16_down(h: int, i: int, max_blocks: int, block_m: int, device, dtype, *, block_n: int,
                                 block_k: int, group_m: int, num_warps: int, num_stages: int, deterministic: bool,
                                 use_tma: bool, persistent: bool, decode: int | None = None,
                                 fast_decode: bool = True, stream_weights: bool = False):
    """``run(inter, w2_codes, w2_scales_u8, w2_dec, topk_weights, align, out) -> out`` (the fp32 sums)."""
    launch = _prepare(h, i, max_blocks, block_m, device, dtype, gated=False, activation="silu",
                      deterministic=deterministic, block_n=block_n, block_k=block_k, group_m=group_m,
                      num_warps=num_warps, num_stages=num_stages, use_tma=use_tma, persistent=persistent,
                      decode=decode)

    def run(inter, w2_codes, w_sf, w2_dec, topk_weights, align, out):
        launch(inter, w2_codes, w_sf, w2_dec, topk_weights.contiguous(), out, align, w2_codes.stride(0),
               w2_codes.stride(1))
        return out

    return run
