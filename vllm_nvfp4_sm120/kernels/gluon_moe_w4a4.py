"""Warp-specialized Gluon W4A4 MoE GEMMs for sm_120: FP4 x FP4 gate_up (NVFP4 intermediate out) and down.

The Gluon twins of :mod:`.moe_w4a4` (same arguments, same numerics): rows come from :func:`.moe_align.moe_align`,
the gate_up input is the layer input quantized once per token with ``a13_enc``
(:func:`.moe_w4a4.moe_quant_input`), weights are the checkpoint's codes ``[E, rows, K/2]`` + e4m3 scales
``[E, rows, K/16]``.  One kernel source serves both GEMMs (``GATED``); its pipeline is the skeleton of
:mod:`.gluon_moe_w4a16` with the decode partition gone (the MMA consumes FP4 directly):

  loader  (1 warp)                 one ring slot per ``BLOCK_K`` step: weight codes ``[BLOCK_N, BLOCK_K/2]`` (gate
                                   and up tiles for gate_up) by TMA when ``USE_TMA`` (K % BLOCK_K == 0, contiguous
                                   codes), else masked pointer loads; the weight scales, the activation codes and
                                   scales gathered by route (pointer loads: a gather has no TMA on sm_120), all
                                   into shared memory.                                        ready → mma
  mma     (default, ``num_warps``) operands from the slot in the layouts of
                                   :func:`.gluon_mma_scaled.sm120_scaled_layouts`,
                                   ``mma_scaled_sm120`` (``OMMA.SF...E2M1.E2M1.UE4M3.4X``), fp32 accumulation; the
                                   epilogue (gate_up: ``alpha = w13_dec[e] / a13_enc``, gated activation, NVFP4
                                   quantization with ``a2_enc`` by :func:`.act_quant.quantize_blocks_nvfp4` →
                                   codes ``[R, I/2]`` + scales ``[R, I/16]``; down: ``alpha = w2_dec[e] / a2_enc``,
                                   × routing weight → fp32 atomics into ``[T, H]`` or the deterministic per-route
                                   ``[R, H]``).                                                empty → loader
  epilogue (``EPILOGUE_WARPS``,    persistent down GEMM only (the dispatch uses it below I = 1024, where the K
            optional)              loop is a few steps and the epilogue's atomics are a large share of a tile):
                                   the mma warps park the fp32 accumulator in shared memory (acc_ready) and go on
                                   with the next tile; these warps load it, release the buffer (acc_empty), then
                                   apply alpha and the routing weight and issue the atomics.

``DECODE``: instead of the block-scaled MMA, the mma warps decode both operands exactly (e2m1 × e4m3 → bf16:
at most 6 significant bits, exact; the portable lop3/prmt table of :data:`.gluon_common.E2M1_ASM`) and run bf16
``mma_v2`` (products exact in fp32).  That is the path the H200 runs (the block-scaled MMA does not compile for
sm_90); it is an emulation, not representative for speed.

Every arrive that publishes or releases a slot follows a ``gl.barrier()``; producers wait on "empty" with the
inverted phase, so the first lap passes.  ``PERSISTENT``: ``min(#SMs, tiles)`` programs walk the live tiles, the
ring running on across tiles (the loader fetches the next tile during the epilogue).  Register budget
(``setmaxnreg``): the loader keeps ``LOADER_REGS``, the epilogue warps ``EPILOGUE_REGS``, the mma warps the rest.  BLOCK_K is 128 (two 64-element
block-scaled MMA steps per slot; rows of 64 code bytes).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .act_quant import quantize_blocks_nvfp4
from .common import SM120_MAX_SMEM_BYTES
from .gluon_common import DECODE_PORTABLE, codes_desc_type, divisible_args, moe_grid, weight_desc
from .gluon_compat import HAS_GLUON, ampere, gl, gluon, hopper, mbarrier_expect, require_gluon, tma_async_load
from .moe_align import MoeAlignment
from .moe_common import (
    ALIGN_SIGNATURE,
    check_enc,
    check_w4a4_down_inputs,
    check_w4a4_gate_up_inputs,
    gated_activation_f32,
)

LOADER_WARPS = 1
LOADER_REGS = 96  # the activation gather (always pointer loads) in 32-row chunks, plus a few scalars
LOADER_REGS_PTR = 112  # also the weight codes by pointer loads
EPILOGUE_WARPS = 4  # the persistent down GEMM's separate epilogue partition
EPILOGUE_REGS = 128  # a [64, 64] fp32 tile over 4 warps (32 values per thread) with its addresses
ROW_CHUNK = 32  # rows per pointer-load chunk in the loader: 2 KB of codes per warp-wide load

GLUON_MOE_W4A4_SIGNATURE = {
    "a_ptr": "*u8", "a_sf_ptr": "*u8", "w_ptr": "*u8", "w_desc": "*u8", "w_sf_ptr": "*u8", "w_dec_ptr": "*fp32",
    "a_enc_ptr": "*fp32", "q_enc_ptr": "*fp32", "topk_w_ptr": "*fp32", "out_ptr": "*u8", "out_sf_ptr": "*u8",
    **ALIGN_SIGNATURE,
    "R": "i32", "N": "i32", "K": "i32", "top_k": "i32", "max_blocks": "i32",
    "stride_am": "i32", "stride_asm": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_wse": "i32",
    "stride_wsn": "i32", "stride_om": "i32", "stride_osm": "i32",
    "GATED": "constexpr", "ACTIVATION": "constexpr", "DETERMINISTIC": "constexpr", "USE_TMA": "constexpr",
    "DECODE": "constexpr", "PERSISTENT": "constexpr", "EPILOGUE_WARPS": "constexpr", "STAGES": "constexpr",
    "BLOCK_M": "constexpr",
    "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "GROUP_M": "constexpr", "MMA_WARPS_M": "constexpr",
}
GLUON_MOE_W4A4_DIVISIBLE = [k for k, v in GLUON_MOE_W4A4_SIGNATURE.items() if v.startswith("*")] + [
    "N", "K", "stride_am", "stride_asm", "stride_we", "stride_wn", "stride_wse", "stride_wsn", "stride_om",
    "stride_osm"]


def signature(gated: bool, use_tma: bool, block_n: int, block_k: int) -> dict:
    """The kernel signature for one launch configuration (gate_up: u8 codes + scales out; down: fp32 out)."""
    sig = dict(GLUON_MOE_W4A4_SIGNATURE)
    if not gated:
        sig["out_ptr"] = "*fp32"
    if use_tma:
        sig["w_desc"] = codes_desc_type(block_n, block_k)
    return sig


def divisible(use_tma: bool) -> list[str]:
    return divisible_args(GLUON_MOE_W4A4_DIVISIBLE, use_tma)


def smem_bytes(gated: bool, block_m: int, block_n: int, block_k: int, stages: int, epilogue_warps: int = 0) -> int:
    """Shared memory of the ring (codes + scales of both operands) and of the fp32 accumulator handed to the
    epilogue warps, without Triton's scratch and barriers."""
    nb = 2 if gated else 1
    acc = block_m * block_n * 4 if epilogue_warps else 0
    return stages * (block_m + nb * block_n) * (block_k // 2 + block_k // 16) + acc


if HAS_GLUON:
    from .gluon_common import decode_tile, down_epilogue, tile_coords, tile_range

    # ---- loader: weight codes (TMA or pointers), weight scales, gathered activation codes + scales ----------
    @gluon.jit
    def _loader_partition(
        a_ptr, a_sf_ptr, w_ptr, w_desc, w_sf_ptr, a_smem, asf_smem, w_smem, wsf_smem, ready, empty,
        sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
        R, N, K, top_k, max_blocks, stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
        GATED: gl.constexpr, USE_TMA: gl.constexpr, PERSISTENT: gl.constexpr, STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
        CH: gl.constexpr,
    ):
        NB: gl.constexpr = 2 if GATED else 1
        KB: gl.constexpr = BLOCK_K // 2
        G: gl.constexpr = BLOCK_K // 16
        gl.static_assert(STAGES >= 2)
        gl.static_assert(BLOCK_M % CH == 0 and BLOCK_N % CH == 0)
        # One warp: codes as 16-byte row segments, scales as one 8-byte row per lane.
        CL: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 16 // KB, KB // 16], [1, 1], [1, 0])
        SL: gl.constexpr = gl.BlockedLayout([1, G], [32, 1], [1, 1], [1, 0])
        kb = gl.arange(0, KB, layout=gl.SliceLayout(0, CL))
        ks = gl.arange(0, G, layout=gl.SliceLayout(0, SL))
        num_n = gl.cdiv(N, BLOCK_N)
        num_padded = gl.load(num_padded_ptr)
        first, end, step = tile_range(num_padded_ptr, max_blocks, num_n, BLOCK_M, PERSISTENT)
        it = 0
        for tile in range(first, end, step):
            pid_m, pid_n = tile_coords(tile, max_blocks, num_n, PERSISTENT, GROUP_M)
            if pid_m * BLOCK_M < num_padded:
                e = gl.load(expert_ids_ptr + pid_m).to(gl.int64)
                n0 = pid_n * BLOCK_N
                for k0 in range(0, K, BLOCK_K):
                    s = it % STAGES
                    ampere.mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                    kb_ok = (k0 // 2 + kb) < K // 2
                    ks_ok = (k0 // 16 + ks) < K // 16
                    # Activations: gate_up reads the token's row of x's codes, down the route's row of the
                    # intermediate.  Padding rows (id >= R) load zero codes and zero scales: they add exactly 0.
                    for c in gl.static_range(BLOCK_M // CH):
                        ids = sorted_ids_ptr + pid_m * BLOCK_M + c * CH
                        ra = gl.load(ids + gl.arange(0, CH, layout=gl.SliceLayout(1, CL)))
                        rs = gl.load(ids + gl.arange(0, CH, layout=gl.SliceLayout(1, SL)))
                        xa = (ra // top_k if GATED else ra).to(gl.int64)
                        xs = (rs // top_k if GATED else rs).to(gl.int64)
                        a = gl.load(a_ptr + xa[:, None] * stride_am + (k0 // 2 + kb)[None, :],
                                    mask=(ra < R)[:, None] & kb_ok[None, :], other=0)
                        a_smem.index(s).slice(c * CH, CH).store(a)
                        sa = gl.load(a_sf_ptr + xs[:, None] * stride_asm + (k0 // 16 + ks)[None, :],
                                     mask=(rs < R)[:, None] & ks_ok[None, :], other=0)
                        asf_smem.index(s).slice(c * CH, CH).store(sa)
                    # Weight scales (zero past N and K: garbage TMA rows of the next expert then add 0).
                    for c in gl.static_range(BLOCK_N // CH):
                        rows = n0 + c * CH + gl.arange(0, CH, layout=gl.SliceLayout(1, SL))
                        base = (w_sf_ptr + e * stride_wse + rows[:, None].to(gl.int64) * stride_wsn
                                + (k0 // 16 + ks)[None, :])
                        for j in gl.static_range(NB):
                            sw = gl.load(base + j * N * stride_wsn, mask=(rows < N)[:, None] & ks_ok[None, :], other=0)
                            wsf_smem.index(s * NB + j).slice(c * CH, CH).store(sw)
                    if not USE_TMA:
                        for c in gl.static_range(BLOCK_N // CH):
                            rows = n0 + c * CH + gl.arange(0, CH, layout=gl.SliceLayout(1, CL))
                            base = (w_ptr + e * stride_we + rows[:, None].to(gl.int64) * stride_wn
                                    + (k0 // 2 + kb)[None, :])
                            w_ok = (rows < N)[:, None] & kb_ok[None, :]
                            for j in gl.static_range(NB):
                                w = gl.load(base + j * N * stride_wn, mask=w_ok, other=0)
                                w_smem.index(s * NB + j).slice(c * CH, CH).store(w)
                    gl.barrier()
                    if USE_TMA:
                        # The expect is this slot's one arrive: it follows the pointer-loaded stores above.
                        mbarrier_expect(ready.index(s), NB * BLOCK_N * KB)
                        for j in gl.static_range(NB):
                            tma_async_load(w_desc, [e.to(gl.int32) * (NB * N) + j * N + n0, k0 // 2],
                                           ready.index(s), w_smem.index(s * NB + j))
                    else:
                        ampere.mbarrier.arrive(ready.index(s))
                    it += 1

    @gluon.jit
    def _decode_operand(codes_slot, sf_slot, BLOCK_R: gl.constexpr, BLOCK_K: gl.constexpr, WARPS: gl.constexpr):
        """A codes slot ``[BLOCK_R, BLOCK_K/2]`` + its scales ``[BLOCK_R, BLOCK_K/16]`` → exact bf16
        ``[BLOCK_R, BLOCK_K]``."""
        G: gl.constexpr = BLOCK_K // 16
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32 // (2 * G), G, 2], [WARPS, 1, 1], [2, 1, 0])
        LC: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (2 * G), 2 * G], [WARPS, 1], [1, 0])
        codes = gl.convert_layout(codes_slot.load(LC).reshape([BLOCK_R, G, 8]), L3)
        sf = sf_slot.load(gl.SliceLayout(2, L3)).to(gl.float8e4nv, bitcast=True).to(gl.bfloat16)
        return decode_tile(codes, sf, DECODE_PORTABLE_C, False, gl.bfloat16, BLOCK_R, BLOCK_K)

    @gluon.jit
    def _slot_mma(a_smem, asf_smem, w_smem, wsf_smem, s, j, acc, DECODE: gl.constexpr, NB: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                  WARPS_M: gl.constexpr, WARPS_N: gl.constexpr):
        """``acc += A @ W_j^T`` for the FP4 operands of ring slot ``s`` (weight half ``j``)."""
        if DECODE:
            MMA: gl.constexpr = acc.type.layout
            a = gl.convert_layout(_decode_operand(a_smem.index(s), asf_smem.index(s), BLOCK_M, BLOCK_K,
                                                  WARPS_M * WARPS_N),
                                  gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=8))
            w = _decode_operand(w_smem.index(s * NB + j), wsf_smem.index(s * NB + j), BLOCK_N, BLOCK_K,
                                WARPS_M * WARPS_N)
            b = gl.convert_layout(gl.permute(w, (1, 0)), gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=8))
            acc = ampere.mma_v2(a, b, acc)
        else:
            a = a_smem.index(s).load(scaled_layout("a", BLOCK_M, BLOCK_N, BLOCK_K, WARPS_M, WARPS_N))
            sa = asf_smem.index(s).load(scaled_layout("a_scale", BLOCK_M, BLOCK_N, BLOCK_K, WARPS_M, WARPS_N))
            # B is K-packed [BLOCK_K/2, BLOCK_N]: the [BLOCK_N, BLOCK_K/2] slot viewed transposed.
            b = w_smem.index(s * NB + j).permute((1, 0)).load(
                scaled_layout("b", BLOCK_M, BLOCK_N, BLOCK_K, WARPS_M, WARPS_N))
            sb = wsf_smem.index(s * NB + j).load(scaled_layout("b_scale", BLOCK_M, BLOCK_N, BLOCK_K, WARPS_M, WARPS_N))
            acc = mma_scaled_sm120(a, sa.to(gl.float8e4nv, bitcast=True), b, sb.to(gl.float8e4nv, bitcast=True), acc)
        return acc

    # ---- mma + epilogue (default partition) ----------------------------------------------------------------
    @gluon.jit
    def _mma_partition(
        w_dec_ptr, a_enc_ptr, q_enc_ptr, topk_w_ptr, out_ptr, out_sf_ptr, a_smem, asf_smem, w_smem, wsf_smem,
        ready, empty, acc_smem, acc_ready, acc_empty, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
        R, N, K, top_k, max_blocks, stride_om, stride_osm,
        GATED: gl.constexpr, ACTIVATION: gl.constexpr, DETERMINISTIC: gl.constexpr, DECODE: gl.constexpr,
        PERSISTENT: gl.constexpr, EPILOGUE_WARPS: gl.constexpr, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, MMA_WARPS_M: gl.constexpr,
        WARPS: gl.constexpr,
    ):
        NB: gl.constexpr = 2 if GATED else 1
        WARPS_N: gl.constexpr = WARPS // MMA_WARPS_M
        # The block-scaled MMA's accumulator layout is the plain mma v2 one: both paths share the epilogue.
        MMA: gl.constexpr = scaled_layout("acc", BLOCK_M, BLOCK_N, BLOCK_K, MMA_WARPS_M, WARPS_N)
        num_n = gl.cdiv(N, BLOCK_N)
        num_padded = gl.load(num_padded_ptr)
        first, end, step = tile_range(num_padded_ptr, max_blocks, num_n, BLOCK_M, PERSISTENT)
        it = 0
        tc = 0  # tiles handed to the epilogue warps
        for tile in range(first, end, step):
            pid_m, pid_n = tile_coords(tile, max_blocks, num_n, PERSISTENT, GROUP_M)
            if pid_m * BLOCK_M < num_padded:
                acc0 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
                acc1 = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, MMA)
                for k0 in range(0, K, BLOCK_K):
                    s = it % STAGES
                    ampere.mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                    acc0 = _slot_mma(a_smem, asf_smem, w_smem, wsf_smem, s, 0, acc0, DECODE, NB,
                                     BLOCK_M, BLOCK_N, BLOCK_K, MMA_WARPS_M, WARPS_N)
                    if GATED:
                        acc1 = _slot_mma(a_smem, asf_smem, w_smem, wsf_smem, s, 1, acc1, DECODE, NB,
                                         BLOCK_M, BLOCK_N, BLOCK_K, MMA_WARPS_M, WARPS_N)
                    gl.barrier()
                    ampere.mbarrier.arrive(empty.index(s))
                    it += 1

                if GATED:
                    alpha = _alpha(w_dec_ptr, a_enc_ptr, expert_ids_ptr, pid_m)
                    # The hardware e2m1 convert exists where the block-scaled MMA does (sm_120), not under DECODE.
                    _gate_up_epilogue(acc0 * alpha, acc1 * alpha, q_enc_ptr, out_ptr, out_sf_ptr, sorted_ids_ptr,
                                      pid_m, pid_n, R, N, stride_om, stride_osm, ACTIVATION, not DECODE, BLOCK_M,
                                      BLOCK_N, WARPS)
                elif EPILOGUE_WARPS > 0:
                    # Hand the raw accumulator over and start the next tile's K loop; the epilogue warps release
                    # the buffer as soon as they hold it in registers.
                    ampere.mbarrier.wait(acc_empty, (tc & 1) ^ 1)
                    acc_smem.store(acc0)
                    gl.barrier()
                    ampere.mbarrier.arrive(acc_ready)
                    tc += 1
                else:
                    down_epilogue(acc0, _alpha(w_dec_ptr, a_enc_ptr, expert_ids_ptr, pid_m), topk_w_ptr, out_ptr,
                                  sorted_ids_ptr, pid_m, pid_n, R, N, top_k, stride_om, DETERMINISTIC, BLOCK_M, BLOCK_N)

    @gluon.jit
    def _alpha(w_dec_ptr, a_enc_ptr, expert_ids_ptr, pid_m):
        # As the reference forms it: weight decode x input decode (1 / enc, IEEE division).
        return gl.load(w_dec_ptr + gl.load(expert_ids_ptr + pid_m)) * tl.div_rn(1.0, gl.load(a_enc_ptr))

    # ---- epilogue warps (down GEMM, EPILOGUE_WARPS > 0) -----------------------------------------------------
    @gluon.jit
    def _epilogue_partition(
        w_dec_ptr, a_enc_ptr, topk_w_ptr, out_ptr, acc_smem, acc_ready, acc_empty,
        sorted_ids_ptr, expert_ids_ptr, num_padded_ptr, R, N, top_k, max_blocks, stride_om,
        DETERMINISTIC: gl.constexpr, PERSISTENT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        GROUP_M: gl.constexpr, WARPS: gl.constexpr,
    ):
        # 16-byte row segments: each thread's 4 fp32 columns are contiguous in the output row.
        EL: gl.constexpr = gl.BlockedLayout([1, 4], [128 // BLOCK_N, BLOCK_N // 4], [WARPS, 1], [1, 0])
        num_n = gl.cdiv(N, BLOCK_N)
        num_padded = gl.load(num_padded_ptr)
        first, end, step = tile_range(num_padded_ptr, max_blocks, num_n, BLOCK_M, PERSISTENT)
        tc = 0
        for tile in range(first, end, step):
            pid_m, pid_n = tile_coords(tile, max_blocks, num_n, PERSISTENT, GROUP_M)
            if pid_m * BLOCK_M < num_padded:
                ampere.mbarrier.wait(acc_ready, tc & 1)
                acc = acc_smem.load(EL)
                gl.barrier()
                ampere.mbarrier.arrive(acc_empty)
                tc += 1
                down_epilogue(acc, _alpha(w_dec_ptr, a_enc_ptr, expert_ids_ptr, pid_m), topk_w_ptr, out_ptr,
                              sorted_ids_ptr, pid_m, pid_n, R, N, top_k, stride_om, DETERMINISTIC, BLOCK_M, BLOCK_N)

    @gluon.jit
    def _gate_up_epilogue(gate, up, q_enc_ptr, out_ptr, out_sf_ptr, sorted_ids_ptr, pid_m, pid_n, R, N,
                          stride_om, stride_osm, ACTIVATION: gl.constexpr, NATIVE_E2M1: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, WARPS: gl.constexpr):
        """``act(gate) * up`` → NVFP4 with the down input's encode scale: codes ``[R, I/2]``, scales ``[R, I/16]``."""
        NG: gl.constexpr = BLOCK_N // 16
        # One 16-element NVFP4 block per thread: the block amax needs no shuffles, and I % 16 == 0 keeps every
        # block inside one tile.
        EL: gl.constexpr = gl.BlockedLayout([1, 16], [32 // NG, NG], [WARPS, 1], [1, 0])
        L3: gl.constexpr = gl.BlockedLayout([1, 1, 16], [32 // NG, NG, 1], [WARPS, 1, 1], [2, 1, 0])
        CL: gl.constexpr = gl.BlockedLayout([1, 1, 8], [32 // NG, NG, 1], [WARPS, 1, 1], [2, 1, 0])
        SL: gl.constexpr = gl.BlockedLayout([1, 1], [32 // NG, NG], [WARPS, 1], [1, 0])
        inter = gl.convert_layout(gated_activation_f32(gate, up, ACTIVATION), EL)
        blocks = gl.convert_layout(inter.reshape([BLOCK_M, NG, 16]), L3)
        # sm_89+: the RNE fp8 convert; sm_120: the e2m1 convert too.
        codes, sf = quantize_blocks_nvfp4(blocks, gl.load(q_enc_ptr), True, NATIVE_E2M1)
        codes = gl.convert_layout(codes, CL)
        sf = gl.convert_layout(sf, SL)

        rc = gl.load(sorted_ids_ptr + pid_m * BLOCK_M
                     + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, gl.SliceLayout(2, CL))))
        bc = pid_n * NG + gl.arange(0, NG, layout=gl.SliceLayout(0, gl.SliceLayout(2, CL)))
        byte = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, CL)))
        rc3 = gl.expand_dims(gl.expand_dims(rc, 1), 2)
        bc3 = gl.expand_dims(gl.expand_dims(bc, 0), 2)
        by3 = gl.expand_dims(gl.expand_dims(byte, 0), 1)
        gl.store(out_ptr + rc3.to(gl.int64) * stride_om + bc3 * 8 + by3, codes,
                 mask=(rc3 < R) & (bc3 < N // 16) & (by3 < 8))
        rs = gl.load(sorted_ids_ptr + pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, SL)))
        bs = pid_n * NG + gl.arange(0, NG, layout=gl.SliceLayout(0, SL))
        gl.store(out_sf_ptr + rs[:, None].to(gl.int64) * stride_osm + bs[None, :], sf,
                 mask=(rs < R)[:, None] & (bs < N // 16)[None, :])

    @gluon.jit(do_not_specialize=["R", "max_blocks"])  # token counts vary per call
    def _gluon_moe_w4a4_kernel(
        a_ptr, a_sf_ptr, w_ptr, w_desc, w_sf_ptr, w_dec_ptr, a_enc_ptr, q_enc_ptr, topk_w_ptr, out_ptr, out_sf_ptr,
        sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
        R, N, K, top_k, max_blocks,
        stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om, stride_osm,
        GATED: gl.constexpr, ACTIVATION: gl.constexpr, DETERMINISTIC: gl.constexpr, USE_TMA: gl.constexpr,
        DECODE: gl.constexpr, PERSISTENT: gl.constexpr, EPILOGUE_WARPS: gl.constexpr, STAGES: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
        MMA_WARPS_M: gl.constexpr,
    ):
        NB: gl.constexpr = 2 if GATED else 1
        CODES_L: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=BLOCK_K // 2 if BLOCK_K // 2 < 128 else 128,
                                                     element_bitwidth=8, rank=2)
        SF_L: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        a_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_M, BLOCK_K // 2], CODES_L)
        asf_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_M, BLOCK_K // 16], SF_L)
        w_smem = gl.allocate_shared_memory(gl.uint8, [STAGES * NB, BLOCK_N, BLOCK_K // 2], CODES_L)
        wsf_smem = gl.allocate_shared_memory(gl.uint8, [STAGES * NB, BLOCK_N, BLOCK_K // 16], SF_L)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], ampere.mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], ampere.mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            ampere.mbarrier.init(ready.index(s), count=1)
            ampere.mbarrier.init(empty.index(s), count=1)
        hopper.fence_async_shared()  # the barrier inits must be visible to the TMA unit
        LOADER_R: gl.constexpr = LOADER_REGS_C if USE_TMA else LOADER_REGS_PTR_C
        if EPILOGUE_WARPS > 0:
            gl.static_assert(not GATED and PERSISTENT, "epilogue warps serve the persistent down GEMM")
            acc_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], SF_L)
            acc_bars = gl.allocate_shared_memory(gl.int64, [2, 1], ampere.mbarrier.MBarrierLayout())
            ampere.mbarrier.init(acc_bars.index(0), count=1)
            ampere.mbarrier.init(acc_bars.index(1), count=1)
            gl.warp_specialize([
                (_mma_partition, (w_dec_ptr, a_enc_ptr, q_enc_ptr, topk_w_ptr, out_ptr, out_sf_ptr,
                                  a_smem, asf_smem, w_smem, wsf_smem, ready, empty,
                                  acc_smem, acc_bars.index(0), acc_bars.index(1),
                                  sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                                  R, N, K, top_k, max_blocks, stride_om, stride_osm,
                                  GATED, ACTIVATION, DETERMINISTIC, DECODE, PERSISTENT, EPILOGUE_WARPS, STAGES,
                                  BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, MMA_WARPS_M, gl.num_warps())),
                (_loader_partition, (a_ptr, a_sf_ptr, w_ptr, w_desc, w_sf_ptr, a_smem, asf_smem, w_smem, wsf_smem,
                                     ready, empty, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                                     R, N, K, top_k, max_blocks, stride_am, stride_asm, stride_we, stride_wn,
                                     stride_wse, stride_wsn,
                                     GATED, USE_TMA, PERSISTENT, STAGES, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                     ROW_CHUNK_C)),
                (_epilogue_partition, (w_dec_ptr, a_enc_ptr, topk_w_ptr, out_ptr, acc_smem, acc_bars.index(0),
                                       acc_bars.index(1), sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                                       R, N, top_k, max_blocks, stride_om,
                                       DETERMINISTIC, PERSISTENT, BLOCK_M, BLOCK_N, GROUP_M, EPILOGUE_WARPS)),
            ], [LOADER_WARPS_C, EPILOGUE_WARPS], [LOADER_R, EPILOGUE_REGS_C])
        else:
            # No accumulator hand-over: the ring's buffers stand in for the unused arguments.  (The partition
            # tuples cannot live in a variable in Gluon, hence the loader twice.)
            gl.warp_specialize([
                (_mma_partition, (w_dec_ptr, a_enc_ptr, q_enc_ptr, topk_w_ptr, out_ptr, out_sf_ptr,
                                  a_smem, asf_smem, w_smem, wsf_smem, ready, empty,
                                  asf_smem, ready.index(0), empty.index(0),
                                  sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                                  R, N, K, top_k, max_blocks, stride_om, stride_osm,
                                  GATED, ACTIVATION, DETERMINISTIC, DECODE, PERSISTENT, EPILOGUE_WARPS, STAGES,
                                  BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, MMA_WARPS_M, gl.num_warps())),
                (_loader_partition, (a_ptr, a_sf_ptr, w_ptr, w_desc, w_sf_ptr, a_smem, asf_smem, w_smem, wsf_smem,
                                     ready, empty, sorted_ids_ptr, expert_ids_ptr, num_padded_ptr,
                                     R, N, K, top_k, max_blocks, stride_am, stride_asm, stride_we, stride_wn,
                                     stride_wse, stride_wsn,
                                     GATED, USE_TMA, PERSISTENT, STAGES, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M,
                                     ROW_CHUNK_C)),
            ], [LOADER_WARPS_C], [LOADER_R])

    from .gluon_mma_scaled import mma_scaled_sm120, scaled_layout

    LOADER_WARPS_C = gl.constexpr(LOADER_WARPS)
    LOADER_REGS_C = gl.constexpr(LOADER_REGS)
    LOADER_REGS_PTR_C = gl.constexpr(LOADER_REGS_PTR)
    EPILOGUE_REGS_C = gl.constexpr(EPILOGUE_REGS)
    ROW_CHUNK_C = gl.constexpr(ROW_CHUNK)
    DECODE_PORTABLE_C = gl.constexpr(DECODE_PORTABLE)


# ---------------------------------------------------------------------------------------------------------------
# Launchers: the arguments of moe_w4a4.moe_w4a4_gate_up / moe_w4a4_down, plus ``persistent`` and ``decode``.
# ---------------------------------------------------------------------------------------------------------------
def _check_tile(gated: bool, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
                persistent: bool = False, epilogue_warps: int = 0):
    if block_k != 128:  # the BLOCK_K compile-checked for sm_120 (rows of 64 code bytes, 8 scale bytes)
        raise ValueError(f"block_k: the Gluon W4A4 MoE GEMM takes 128, got {block_k}")
    if block_n < ROW_CHUNK or block_n & (block_n - 1) or block_n > 128:
        raise ValueError(f"block_n: expected a power of two in [{ROW_CHUNK}, 128], got {block_n}")
    if num_warps not in (4, 8) or block_m < 16 * (num_warps // 2) or block_m % ROW_CHUNK:
        raise ValueError(f"num_warps: expected 4 or 8 mma warps with block_m >= 16 * num_warps / 2 (block_m a "
                         f"multiple of {ROW_CHUNK}), got {num_warps} for block_m {block_m}")
    if num_stages < 2:
        raise ValueError(f"num_stages: the mbarrier ring needs >= 2 slots, got {num_stages}")
    if epilogue_warps not in (0, EPILOGUE_WARPS) or (epilogue_warps and (gated or not persistent)):
        raise ValueError(f"epilogue_warps: 0, or {EPILOGUE_WARPS} for the persistent down GEMM, got {epilogue_warps} "
                         f"({'gate_up' if gated else 'down'}, persistent={persistent})")
    need = smem_bytes(gated, block_m, block_n, block_k, num_stages, epilogue_warps)
    if need > SM120_MAX_SMEM_BYTES - 8192:  # room for barriers and the epilogue's layout-conversion scratch
        raise ValueError(f"tile: {num_stages} stages of [{block_m}+{block_n}, {block_k}] need {need} B of shared "
                         f"memory (sm_120 has {SM120_MAX_SMEM_BYTES} B per block); use fewer stages or a smaller tile")


def default_decode(device) -> bool:
    """Native block-scaled MMA on sm_120 (the only target it compiles for), the exact decode elsewhere."""
    import torch

    return torch.cuda.get_device_capability(device)[0] != 12


def _launch(a, a_sf, codes, w_sf, dec, a_enc, q_enc, topk_w, out, out_sf, out_sf_stride, align, n, k, *, gated,
            activation, deterministic, block_n, block_k, group_m, num_warps, num_stages, use_tma, persistent,
            decode, epilogue_warps=0):
    _check_tile(gated, align.block_m, block_n, block_k, num_warps, num_stages, persistent, epilogue_warps)
    run = _prepare(n, k, align.max_blocks, align.block_m, a.device, gated=gated, activation=activation,
                   deterministic=deterministic, block_n=block_n, block_k=block_k, group_m=group_m,
                   num_warps=num_warps, num_stages=num_stages, use_tma=use_tma, persistent=persistent, decode=decode,
                   epilogue_warps=epilogue_warps)
    run(a, a_sf, codes, w_sf, dec, a_enc, q_enc, topk_w, out, out_sf, out_sf_stride, align)


def _prepare(n, k, max_blocks, block_m, device, *, gated, activation, deterministic, block_n, block_k, group_m,
             num_warps, num_stages, use_tma, persistent, decode, epilogue_warps=0):
    """The ready launch of :func:`_launch` (its tile checked already): ``run(a, a_sf, codes, w_sf, dec, a_enc,
    q_enc, topk_w, out, out_sf, out_sf_stride, align)``."""
    from .launch import ReadyKernel

    launch = ReadyKernel(
        _gluon_moe_w4a4_kernel, moe_grid(max_blocks, triton.cdiv(n, block_n), persistent, device),
        GATED=gated, ACTIVATION=activation, DETERMINISTIC=deterministic, USE_TMA=use_tma,
        DECODE=default_decode(device) if decode is None else bool(decode), PERSISTENT=persistent,
        EPILOGUE_WARPS=epilogue_warps, STAGES=num_stages, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=group_m, MMA_WARPS_M=num_warps // 2, num_warps=num_warps,
    )

    def run(a, a_sf, codes, w_sf, dec, a_enc, q_enc, topk_w, out, out_sf, out_sf_stride, align):
        launch(a, a_sf, codes, weight_desc(codes, use_tma, block_n, block_k), w_sf, dec, a_enc, q_enc, topk_w, out,
               out_sf, align.sorted_ids, align.expert_ids, align.num_padded,
               align.num_routes, n, k, align.top_k, max_blocks,
               a.stride(0), a_sf.stride(0), codes.stride(0), codes.stride(1), w_sf.stride(0), w_sf.stride(1),
               out.stride(0), out_sf_stride)

    return run


def gluon_moe_w4a4_gate_up(
    a_codes, a_scales, w13_codes, w13_scales, w13_dec, a13_enc, a2_enc, align: MoeAlignment, *,
    block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int, activation: str = "silu",
    decode: bool | None = None, out_codes=None, out_scales=None, native_e4m3: bool | None = None,
    use_tma: bool = False, persistent: bool = False,
):
    """Gluon twin of :func:`.moe_w4a4.moe_w4a4_gate_up`: ``quant_a2(act(gate) * up)`` per route →
    ``(codes [R, I/2] u8, scales [R, I/16] u8)``.

    ``decode``: None = the block-scaled MMA on sm_120, the exact decode + bf16 ``mma_v2`` elsewhere.
    ``use_tma``: the weight codes by TMA (contiguous, 16-byte aligned codes with K % block_k == 0).
    ``num_warps``: the mma warps (4 or 8; the loader warp comes on top).  ``native_e4m3`` is accepted for the
    Triton kwargs: Gluon always runs on a GPU, where the fp8 convert rounds to nearest even.
    """
    require_gluon("gluon_moe_w4a4_gate_up")
    import torch

    w_sf, h, i, r, out_codes, out_scales = check_w4a4_gate_up_inputs(
        a_codes, a_scales, w13_codes, w13_scales, w13_dec, align, activation, out_codes, out_scales)
    a13 = check_enc("a13_enc", a13_enc)
    a2 = check_enc("a2_enc", a2_enc)
    if r == 0:
        return out_codes, out_scales
    # The TMA view is [E * 2I, H/2]: gate rows at e*2I + n, up rows at e*2I + I + n (the kernel's NB * N rows).
    _launch(a_codes, a_scales.view(torch.uint8), w13_codes, w_sf, w13_dec, a13, a2, w13_dec, out_codes, out_scales,
            out_scales.stride(0), align, i, h, gated=True, activation=activation, deterministic=False,
            block_n=block_n, block_k=block_k, group_m=group_m, num_warps=num_warps, num_stages=num_stages,
            use_tma=use_tma, persistent=persistent, decode=decode)
    return out_codes, out_scales


def gluon_moe_w4a4_down(
    a_codes, a_scales, w2_codes, w2_scales, w2_dec, a2_enc, topk_weights, align: MoeAlignment, out, *,
    block_n: int, block_k: int, group_m: int, num_warps: int, num_stages: int, deterministic: bool = False,
    decode: bool | None = None, use_tma: bool = False, persistent: bool = False, epilogue_warps: int = 0,
):
    """Gluon twin of :func:`.moe_w4a4.moe_w4a4_down`: ``topk_weight * (w2_dec[e] / a2_enc) * (inter[route] @
    w2[e]^T)`` summed into the zeroed fp32 ``out`` ``[T, H]`` (atomics) or, ``deterministic``, the per-route
    ``[R, H]``.  ``decode``, ``use_tma``, ``persistent`` as in :func:`gluon_moe_w4a4_gate_up`.
    ``epilogue_warps`` (persistent only): 0 = the mma warps run the epilogue; ``EPILOGUE_WARPS`` = a separate
    partition does, so the mma warps start the next tile while the atomics of this one drain."""
    require_gluon("gluon_moe_w4a4_down")
    import torch

    w_sf, h, i, r = check_w4a4_down_inputs(a_codes, a_scales, w2_codes, w2_scales, w2_dec, topk_weights, align,
                                           out, deterministic)
    a2 = check_enc("a2_enc", a2_enc)
    if r == 0:
        return out
    _launch(a_codes, a_scales.view(torch.uint8), w2_codes, w_sf, w2_dec, a2, a2, topk_weights.contiguous(), out,
            out, 0, align, h, i, gated=False, activation="silu", deterministic=deterministic, block_n=block_n,
            block_k=block_k, group_m=group_m, num_warps=num_warps, num_stages=num_stages, use_tma=use_tma,
            persistent=persistent, decode=decode, epilogue_warps=epilogue_warps)
    return out


# Ready launches with the Triton twins' call arguments (``moe_w4a4.prepare_moe_w4a4_gate_up`` / ``_down``), for
# the MoE flow's ready layer; the tile must have passed the launchers above once.

def prepare_gluon_moe_w4a4_gate_up(h: int, i: int, max_blocks: int, block_m: int, device, *, block_n: int,
                                   block_k: int, group_m: int, num_warps: int, num_stages: int, activation: str,
                                   decode: bool | None = None, use_tma: bool = False, persistent: bool = False,
                                   native_e4m3: bool | None = None):
    """``run(a_codes, a_scales_u8, w13_codes, w13_scales_u8, w13_dec, a13_enc, a2_enc, align, out_codes,
    out_scales) -> (out_codes, out_scales)`` (``native_e4m3`` ignored, as by :func:`gluon_moe_w4a4_gate_up`)."""
    launch = _prepare(i, h, max_blocks, block_m, device, gated=True, activation=activation, deterministic=False,
                      block_n=block_n, block_k=block_k, group_m=group_m, num_warps=num_warps, num_stages=num_stages,
                      use_tma=use_tma, persistent=persistent, decode=decode)

    def run(a_codes, a_sf, w13_codes, w_sf, w13_dec, a13_enc, a2_enc, align, out_codes, out_scales):
        launch(a_codes, a_sf, w13_codes, w_sf, w13_dec, a13_enc, a2_enc, w13_dec, out_codes, out_scales,
               out_scales.stride(0), align)
        return out_codes, out_scales

    return run


def prepare_gluon_moe_w4a4_down(h: int, i: int, max_blocks: int, block_m: int, device, *, block_n: int, block_k: int,
                                group_m: int, num_warps: int, num_stages: int, deterministic: bool,
                                decode: bool | None = None, use_tma: bool = False, persistent: bool = False,
                                epilogue_warps: int = 0):
    """``run(a_codes, a_scales_u8, w2_codes, w2_scales_u8, w2_dec, a2_enc, topk_weights, align, out) -> out``."""
    launch = _prepare(h, i, max_blocks, block_m, device, gated=False, activation="silu", deterministic=deterministic,
                      block_n=block_n, block_k=block_k, group_m=group_m, num_warps=num_warps, num_stages=num_stages,
                      use_tma=use_tma, persistent=persistent, decode=decode, epilogue_warps=epilogue_warps)

    def run(a_codes, a_sf, w2_codes, w_sf, w2_dec, a2_enc, topk_weights, align, out):
        launch(a_codes, a_sf, w2_codes, w_sf, w2_dec, a2_enc, a2_enc, topk_weights.contiguous(), out, out, 0, align)
        return out

    return run
