"""Sweep of the align-free decode MoE kernels (``vllm_nvfp4_sm120.kernels.moe_decode``) on a CUDA GPU.

    source .carry/env.sh && python benchmarks/moe_decode_sweep.py --out $OUT [--shapes ...] [--tokens ...]
        [--gate-up NAME,...] [--down NAME,...] [--list]

For each model shape (H, I, E, top_k) and batch size T: every candidate is first checked against
``format.moe_ref`` once (a failing candidate is reported and never timed as best), then timed with the method of
``vllm_nvfp4_sm120.bench``: a CUDA graph of ``C`` calls, call ``c`` on its own copy of the expert banks with its own
random routing, so the experts one call reads are not in L2 from an earlier call (the copies total several L2
sizes); median over replays.  The gate_up and the down candidates are timed separately (a gate_up tile and a down
variant are independent choices), then the best pair as a whole layer, today's path
(``dispatch.moe_flow.nvfp4_moe``, the dispatch's W4A16 plan) in the same run, and the launch cost of a graph of two
empty Triton kernels (with ``--read-ceiling``, also two launches that only read the touched experts' codes and
scales: what a two-kernel layer cannot beat; with ``--loads-probe GATE_UP,DOWN``, the streaming kernels' walk over the
routed experts with their loads alone, ``stream_loads_probe.py``: what their pattern lets the bytes do).  Floor =
codes + scales bytes of the experts each call routes to / DRAM read bandwidth measured in the same run
(``bench.dram_read_tbs``).  Rows go to ``$OUT/moe_decode.json``; a compact table prints last.  Runs without vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace

import torch
import triton
import triton.language as tl

# Run as a script from anywhere: the package is the repository's; the loads probe sits beside this script.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from vllm_nvfp4_sm120.kernels.moe_decode import (  # noqa: E402
    DecodeTile,
    decode_gate_up,
    down_expert_workspace,
    moe_decode,
    moe_decode_down_expert,
    moe_decode_down_token,
    moe_decode_gate_up,
    tma_ok,
)
from vllm_nvfp4_sm120.kernels.gluon_moe_decode import MoeStreamTile, down_workspace_numel, moe_stream_down  # noqa: E402
from vllm_nvfp4_sm120.kernels.moe_decode_fused import check_fused_tiles, fused_workspace, moe_decode_fused  # noqa: E402
from vllm_nvfp4_sm120.bench import xor_words  # noqa: E402
from stream_loads_probe import moe_stream_loads, moe_stream_loads_expected  # noqa: E402

SHAPES = {  # name: (H, I, E, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "qwen3-next-80b": (2048, 512, 512, 10),
}
EXTRA_SHAPES = {"tiny": (256, 256, 8, 2)}  # the CPU smoke test (not in the default list)
TOKENS = (1, 2, 4, 8, 16, 32, 64)

# Candidates.  Tensor-core tiles keep M = 16 rows per warp (gate_up: 2 * block_n rows): with fewer rows per warp
# Triton replicates the weight operand across warps.  On sm_90 a 64-row, 4-warp tile becomes a wgmma with the
# weights as a register operand (its byte layout needs byte-wise shared-memory loads: kept as one candidate);
# 16- and 32-row tiles are mma.sync as on sm_120.  CUDA-core tiles take one route per chunk.  "-pdl" down tiles
# start as programmatic dependents of the gate_up kernel and prefetch their weights into L2 while it finishes.
GATE_UP = {
    "gu-n16k256-w2-tma": DecodeTile(16, 256, 16, num_warps=2, num_stages=4, use_dot=True, use_tma=True),
    "gu-n16k256-w2": DecodeTile(16, 256, 16, num_warps=2, num_stages=4, use_dot=True),
    "gu-n16k512-w2-tma": DecodeTile(16, 512, 16, num_warps=2, num_stages=3, use_dot=True, use_tma=True),
    "gu-n8k256-w1-tma": DecodeTile(8, 256, 16, num_warps=1, num_stages=6, use_dot=True, use_tma=True),
    "gu-n32k256-w4-tma": DecodeTile(32, 256, 16, num_warps=4, num_stages=4, use_dot=True, use_tma=True),
    "gu-n16k256-w4-fma": DecodeTile(16, 256, 1, num_warps=4, num_stages=4, use_dot=False),
    "gu-n16k256-w2-evict": DecodeTile(16, 256, 16, num_warps=2, num_stages=4, use_dot=True, evict_first=True),
    # Split-K (T <= 4: 8-40 routes make too few programs, each decoding a long K loop; splitting K multiplies the
    # decode warps in flight, the last split of each tile sums the fp32 partials in split order).  Not on the
    # 512-wide K tile: with the split epilogue it spills on sm_120 (compile check).
    "gu-n16k256-w2-tma-s2": DecodeTile(16, 256, 16, num_warps=2, num_stages=4, use_dot=True, use_tma=True,
                                       split_k=2),
    "gu-n16k256-w2-tma-s4": DecodeTile(16, 256, 16, num_warps=2, num_stages=4, use_dot=True, use_tma=True,
                                       split_k=4),
    # Fewer stages / a narrower K step: less shared memory per program, so more programs (hence more decode warps)
    # per SM at small T, where the 3-4 stage tiles above hold 8-10 warps per SM.
    "gu-n16k256-w2-tma-st2": DecodeTile(16, 256, 16, num_warps=2, num_stages=2, use_dot=True, use_tma=True),
    "gu-n16k256-w2-tma-st3": DecodeTile(16, 256, 16, num_warps=2, num_stages=3, use_dot=True, use_tma=True),
    "gu-n8k256-w1-tma-st2": DecodeTile(8, 256, 16, num_warps=1, num_stages=2, use_dot=True, use_tma=True),
    "gu-n16k128-w2-st3": DecodeTile(16, 128, 16, num_warps=2, num_stages=3, use_dot=True),
    "gu-n32k256-w4-tma-st2": DecodeTile(32, 256, 16, num_warps=4, num_stages=2, use_dot=True, use_tma=True),
    "gu-n16k128-w2-st2": DecodeTile(16, 128, 16, num_warps=2, num_stages=2, use_dot=True),
    "gu-n32k128-w4-st3": DecodeTile(32, 128, 16, num_warps=4, num_stages=3, use_dot=True),
    "gu-n8k128-w1-st3": DecodeTile(8, 128, 16, num_warps=1, num_stages=3, use_dot=True),
    # More stages of the narrow K step: at T <= 4 on the small layers each SM holds two or three programs, so the
    # bytes in flight per program bound the read rate.
    "gu-n16k128-w2-st4": DecodeTile(16, 128, 16, num_warps=2, num_stages=4, use_dot=True),
    "gu-n16k128-w2-st6": DecodeTile(16, 128, 16, num_warps=2, num_stages=6, use_dot=True),
    "gu-n16k64-w2-st6": DecodeTile(16, 64, 16, num_warps=2, num_stages=6, use_dot=True),
    "gu-n16k128-w2-st6-s2": DecodeTile(16, 128, 16, num_warps=2, num_stages=6, use_dot=True, split_k=2),
    # The shift decode (fewer integer instructions per code word; the activations permuted in registers, a cost
    # shared by the rows of a warp: 16 or 32 rows per warp).
    "gu-n16k128-w2-st3-shift": DecodeTile(16, 128, 16, num_warps=2, num_stages=3, use_dot=True, shift_decode=True),
    "gu-n32k128-w2-st3": DecodeTile(32, 128, 16, num_warps=2, num_stages=3, use_dot=True),
    "gu-n32k128-w2-st3-shift": DecodeTile(32, 128, 16, num_warps=2, num_stages=3, use_dot=True, shift_decode=True),
    # Split-K on the small-shared-memory tile: at T = 1-4 the grid alone holds ~6 warps per SM.
    "gu-n16k128-w2-st3-s2": DecodeTile(16, 128, 16, num_warps=2, num_stages=3, use_dot=True, split_k=2),
    "gu-n16k128-w2-st3-s4": DecodeTile(16, 128, 16, num_warps=2, num_stages=3, use_dot=True, split_k=4),
    # Warps over K inside the program (k_warps: a batched MMA, one K slice per warp over all 32 rows, the slices
    # added after the loop): at T = 1-2 the grid alone holds ~6 warps per SM, and a split through memory costs its
    # partial sums, a fence and an arrival count.
    "gu-n16k128-kw4-st3": DecodeTile(16, 128, 16, num_warps=4, num_stages=3, use_dot=True, k_warps=4),
    "gu-n16k256-kw4-st3": DecodeTile(16, 256, 16, num_warps=4, num_stages=3, use_dot=True, k_warps=4),
    "gu-n16k256-kw4-st3-shift": DecodeTile(16, 256, 16, num_warps=4, num_stages=3, use_dot=True, k_warps=4,
                                           shift_decode=True),
    "gu-n16k256-kw8-st3": DecodeTile(16, 256, 16, num_warps=8, num_stages=3, use_dot=True, k_warps=8),
    "gu-n16k512-kw8-st2": DecodeTile(16, 512, 16, num_warps=8, num_stages=2, use_dot=True, k_warps=8),
    "gu-n16k512-kw8-st2-shift": DecodeTile(16, 512, 16, num_warps=8, num_stages=2, use_dot=True, k_warps=8,
                                           shift_decode=True),
}
# The streaming Gluon gate_up (kernels/gluon_moe_decode.py: the linear streaming kernel's decode step over a stream-K
# list of the touched experts' row tiles; T <= block_t only).  Registers decide the CTAs per SM (sm_90 compiles with
# an expert map: 32 x 8 160 registers, 3 CTAs; 16 x 8 122, 4; 32 x 16 176, 2).  Caps for one CTA more, 64 rows
# and the 32-row 8-warp tile at <= 128 registers spill on sm_90 or sm_120 (compile check), so none of them is a
# candidate.  The 16-row 8-warp tile at 128 registers does not spill (2 CTAs of 8 warps per SM); in the layer on an
# H100 (run 103) it was 1.10-1.33x slower than the table's gate_ups at T = 4 and 8 on the four shapes, and was dropped.
STREAM_GATE_UP = {
    "gus-m32t8": MoeStreamTile(32, 8, ctas_per_sm=3),
    "gus-m16t8": MoeStreamTile(16, 8, ctas_per_sm=4),
    "gus-m32t16": MoeStreamTile(32, 16, ctas_per_sm=2),
    # Fewer warps over K (two instead of four): each warp streams twice the steps of a row tile's run, which is short
    # where K is (H = 2048: 16 blocks of 128).  64 rows over two row warps: 160 registers (3 CTAs); two-warp CTAs:
    # 164 (6).
    "gus-m64t8-rw2": MoeStreamTile(64, 8, num_warps=4, row_warps=2, ctas_per_sm=3),
    "gus-m32t8-w2": MoeStreamTile(32, 8, num_warps=2, ctas_per_sm=6),
}
# 64-bit row pointers once per run ("-rp"): one wide multiply-add per load address instead of ~3.5 instructions,
# 24.5 instead of 25.8 instructions per code word on sm_90 and 13.8 instead of 15.9 on sm_120, at 162-168 registers
# (still 3 CTAs).  H200 run 69: level with the same tiles (-7 to +5 %), so not in the table; on sm_120 the change
# is 13 % of the loop.  (An L2 prefetch of the next run's first steps when a run starts was slower on all but
# one row of the same run, by up to 31 %, and was removed.)
for _name in ("gus-m32t8", "gus-m64t8-rw2"):
    STREAM_GATE_UP[f"{_name}-rp"] = replace(STREAM_GATE_UP[_name], row_pointers=True)
# Runs overlapped ("-ov"): each run's first step loaded before the previous run's last step and epilogue, the routing
# recomputed only where the expert changes.  Capped at 168 registers for 3 CTAs per SM (no stack on sm_90 or
# sm_120); the 64-row tile spills under that cap on sm_90 and runs uncapped (214 registers there: 2 CTAs).
STREAM_GATE_UP["gus-m32t8-ov"] = replace(STREAM_GATE_UP["gus-m32t8"], overlap_runs=True, max_regs=168)
STREAM_GATE_UP["gus-m64t8-rw2-ov"] = replace(STREAM_GATE_UP["gus-m64t8-rw2"], overlap_runs=True, ctas_per_sm=2)
# Two steps loaded ahead ("-pf2": three register buffers, kernels/gluon_gemv_stream._run_steps_deep): twice the code
# bytes in flight per warp.  Capped at 168 registers the table's two tiles keep 3 CTAs per SM without a stack on
# sm_90 or sm_120 (compile tests); at 128 (4 CTAs) they spill on sm_120.  On an H100 the layer with them was within
# -6 % / +4 % of their one-step twins at T = 2-8 on the four shapes: not in the table.
for _name in ("gus-m32t8", "gus-m64t8-rw2"):
    STREAM_GATE_UP[f"{_name}-pf2"] = replace(STREAM_GATE_UP[_name], prefetch=2, max_regs=168)
DOWN = {  # name: (kernel, deterministic, tile)
    "tok-n16k256-w1": ("token", False, DecodeTile(16, 256, 16, num_warps=1, num_stages=4, use_dot=True)),
    "tok-n16k256-w1-pdl": ("token", False, DecodeTile(16, 256, 16, num_warps=1, num_stages=4, use_dot=True,
                                                      pdl=True)),
    "tok-n32k256-w2-tma": ("token", False, DecodeTile(32, 256, 16, num_warps=2, num_stages=4, use_dot=True,
                                                      use_tma=True)),
    "tok-n16k256-w4-fma": ("token", False, DecodeTile(16, 256, 1, num_warps=4, num_stages=4, use_dot=False)),
    "exp-n16k256-w1-tma": ("expert", False, DecodeTile(16, 256, 16, num_warps=1, num_stages=4, use_dot=True,
                                                       use_tma=True)),
    "exp-n16k256-w1-tma-pdl": ("expert", False, DecodeTile(16, 256, 16, num_warps=1, num_stages=4, use_dot=True,
                                                           use_tma=True, pdl=True)),
    "exp-n32k256-w2-tma": ("expert", False, DecodeTile(32, 256, 16, num_warps=2, num_stages=4, use_dot=True,
                                                       use_tma=True)),
    "exp-n32k256-w2-tma-st2": ("expert", False, DecodeTile(32, 256, 16, num_warps=2, num_stages=2, use_dot=True,
                                                           use_tma=True)),
    "exp-n16k256-w1-tma-st2": ("expert", False, DecodeTile(16, 256, 16, num_warps=1, num_stages=2, use_dot=True,
                                                           use_tma=True)),
    "exp-n32k128-w2-st3": ("expert", False, DecodeTile(32, 128, 16, num_warps=2, num_stages=3, use_dot=True)),
    "exp-n32k128-w2-st4": ("expert", False, DecodeTile(32, 128, 16, num_warps=2, num_stages=4, use_dot=True)),
    "exp-n32k128-w2-st6": ("expert", False, DecodeTile(32, 128, 16, num_warps=2, num_stages=6, use_dot=True)),
    "exp-n32k256-w2-tma-st3": ("expert", False, DecodeTile(32, 256, 16, num_warps=2, num_stages=3, use_dot=True,
                                                           use_tma=True)),
    "exp-n32k256-w2-tma-st2-shift": ("expert", False, DecodeTile(32, 256, 16, num_warps=2, num_stages=2, use_dot=True,
                                                                 use_tma=True, shift_decode=True)),
    "exp-n64k256-w2-tma-st2": ("expert", False, DecodeTile(64, 256, 16, num_warps=2, num_stages=2, use_dot=True,
                                                           use_tma=True)),
    "exp-n64k256-w2-tma-st2-shift": ("expert", False, DecodeTile(64, 256, 16, num_warps=2, num_stages=2, use_dot=True,
                                                                 use_tma=True, shift_decode=True)),
    "tok-n16k128-w1-st3-shift": ("token", False, DecodeTile(16, 128, 16, num_warps=1, num_stages=3, use_dot=True,
                                                            shift_decode=True)),
    "tok-n32k128-w1-st3-shift": ("token", False, DecodeTile(32, 128, 16, num_warps=1, num_stages=3, use_dot=True,
                                                            shift_decode=True)),
    "exp-n32k256-w2-st2": ("expert", False, DecodeTile(32, 256, 16, num_warps=2, num_stages=2, use_dot=True)),
    "exp-n16k128-w1-st3": ("expert", False, DecodeTile(16, 128, 16, num_warps=1, num_stages=3, use_dot=True)),
    "exp-n32k256-w2-tma-st2-det": ("expert", True, DecodeTile(32, 256, 16, num_warps=2, num_stages=2, use_dot=True,
                                                               use_tma=True)),
    "tok-n16k128-w1-st3": ("token", False, DecodeTile(16, 128, 16, num_warps=1, num_stages=3, use_dot=True)),
    "exp-n32k256-w2": ("expert", False, DecodeTile(32, 256, 16, num_warps=2, num_stages=4, use_dot=True)),
    "exp-n32k256-w2-tma-det": ("expert", True, DecodeTile(32, 256, 16, num_warps=2, num_stages=4, use_dot=True,
                                                          use_tma=True)),
    # Warps over K (see the gate_up candidates): at T = 1 the down programs are short (I / 256 K steps), so the
    # chain of each program, not the bytes, sets the time.
    "exp-n32k256-kw4-tma-st2": ("expert", False, DecodeTile(32, 256, 16, num_warps=4, num_stages=2, use_dot=True,
                                                            use_tma=True, k_warps=4)),
    "exp-n32k256-kw4-tma-st2-shift": ("expert", False, DecodeTile(32, 256, 16, num_warps=4, num_stages=2,
                                                                  use_dot=True, use_tma=True, k_warps=4,
                                                                  shift_decode=True)),
    "exp-n32k256-kw4-st3": ("expert", False, DecodeTile(32, 256, 16, num_warps=4, num_stages=3, use_dot=True,
                                                        k_warps=4)),
    "exp-n16k256-kw4-tma-st3": ("expert", False, DecodeTile(16, 256, 16, num_warps=4, num_stages=3, use_dot=True,
                                                            use_tma=True, k_warps=4)),
    "exp-n64k256-kw4-tma-st2-shift": ("expert", False, DecodeTile(64, 256, 16, num_warps=4, num_stages=2,
                                                                  use_dot=True, use_tma=True, k_warps=4,
                                                                  shift_decode=True)),
    "tok-n32k256-kw4-st2-shift": ("token", False, DecodeTile(32, 256, 16, num_warps=4, num_stages=2, use_dot=True,
                                                             k_warps=4, shift_decode=True)),
    # T = 1: one program per 16 rows takes all the token's slots (H / 16 programs: 128-448 on the four shapes, about
    # one per SM), so no fp32 atomics, no arrival count and no last-arriver pass after the K loop; with "-pdl" the
    # whole grid can start beside the gate_up kernel's programs and prefetch all its rows before the wait.  Device
    # run 60 (H100): 1.05-1.97x slower than the table's expert-major downs at T = 1-2 on three shapes, with or without
    # "-pdl" (one program streams 8 experts' rows with a few KB in flight); kept for an sm_120 run.
    "tok-n16k256-kw4-st3-shift": ("token", False, DecodeTile(16, 256, 16, num_warps=4, num_stages=3, use_dot=True,
                                                             k_warps=4, shift_decode=True)),
    "tok-n16k256-kw4-st6-shift": ("token", False, DecodeTile(16, 256, 16, num_warps=4, num_stages=6, use_dot=True,
                                                             k_warps=4, shift_decode=True)),
    # The table's TMA down tiles by pointer loads: TMA descriptors are made and encoded on the host per call.
    "exp-n64k256-w2-st2-shift": ("expert", False, DecodeTile(64, 256, 16, num_warps=2, num_stages=2, use_dot=True,
                                                             shift_decode=True)),
}
# The table's down tiles and the token-major T = 1 ones as programmatic dependents of the gate_up kernel ("-pdl":
# routing and an L2 prefetch of the program's weight rows while the gate_up kernel finishes).  Only a layer shows
# what they gain (--pairs): timed alone, a down kernel has no gate_up kernel to overlap.  Device run 59 (H100,
# moe_decode_overlap.py): the edge survives graph capture and the down kernel starts ~1.2 us after the gate_up
# kernel, but the layer moves only 0.92-1.12x (it hides the down's first 2-3 us; docs/benchmarks.md).
for _name in ("exp-n32k256-w2-tma-st2", "exp-n32k256-w2-st2", "exp-n64k256-w2-tma-st2-shift",
              "exp-n64k256-w2-st2-shift", "tok-n32k128-w1-st3-shift", "tok-n16k256-kw4-st3-shift",
              "tok-n16k256-kw4-st6-shift", "tok-n32k256-kw4-st2-shift"):
    _kind, _det, _tile = DOWN[_name]
    DOWN[_name + "-pdl"] = (_kind, _det, replace(_tile, pdl=True))
# The table's expert-major down tiles with K split over programs ("-s<n>"; atomic mode, each split adds into the
# same sums): at T = 1-2 the down grid holds ~4 warps per SM (8 slots x H / block_n programs) and each program's
# chain of I / block_k K steps, not the bytes, sets the time (Nsight Compute, device run 41).
for _name, _splits in (("exp-n64k256-w2-st2-shift", (2, 3, 4)), ("exp-n32k256-w2-tma-st2", (2,)),
                       ("exp-n32k256-w2-st2", (3,))):
    _kind, _det, _tile = DOWN[_name]
    for _s in _splits:
        DOWN[f"{_name}-s{_s}"] = (_kind, _det, replace(_tile, split_k=_s))
# Device run 52 timed the pointer-load down with a register cap (replace(tile, max_regs=176): 5 programs of 2 warps
# per SM on sm_90 instead of 4): 0.95-1.05x, not kept; it spills on sm_120, where every candidate here must compile
# clean, so it is not a candidate.
# Device run 42: every split was slower (s2 5-30 %, s3 / s4 up to 2x): more programs add their prologue and epilogue
# (routing, addresses, the pipeline's first loads; the atomics of the whole [rows, 16] tile) to an issue-bound
# kernel.  The other way: more rows per program, each prologue and each activation fragment shared by more rows.
# (128 rows over 4 warps with the shift decode is a wgmma on sm_90, which the shift decode cannot feed: refused by
# DecodeTile.check_rows since run 43 found its sums wrong; 64 rows per warp, and 128 rows by TMA, spill registers on
# sm_120.)  One warp over 64 stacked gate_up rows: each activation fragment shared by 64 rows.
GATE_UP["gu-n32k128-w1-st3-shift"] = DecodeTile(32, 128, 16, num_warps=1, num_stages=3, use_dot=True,
                                                shift_decode=True)
# One launch for the whole layer (kernels/moe_decode_fused.py): "<down>-fused" is that down tile as the down items
# of the fused kernel, paired in --pairs with a gate_up tile of the same num_warps (pairs only: there is no down
# kernel to time alone).  The pointer-load downs of the table, one with four warps over K for the T = 1 gate_up
# tile (4 warps), and one warp over 32 rows for the one-warp wide gate_up.
DOWN["exp-n64k256-kw4-st2-shift"] = ("expert", False, DecodeTile(64, 256, 16, num_warps=4, num_stages=2,
                                                                 use_dot=True, k_warps=4, shift_decode=True))
DOWN["exp-n32k128-w1-st3-shift"] = ("expert", False, DecodeTile(32, 128, 16, num_warps=1, num_stages=3,
                                                                use_dot=True, shift_decode=True))
DOWN["exp-n32k256-kw4-st2-shift"] = ("expert", False, DecodeTile(32, 256, 16, num_warps=4, num_stages=2,
                                                                 use_dot=True, k_warps=4, shift_decode=True))
DOWN["exp-n32k256-w2-st2-shift"] = ("expert", False, DecodeTile(32, 256, 16, num_warps=2, num_stages=2,
                                                                use_dot=True, shift_decode=True))
for _name in ("exp-n64k256-w2-st2-shift", "exp-n64k256-kw4-st2-shift", "exp-n32k256-kw4-st2-shift",
              "exp-n32k128-w1-st3-shift"):
    DOWN[_name + "-fused"] = ("fused", True, DOWN[_name][2])
# The fused kernel holds both kinds of item, and its register count is the larger of the two.  Without a cap the
# compiler gives the T >= 3 pairs 168-186 registers and spills 8-168 bytes (sm_90 and sm_120): the grid row of a
# gate_up item lives across its whole body, and the 64-row pointer-load down alone takes 255.  Capped at 248
# ("-r248", both tiles) they take 217-248 without spilling: 4 programs of 2 warps per SM, fewer than the gate_up
# kernel alone holds.  (Caps of 128-144 on the T = 1 pairs, for 4 programs of 4 warps, spill 24-96 bytes on sm_120.)
for _name in ("gu-n32k128-w2-st3-shift",):
    GATE_UP[_name + "-r248"] = replace(GATE_UP[_name], max_regs=248)
for _name in ("exp-n64k256-w2-st2-shift", "exp-n32k256-w2-st2-shift"):
    DOWN[_name + "-r248-fused"] = ("fused", True, replace(DOWN[_name][2], max_regs=248))
# The fused pairs (--pairs GATE_UP+DOWN), named by the table row they would replace: the T = 1 row's gate_up (4
# warps over K), the T = 2 row's, the T >= 3 row's, the wide gate_up of H = 7168; each compiles without local
# memory for sm_90 and sm_120 (test_moe_decode_fused.py).
FUSED_PAIRS = {
    "t1": ("gu-n16k256-kw4-st3-shift", "exp-n32k256-kw4-st2-shift-fused"),
    "t1-n64": ("gu-n16k256-kw4-st3-shift", "exp-n64k256-kw4-st2-shift-fused"),
    "t2": ("gu-n16k128-w2-st3", "exp-n64k256-w2-st2-shift-fused"),
    "t4": ("gu-n32k128-w2-st3-shift-r248", "exp-n64k256-w2-st2-shift-r248-fused"),
    "t4-n32": ("gu-n32k128-w2-st3-shift-r248", "exp-n32k256-w2-st2-shift-r248-fused"),
    "wide": ("gu-n32k128-w1-st3-shift", "exp-n32k128-w1-st3-shift-fused"),
}
# The table's gate_up tiles with the down prefetch ("-pfd": each program first asks L2 for its share of its expert's
# down rows).  The decode loop streams at ~2 TB/s of the H200's ~4.4 (issue-bound), so the down's bytes can come in
# during the gate_up kernel and the down kernel read L2; where the touched experts' down bytes outgrow L2 the
# prefetched lines are evicted by the gate_up stream before use.  A layer shows it (--pairs); timed alone, such a
# tile only adds the prefetch's traffic.  Device run 57 (H100): 1.01-1.26x slower than the same pairs without it on
# every shape at T = 1-16 (docs/benchmarks.md); kept for an sm_120 run.
for _name in ("gu-n16k256-kw4-st3-shift", "gu-n16k128-w2-st3", "gu-n32k128-w2-st3-shift", "gu-n32k128-w1-st3-shift"):
    GATE_UP[_name + "-pfd"] = replace(GATE_UP[_name], prefetch_down=True)
ANY_GATE_UP = GATE_UP | STREAM_GATE_UP  # after every GATE_UP entry above
# The streaming Gluon down (the same kernel's down mode: routing weight and top-k sum by fp32 atomics into a
# workspace the gate_up kernel zeroes, the last of a token's experts casting its row tile; T <= block_t only).
# sm_90 registers with an expert map: 32 x 8 168, 16 x 8 148 (3 CTAs per SM either way); two warps over K as in the
# gate_up: 201 (2 CTAs of 4 warps, 5 of 2).
STREAM_DOWN = {
    "dns-m32t8": ("expert", False, MoeStreamTile(32, 8, ctas_per_sm=3)),
    "dns-m16t8": ("expert", False, MoeStreamTile(16, 8, ctas_per_sm=3)),
    "dns-m64t8-rw2": ("expert", False, MoeStreamTile(64, 8, num_warps=4, row_warps=2, ctas_per_sm=2)),
    "dns-m32t8-w2": ("expert", False, MoeStreamTile(32, 8, num_warps=2, ctas_per_sm=5)),
}
# The cast by the last CTA ("-lc"): each run's products go straight into the sums by atomic adds, with no partial
# sums for shared row tiles and no count per token and tile; one arrival per CTA, and the last casts all [T, H].
# A run of the down is 4-16 blocks of 128 (K = I), so the chain of dependent L2 round trips after each run (the
# count, then the sum load) is a large part of it.
# (16 x 8 with it uses 8 bytes of stack on sm_120, and 16 x 8 lost to the others in runs 66-67: not a candidate.)
for _name in ("dns-m32t8", "dns-m64t8-rw2"):
    _kind, _det, _tile = STREAM_DOWN[_name]
    STREAM_DOWN[f"{_name}-lc"] = (_kind, _det, replace(_tile, late_cast=True))
# Up to 16 routes per expert (T = 9-16, where the table runs Triton downs): 187 registers on sm_120, 173 on sm_90
# (220 without the option), so 2 CTAs per SM.
STREAM_DOWN["dns-m32t16-lc"] = ("expert", False, MoeStreamTile(32, 16, ctas_per_sm=2, late_cast=True))
# The late cast keeps no partial sums or per-token counts live: capped at 128 registers it compiles without stack on
# sm_90 and sm_120 (124-126 registers), so 4 CTAs per SM ("-c4"; the plain streaming down spills under that cap).
for _name in ("dns-m32t8-lc", "dns-m64t8-rw2-lc"):
    _kind, _det, _tile = STREAM_DOWN[_name]
    STREAM_DOWN[f"{_name}-c4"] = (_kind, _det, replace(_tile, max_regs=128, ctas_per_sm=4))
# The late cast with the runs overlapped (see "-ov" above): at most 168 registers, 3 CTAs per SM, no stack.
for _name in ("dns-m32t8-lc", "dns-m64t8-rw2-lc"):
    _kind, _det, _tile = STREAM_DOWN[_name]
    STREAM_DOWN[f"{_name}-ov"] = (_kind, _det, replace(_tile, overlap_runs=True, max_regs=168, ctas_per_sm=3))
ANY_DOWN = DOWN | STREAM_DOWN  # after every DOWN entry above
# What a run sweeps without --gate-up / --down (about ten kernel tiles: each compiles once per routing bucket, and
# the compiles are most of the ~4 minutes); the others are there for a focused second run.
DEFAULT_GATE_UP = ("gu-n16k256-w2-tma", "gu-n16k512-w2-tma", "gu-n8k256-w1-tma", "gu-n32k256-w4-tma",
                   "gu-n16k256-w4-fma")
DEFAULT_DOWN = ("tok-n16k256-w1", "tok-n16k256-w1-pdl", "exp-n16k256-w1-tma", "exp-n16k256-w1-tma-pdl",
                "exp-n32k256-w2-tma", "exp-n32k256-w2-tma-det")
# The pair every gate_up candidate is checked with, and every down candidate with.
CHECK_GATE_UP = "gu-n16k256-w2-tma"
CHECK_DOWN = "tok-n16k256-w1"


def candidate_ok(tile, k: int, t: int | None = None) -> bool:
    """Whether a candidate can run on a bank with reduction size ``k`` (TMA needs K % 256 == 0) and, given ``t``, a
    call of ``t`` tokens (the streaming gate_up takes at most ``block_t``)."""
    if isinstance(tile, MoeStreamTile):
        return t is None or t <= tile.block_t
    return not tile.use_tma or tma_ok(k)


# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _empty_kernel(x_ptr):
    pass


# The read ceiling of a decode layer: two dependent launches that only read the codes and scales of the experts a
# call routes to (gate_up bank, then down bank; xor-ed as 32-bit words, no decode), each expert once.  The distinct
# experts are found on the host before capture: a measuring device, not a product path.  What separates it from the
# floor is what any two-kernel decode layer pays (first bytes' latency, each launch's tail, the launch between).
@triton.jit
def _read_experts_kernel(w_ptr, s_ptr, ids_ptr, out_ptr, ROWS, WORDS, SWORDS,
                         BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program (expert slot, row tile) xors rows [pid_r * BLOCK_M, ...) of expert ids[slot]: codes then scales."""
    slot, pid_r = tl.program_id(0), tl.program_id(1)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    rows = (pid_r * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    keep = (rows < ROWS)[:, None]  # rows past the bank's read nothing (the expected xor is the experts' alone)
    cols = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_M, BLOCK_W], dtype=tl.int32)
    base = w_ptr + (expert * ROWS + rows[:, None]) * WORDS
    for w0 in range(0, WORDS, BLOCK_W):
        acc ^= tl.load(base + w0 + cols[None, :], mask=keep & ((w0 + cols)[None, :] < WORDS), other=0)
    base = s_ptr + (expert * ROWS + rows[:, None]) * SWORDS
    for s0 in range(0, SWORDS, BLOCK_W):
        acc ^= tl.load(base + s0 + cols[None, :], mask=keep & ((s0 + cols)[None, :] < SWORDS), other=0)
    tl.store(out_ptr + slot * tl.num_programs(1) + pid_r, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def read_experts(codes, scales, ids, out, block_m=16, block_w=64):
    """xor per (expert of ``ids``, row tile) of a bank's codes ``[E, rows, K/2]`` and scales ``[E, rows, K/16]``
    as 32-bit words into ``out`` (``len(ids) * cdiv(rows, block_m)`` int32)."""
    e, rows, kh = codes.shape
    c = codes.view(torch.int32).reshape(e, rows, kh // 4)
    s = scales.view(torch.uint8).view(torch.int32).reshape(e, rows, -1)
    grid = (ids.numel(), triton.cdiv(rows, block_m))
    _read_experts_kernel[grid](c, s, ids, out, rows, c.shape[-1], s.shape[-1], BLOCK_M=block_m, BLOCK_W=block_w,
                               num_warps=4)
    return out


def read_experts_out(codes, ids, block_m=16) -> torch.Tensor:
    """The ``out`` of :func:`read_experts`: one int32 per (expert of ``ids``, row tile)."""
    return torch.empty(ids.numel() * triton.cdiv(codes.shape[1], block_m), dtype=torch.int32, device=codes.device)


def read_experts_expected(codes, scales, ids) -> int:
    """What :func:`read_experts` computes over all its programs, in torch."""
    sel = ids.long()
    c, s = codes[sel], scales[sel]
    return xor_words(c.view(torch.int32)) ^ xor_words(s.view(torch.uint8).view(torch.int32))


READ_CEILING_TILES = ((16, 64), (32, 64), (16, 128))  # (rows, words) per program: the best is the ceiling


def _bank(e: int, rows: int, k: int, gen: torch.Generator, device):
    """Random codes (all bytes), e4m3 scales 2^u (1 + m/8) with u in [-3, 1], decode globals ~ 0.005."""
    codes = torch.randint(0, 256, (e, rows, k // 2), dtype=torch.uint8, device=device, generator=gen)
    exp = torch.randint(-3, 2, (e, rows, k // 16), device=device, generator=gen).float()
    mant = torch.randint(0, 8, (e, rows, k // 16), device=device, generator=gen).float()
    scales = (torch.exp2(exp) * (1 + mant / 8)).to(torch.float8_e4m3fn)
    dec = 0.004 + 0.002 * torch.rand(e, device=device, generator=gen)
    return codes, scales, dec


def _routing(t: int, e: int, k: int, gen: torch.Generator, device):
    logits = torch.randn(t, e, device=device, generator=gen)
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).float().contiguous(), ids.to(torch.int32).contiguous()


def _close(out, ref) -> tuple[bool, float]:
    """Same tolerance as the GPU tests (fp32 summation order and the rounding of the 16-bit intermediate)."""
    scale = float(ref.float().abs().max()) if ref.numel() else 0.0
    err = float((out.float() - ref.float()).abs().max()) if ref.numel() else 0.0
    ok = torch.allclose(out.float(), ref.float(), atol=2.0**-8 * scale, rtol=2.0**-7)
    return ok, err / scale if scale else err


class _Clock:
    """The bench method on a GPU (CUDA graph of the calls, median of replays, DRAM read ceiling in the same run);
    on the CPU (the interpreter smoke test) wall time and no ceiling."""

    def __init__(self, device, repeats: int):
        self.cuda = device.type == "cuda"
        self.repeats = repeats
        if self.cuda:
            from vllm_nvfp4_sm120.bench import dram_read_tbs, time_graph

            self._time_graph = time_graph
            self.read_tbs = dram_read_tbs()
        else:
            self.read_tbs = float("nan")

    def seconds(self, fn) -> float:
        if self.cuda:
            return self._time_graph(fn, self.repeats)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def empty_launch_us(self) -> dict:
        if not self.cuda:
            return {}
        buf = torch.empty(1, device="cuda")
        pair = lambda: (_empty_kernel[(1,)](buf), _empty_kernel[(1,)](buf))  # noqa: E731
        one = self.seconds(pair)
        many = self.seconds(lambda: [pair() for _ in range(50)]) / 50
        return {"graph_of_two_empty_kernels_us": one * 1e6, "two_empty_kernels_in_a_long_graph_us": many * 1e6}


def _today():
    try:
        from vllm_nvfp4_sm120.dispatch.moe_flow import nvfp4_moe
    except ImportError as exc:  # the dispatch layer is being restructured: the sweep still runs without it
        print(f"# today's path unavailable: {exc}", flush=True)
        return None
    return nvfp4_moe


def candidate_names(gate_up: str, down: str) -> tuple[list[str], list[str]]:
    """The tiles ``--gate-up`` / ``--down`` time alone: the names given, the defaults when empty, or ``all``.  The
    fused kernel's down items have no kernel of their own, so ``all`` leaves them to ``--pairs``."""
    gate_names = list(ANY_GATE_UP) if gate_up == "all" else gate_up.split(",") if gate_up else list(DEFAULT_GATE_UP)
    if down == "all":
        down_names = [n for n, (kind, _det, _tile) in ANY_DOWN.items() if kind != "fused"]
    else:
        down_names = down.split(",") if down else list(DEFAULT_DOWN)
    return gate_names, down_names


def sweep(args) -> dict:
    from vllm_nvfp4_sm120.format import NvFp4, moe_ref

    device = torch.device(args.device)
    t_start = time.time()
    clock = _Clock(device, args.repeats)
    bw = clock.read_tbs
    empty = clock.empty_launch_us()
    nvfp4_moe = None if args.no_baseline else _today()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)"
    print(f"# {name}  torch {torch.__version__}  DRAM read {bw:.2f} TB/s  empty launches {empty}", flush=True)
    gate_names, down_names = candidate_names(args.gate_up, args.down)
    pairs = [tuple(pair.split("+")) for pair in args.pairs.split(",")] if args.pairs else []
    for pair in pairs:
        if len(pair) != 2 or pair[0] not in ANY_GATE_UP or pair[1] not in ANY_DOWN:
            raise SystemExit(f"--pairs: expected GATE_UP+DOWN names, got {'+'.join(pair)!r}")
        if ANY_DOWN[pair[1]][0] == "fused":
            if pair[0] in STREAM_GATE_UP:
                raise SystemExit(f"--pairs {'+'.join(pair)}: the fused kernel has no streaming gate_up")
            try:
                check_fused_tiles(GATE_UP[pair[0]], DOWN[pair[1]][2])
            except ValueError as exc:
                raise SystemExit(f"--pairs {'+'.join(pair)}: {exc}") from None
    fused = [n for n in down_names if n in DOWN and DOWN[n][0] == "fused"]
    if fused:
        raise SystemExit(f"--down: {fused} are the fused kernel's down items: time them in --pairs")
    if pairs and not args.gate_up and not args.down:  # only the pairs: no tile timed alone
        gate_names, down_names = [], []
    loads_probe = tuple(args.loads_probe.split(",")) if args.loads_probe else None
    if loads_probe and (len(loads_probe) != 2 or loads_probe[0] not in STREAM_GATE_UP
                        or loads_probe[1] not in STREAM_DOWN):
        raise SystemExit(f"--loads-probe: expected GATE_UP,DOWN of {list(STREAM_GATE_UP)} and {list(STREAM_DOWN)}, "
                         f"got {args.loads_probe!r}")
    rows = []
    for shape in args.shapes.split(","):
        h, i, e, k = (SHAPES | EXTRA_SHAPES)[shape]
        expert_bytes = 2 * i * h * 9 // 16 + h * i * 9 // 16  # codes (1/2 byte) + scales (1/16 byte) per weight
        copies = 16 if args.warm else max(2, min(16, math.ceil(args.min_bytes / (k * expert_bytes))))
        gen = torch.Generator(device=device).manual_seed(0)
        if args.warm:  # one bank (and below one routing) in every call of the graph
            banks = [(_bank(e, 2 * i, h, gen, device), _bank(e, h, i, gen, device))] * copies
        else:
            banks = [(_bank(e, 2 * i, h, gen, device), _bank(e, h, i, gen, device)) for _ in range(copies)]
        print(f"# {shape}: H={h} I={i} E={e} top_k={k}, {copies} calls on "
              f"{'one bank (warm)' if args.warm else f'{copies} bank copies'} "
              f"({len({id(b) for b in banks}) * e * expert_bytes / 1e9:.1f} GB)", flush=True)
        gates = {n: ANY_GATE_UP[n] for n in gate_names if candidate_ok(ANY_GATE_UP[n], h)}
        downs = {n: ANY_DOWN[n] for n in down_names if candidate_ok(ANY_DOWN[n][2], i)}
        layers = [p for p in pairs if candidate_ok(ANY_GATE_UP[p[0]], h) and candidate_ok(ANY_DOWN[p[1]][2], i)]
        for t in [int(v) for v in args.tokens.split(",")]:
            rows.append(_point(shape, t, h, i, e, k, banks, gates, downs, gen, device, clock, moe_ref, NvFp4,
                               nvfp4_moe, layers, args.read_ceiling, loads_probe))
            print(_fmt(rows[-1]), flush=True)
        del banks
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"device": name, "torch": torch.__version__, "dram_read_tbs": bw, "empty_launch": empty,
            "seconds": time.time() - t_start, "rows": rows}


def _point(shape, t, h, i, e, k, banks, gates, downs, gen, device, clock, moe_ref, NvFp4, nvfp4_moe,
           pairs=(), read_ceiling=False, loads_probe=None) -> dict:
    """One (shape, T): check every candidate, time gate_up and down candidates alone, the best pair, the given
    ``pairs`` as layers, today's path, with ``read_ceiling`` the two reading launches of the touched experts, and
    with ``loads_probe`` (streaming gate_up and down names) the two streaming walks with their loads alone."""
    copies = len(banks)
    warm = all(b is banks[0] for b in banks)  # --warm: the same experts in every call, in L2 where they fit
    routes = [_routing(t, e, k, gen, device)] * copies if warm else [_routing(t, e, k, gen, device)
                                                                     for _ in range(copies)]
    x = torch.randn(t, h, device=device, generator=gen).to(torch.bfloat16 if device.type == "cuda" else torch.float16)
    touched = [int(torch.unique(ti).numel()) for _, ti in routes]
    expert_bytes = 2 * i * h * 9 // 16 + h * i * 9 // 16
    floor_us = sum(touched) / copies * expert_bytes / (clock.read_tbs * 1e12) * 1e6
    (c13, s13, d13), (c2, s2, d2) = banks[0]
    ref = moe_ref(x, NvFp4(c13, s13), d13, NvFp4(c2, s2), d2, *routes[0])
    row = {"shape": shape, "H": h, "I": i, "E": e, "top_k": k, "T": t, "experts_touched": sum(touched) / copies,
           "floor_us": floor_us, "dram_read_tbs": clock.read_tbs, "copies": copies, "gate_up_us": {}, "down_us": {},
           "errors": {}, "failed": [], "pairs_us": {}}

    controls = {}  # the fused kernel's control block per down tile: zero before the first call, left zero

    def layer(gname, dname, c, out=None):
        (c13, s13, d13), (c2, s2, d2) = banks[c]
        kind, det, dtile = ANY_DOWN[dname]
        tw, ti = routes[c]
        if kind == "fused":
            if dname not in controls:
                controls[dname] = fused_workspace(t, k, e, h, dtile, device)
            return moe_decode_fused(x, c13, s13, d13, c2, s2, d2, tw, ti, gate_up_tile=GATE_UP[gname],
                                    down_tile=dtile, control=controls[dname], out=out)
        return moe_decode(x, c13, s13, d13, c2, s2, d2, tw, ti, gate_up_tile=ANY_GATE_UP[gname], down_tile=dtile,
                          down=kind, deterministic=det, out=out)

    def check(name, gname, dname) -> bool:
        ok, err = _close(layer(gname, dname, 0), ref)
        row["errors"][name] = err
        if not ok:
            row["failed"].append(name)
            print(f"  FAIL {shape} T={t} {name}: max error {err:.3g} of max |ref|", flush=True)
        return ok

    if read_ceiling:
        _read_ceiling(row, banks, routes, clock)
    if loads_probe and device.type == "cuda" and t <= min(STREAM_GATE_UP[loads_probe[0]].block_t,
                                                          STREAM_DOWN[loads_probe[1]][2].block_t):
        _loads_probe(row, banks, routes, x, loads_probe, clock)
    out = torch.empty_like(x)
    for gname, dname in pairs:  # whole layers: what a programmatic dependent down kernel gains shows only here
        if not candidate_ok(ANY_GATE_UP[gname], h, t) or not candidate_ok(ANY_DOWN[dname][2], i, t):
            continue
        name = f"{gname}+{dname}"
        if check(name, gname, dname):
            row["pairs_us"][name] = clock.seconds(
                lambda: [layer(gname, dname, c, out) for c in range(copies)]) / copies * 1e6
    check_g = CHECK_GATE_UP if CHECK_GATE_UP in gates else next(
        (n for n, g in gates.items() if isinstance(g, DecodeTile)), CHECK_GATE_UP)
    check_d = CHECK_DOWN if CHECK_DOWN in downs else next(
        (n for n, d in downs.items() if isinstance(d[2], DecodeTile)), CHECK_DOWN)
    for gname, tile in gates.items():  # gate_up alone
        if not candidate_ok(tile, h, t):
            continue
        if check(gname, gname, check_d):
            def gate_calls(tile=tile):
                for c in range(copies):
                    decode_gate_up(x, *banks[c][0], routes[c][1], tile=tile, down_bank=banks[c][1])

            row["gate_up_us"][gname] = clock.seconds(gate_calls) / copies * 1e6
    inters = ([moe_decode_gate_up(x, *banks[c][0], routes[c][1], tile=GATE_UP[check_g], down_bank=banks[c][1])
               for c in range(copies)] if downs else [])
    for dname, (kind, det, dtile) in downs.items():  # down alone
        if not candidate_ok(dtile, i, t) or not check(dname, check_g, dname):
            continue
        out = torch.empty_like(x)
        # Atomic mode alone: the workspace is not re-zeroed between replays (in the layer the gate_up kernel does
        # it), so the tile counts overshoot and the final casts are skipped: a few KB less traffic.
        wss = [(torch.zeros(down_workspace_numel(t, h, dtile), device=device) if isinstance(dtile, MoeStreamTile)
                else down_expert_workspace(t, k, h, dtile, det, device).zero_()) for _ in range(copies)]

        def down_calls(kind=kind, det=det, dtile=dtile, wss=wss, out=out):
            for c in range(copies):
                _, (c2, s2, d2) = banks[c]
                tw, ti = routes[c]
                if isinstance(dtile, MoeStreamTile):
                    moe_stream_down(inters[c], c2, s2, d2, ti, tw, wss[c], tile=dtile, out=out)
                elif kind == "token":
                    moe_decode_down_token(inters[c], c2, s2, d2, ti, tw, tile=dtile, out=out)
                else:
                    moe_decode_down_expert(inters[c], c2, s2, d2, ti, tw, wss[c], tile=dtile, deterministic=det,
                                           out=out)

        row["down_us"][dname] = clock.seconds(down_calls) / copies * 1e6
    if row["gate_up_us"] and row["down_us"]:
        best_g = min(row["gate_up_us"], key=row["gate_up_us"].get)
        best_d = min(row["down_us"], key=row["down_us"].get)
        row["best"] = f"{best_g} + {best_d}"
        row["best_us"] = clock.seconds(lambda: [layer(best_g, best_d, c, out) for c in range(copies)]) / copies * 1e6
        row["fraction_of_floor"] = floor_us / row["best_us"]
        reproducible = [n for n in row["down_us"] if downs[n][0] == "token" or downs[n][1]]
        if reproducible:  # the best bit-reproducible layer (token-major or deterministic expert-major down)
            det_d = min(reproducible, key=row["down_us"].get)
            row["best_deterministic"] = f"{best_g} + {det_d}"
            row["best_deterministic_us"] = clock.seconds(
                lambda: [layer(best_g, det_d, c, out) for c in range(copies)]) / copies * 1e6
    if nvfp4_moe is not None:
        def today():
            for c in range(copies):
                (c13, s13, d13), (c2, s2, d2) = banks[c]
                nvfp4_moe(x, c13, s13, d13, c2, s2, d2, *routes[c], out=out)

        row["today_us"] = clock.seconds(today) / copies * 1e6
        if "best_us" in row:
            row["speedup_vs_today"] = row["today_us"] / row["best_us"]
    return row


def _read_ceiling(row: dict, banks, routes, clock) -> None:
    """The read ceiling of :func:`read_experts` (gate_up bank, then down bank) on each call's distinct experts, its
    xor checked on the first call; the best of READ_CEILING_TILES into ``row``."""
    ids = [torch.unique(ti).to(torch.int32) for _, ti in routes]
    for bm, bw in READ_CEILING_TILES:
        outs = [(read_experts_out(b13[0], ids[c], bm), read_experts_out(b2[0], ids[c], bm))
                for c, (b13, b2) in enumerate(banks)]

        def calls(bm=bm, bw=bw, outs=outs):
            for c, (b13, b2) in enumerate(banks):
                read_experts(b13[0], b13[1], ids[c], outs[c][0], bm, bw)
                read_experts(b2[0], b2[1], ids[c], outs[c][1], bm, bw)

        calls()
        (b13, b2), (o13, o2) = banks[0], outs[0]
        if (xor_words(o13) != read_experts_expected(b13[0], b13[1], ids[0])
                or xor_words(o2) != read_experts_expected(b2[0], b2[1], ids[0])):
            row["failed"].append(f"read ceiling {bm}x{bw}")
            continue
        us = clock.seconds(calls) / len(banks) * 1e6
        if "read_ceiling_us" not in row or us < row["read_ceiling_us"]:
            row["read_ceiling_us"], row["read_ceiling_tile"] = us, f"{bm} rows x {bw} words"


def _loads_probe(row: dict, banks, routes, x, names, clock) -> None:
    """The streaming gate_up's and down's walks over each call's routed experts with their loads alone
    (``stream_loads_probe.moe_stream_loads``), each checked on the first call, then timed alone and as a pair, and
    the pair without the cross-CTA sums (unchecked): into ``row["loads_probe_us"]``."""
    gate_tile, down_tile = STREAM_GATE_UP[names[0]], STREAM_DOWN[names[1]][2]
    t, k = routes[0][1].shape
    inter = torch.randn(t * k, banks[0][1][0].shape[2] * 2, device=x.device).to(torch.bfloat16)
    xs = x.to(torch.bfloat16)
    counters = {}

    def launch(c, down, sums=True):
        bank = banks[c][1] if down else banks[c][0]
        tile = down_tile if down else gate_tile
        key = (down, sums)
        if key not in counters:  # one count per list tile, left zero by each call
            counters[key] = torch.zeros(max(1, min(t * k, bank[0].shape[0])) * bank[0].shape[1], dtype=torch.int32,
                                        device=x.device)
        return moe_stream_loads(inter if down else xs, bank[0], bank[1], routes[c][1], tile=tile,
                                ctas=tile.ctas(x.device), down=down, sums=sums, counters=counters[key])

    for down in (False, True):
        bank = banks[0][1] if down else banks[0][0]
        tile = down_tile if down else gate_tile
        want = moe_stream_loads_expected(inter if down else xs, bank[0], bank[1], routes[0][1], tile, down)
        got = launch(0, down)[:want.numel()]
        if not torch.equal(got, want):
            row["failed"].append(f"loads probe {names[1] if down else names[0]}")
            print(f"  FAIL loads probe {'down' if down else 'gate_up'}: {int((got != want).sum())} of "
                  f"{want.numel()} list tiles differ", flush=True)
            return
    copies = len(banks)
    row["loads_probe_us"] = {
        f"gate_up {names[0]}": clock.seconds(lambda: [launch(c, False) for c in range(copies)]) / copies * 1e6,
        f"down {names[1]}": clock.seconds(lambda: [launch(c, True) for c in range(copies)]) / copies * 1e6,
        "pair": clock.seconds(lambda: [(launch(c, False), launch(c, True)) for c in range(copies)]) / copies * 1e6,
        "pair without the cross-CTA sums": clock.seconds(
            lambda: [(launch(c, False, False), launch(c, True, False)) for c in range(copies)]) / copies * 1e6,
    }


def _fmt(r: dict) -> str:
    best = f"{r['best_us']:8.1f}" if "best_us" in r else "     n/a"
    frac = f"{r['fraction_of_floor']:5.2f}" if "fraction_of_floor" in r else "  n/a"
    today = f"{r['today_us']:8.1f}" if "today_us" in r else "     n/a"
    speed = f"{r['speedup_vs_today']:5.2f}x" if "speedup_vs_today" in r else "   n/a"
    det = f"{r['best_deterministic_us']:8.1f}" if "best_deterministic_us" in r else "     n/a"
    pairs = "".join(f"\n    {name}: {us:.1f} us ({r['floor_us'] / us:.2f} of floor)"
                    for name, us in r.get("pairs_us", {}).items())
    return (f"{r['shape']:16} T={r['T']:3} experts {r['experts_touched']:6.1f} floor {r['floor_us']:7.1f} us | "
            f"best {best} us ({frac} of floor) det {det} | today {today} us {speed} | {r.get('best', '-')}"
            + (f"\n    read ceiling (two launches, {r['read_ceiling_tile']}): {r['read_ceiling_us']:.1f} us "
               f"({r['floor_us'] / r['read_ceiling_us']:.2f} of floor)" if "read_ceiling_us" in r else "")
            + "".join(f"\n    loads probe, {name}: {us:.1f} us ({r['floor_us'] / us:.2f} of floor)"
                      for name, us in r.get("loads_probe_us", {}).items())
            + pairs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for moe_decode.json")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--gate-up", default="", help=f"'all' or names of {list(ANY_GATE_UP)} (default {DEFAULT_GATE_UP})")
    p.add_argument("--down", default="", help=f"'all' (every down but the fused items) or names of {list(ANY_DOWN)} "
                                              f"(default {DEFAULT_DOWN})")
    p.add_argument("--pairs", default="", help="GATE_UP+DOWN names, comma-separated: each timed as a whole layer "
                                               "(alone unless --gate-up / --down are given too)")
    p.add_argument("--min-bytes", type=float, default=4e8, help="bytes the bank copies of one graph must touch")
    p.add_argument("--warm", action="store_true",
                   help="every call of the graph on one bank with one routing: the touched experts stay in L2 where "
                        "they fit (the kernels' time without DRAM; a diagnostic, not the floor's measurement)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no-baseline", action="store_true", help="skip today's path")
    p.add_argument("--read-ceiling", action="store_true",
                   help="also time two launches that only read the touched experts' bytes (the ceiling of a "
                        "two-kernel decode layer; checked by the xor of every word read)")
    p.add_argument("--loads-probe", default="", metavar="GATE_UP,DOWN",
                   help="also time the streaming gate_up's and down's walks with their loads alone (names of the "
                        "streaming candidates; stream_loads_probe.py), checked exactly first")
    p.add_argument("--list", action="store_true", help="print the candidates and exit")
    p.add_argument("--device", default="cuda", help="cuda; cpu runs the interpreter (a smoke test, no timing)")
    args = p.parse_args(argv)
    if args.list:
        for n, tile in ANY_GATE_UP.items():
            print("gate_up", n, tile)
        for n, (kind, det, tile) in ANY_DOWN.items():
            print("down", n, kind, "deterministic" if det else "", tile)
        return
    result = sweep(args)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "moe_decode.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"\n# {len(result['rows'])} rows in {result['seconds']:.0f} s -> {path}; DRAM read "
          f"{result['dram_read_tbs']:.2f} TB/s; empty launches {result['empty_launch']}")
    for r in result["rows"]:
        print(_fmt(r))


if __name__ == "__main__":
    main()
