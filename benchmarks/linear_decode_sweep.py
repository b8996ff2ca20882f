"""W4A16 linear decode (T <= 16) on the GPU present: our kernels against the read ceiling, cuBLAS and gemlite.

    source .carry/env.sh && source .carry/peers.sh && python benchmarks/linear_decode_sweep.py --out $OUT

For the eight Qwen3-32B / Llama-3.3-70B linears and each T, every candidate is first checked against
``format.linear_w4a16_ref`` on the GPU (a failing candidate is reported and not timed), then timed with the bench
method (``vllm_nvfp4_sm120.bench.time_graph``: the weight replicated to >= --min-bytes so every call reads DRAM,
one CUDA graph over all copies, median of --repeats replays).  TB/s = codes + scales bytes per second (the bf16
weight for cuBLAS); ``frac`` = that over the DRAM read bandwidth measured in the same run.

Candidates (``--candidates`` keeps those whose name contains one of the given substrings, or equals one that ends in
``$``):
  stream-plan         the streaming kernel with dispatch.gemv_stream_plan's tile and grid (the proposal)
  stream-<tile>...    every other tile of STREAM_TILES for that token block (``-32x8w4r1c128``: rows x tokens,
                      warps, row warps, register cap; ``...ov``: the runs overlapped), each on its one-wave grid;
                      the planned tile on half and twice that grid; the lop3/prmt decode (``-table``);
                      ``...-spill``: SPILL_PROBE_TILES, more CTAs per SM at caps that spill outside the loop;
                      ``...pf2``: two steps loaded ahead; ``...w8r1...``: WIDE_STEP_TILES, 8 warps over K;
                      ``stream-plan-nodecode``: the planned tile and grid with the decode left out
                      (gluon_gemv_stream.DECODE_COPY, a timing probe: its output is meaningless and not checked),
                      i.e. what the plan would take if its decode cost no instructions;
                      ``stream-plan-raw``: the same without the scale arithmetic too (gluon_gemv_stream.DECODE_RAW):
                      the plan's loads, MMAs, loop and cross-CTA sums alone
  stream-plan-loads   the plan's loads alone, on its grid, with its loop and cross-CTA sums (stream_loads_probe.py:
                      a mask and an add per loaded word instead of decode, scales and MMAs; checked exactly);
                      ``-nox``: without the activation loads (checked); ``-nosum``: without the cross-CTA sums
                      (unchecked, its output is not written): what the streaming pattern itself lets the bytes do
  stream-plan-rowtiles  the plan's tile on a grid of one CTA per row tile (several waves, no row tile shared by CTAs,
                      no cross-CTA sums: the read-only ceiling's grid), and ``stream-plan-loads-rowtiles``, the loads
                      probe on it: the plan's work and loads without the one-wave stream-K pattern
  stream-2x8          T > 8 as two 8-token tiles (two passes over the weight in one launch)
  gluon-today         gluon_gemv.gemv_fma / gemv_mma with the tile the dispatch routes today
  cublas-bf16         x @ W^T on the dequantized bf16 weight
  gemlite             gemlite's NVFP4 weight-only layer on the same codes and scales (when importable)
  read-only           a plain Triton kernel that only reads codes + scales (xor-ed as integers): the ceiling
                      of this access pattern, i.e. how fast the bytes can arrive
  read-only-w16/-w32  the same at 64 / 128 bytes of a row per load instruction (the streaming kernel's warps load
                      64 bytes of each of 8 rows per instruction): what the narrower pattern costs by itself
  read-only-tma       the same bytes through TMA boxes and a software pipeline (sm_90+; TMA_READ_CONFIGS): how
                      fast they can arrive when the bytes in flight live in shared memory, not registers
Compiles: K is a constexpr of gluon-today (one compile per K and tile, 30-70 s each at K = 25600 / 28672), so all
kernels are first compiled in --jobs parallel processes on small problems with the same constexprs (shared
Triton cache); the streaming kernel compiles once per tile.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_nvfp4_sm120.bench import MODELS, dram_read_tbs, time_graph, xor_words  # noqa: E402
from vllm_nvfp4_sm120.dispatch.gemv_stream_plan import ctas_per_sm, stream_plan, wave_ctas  # noqa: E402
from vllm_nvfp4_sm120.format import linear_w4a16_ref, random_nvfp4, unit_values  # noqa: E402
from vllm_nvfp4_sm120.kernels import gluon_gemv  # noqa: E402
from vllm_nvfp4_sm120.kernels import gluon_gemv_stream as gs  # noqa: E402
from stream_loads_probe import stream_loads, stream_loads_expected  # noqa: E402 (beside this script)
from vllm_nvfp4_sm120.peers import (  # noqa: E402
    check_gemlite,
    gemlite_config,
    gemlite_copies,
    gemlite_factory,
    gemlite_split_k_ref,
)

TOKENS = (1, 2, 4, 8, 16)
# (rows, words of 4 bytes, pipeline stages, programs per SM before the K split rounds): the TMA read ceiling's grid
TMA_READ_CONFIGS = tuple((bm, bw, st, waves) for bm in (32, 64, 128) for bw in (32, 64) for st in (3, 5)
                         for waves in (2, 4))
DEC = 0.0125  # one decode global for every row (gemlite takes one per layer)


# ---------------------------------------------------------------------------------------------------------------
# The read-only ceiling: the same bytes, rows x K, combined as 32-bit integers (xor: no decode, no overflow)
# ---------------------------------------------------------------------------------------------------------------
@triton.jit
def _read_only_kernel(w_ptr, s_ptr, out_ptr, N, WORDS, SWORDS, SPLIT_W, SPLIT_S,
                      BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program (row tile, split) xors its rows' code words [split * SPLIT_W, ...) and scale words likewise."""
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    rows = tl.minimum(pid_m * BLOCK_M + tl.arange(0, BLOCK_M), N - 1).to(tl.int64)
    cols = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_M, BLOCK_W], dtype=tl.int32)
    lo = pid_k * SPLIT_W
    for w0 in range(lo, tl.minimum(lo + SPLIT_W, WORDS), BLOCK_W):
        acc ^= tl.load(w_ptr + rows[:, None] * WORDS + (w0 + cols)[None, :], mask=(w0 + cols)[None, :] < WORDS,
                       other=0)
    lo = pid_k * SPLIT_S
    for s0 in range(lo, tl.minimum(lo + SPLIT_S, SWORDS), BLOCK_W):
        acc ^= tl.load(s_ptr + rows[:, None] * SWORDS + (s0 + cols)[None, :], mask=(s0 + cols)[None, :] < SWORDS,
                       other=0)
    tl.store(out_ptr + pid_m * tl.num_programs(1) + pid_k, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def read_only(codes, scales, out, block_m=32, block_w=128, split=1):
    """xor of the weight's bytes seen as 32-bit words, per program (rows past N re-read row N - 1, as our
    kernels do); the total is :func:`read_only_total` of ``out``."""
    n = codes.shape[0]
    words, swords = codes.shape[1] // 4, scales.shape[1] // 4
    split_w = triton.cdiv(triton.cdiv(words, split), block_w) * block_w
    split_s = triton.cdiv(triton.cdiv(swords, split), block_w) * block_w
    grid = (triton.cdiv(n, block_m), split)
    _read_only_kernel[grid](codes.view(torch.int32), scales.view(torch.uint8).view(torch.int32), out, n, words,
                            swords, split_w, split_s, BLOCK_M=block_m, BLOCK_W=block_w, num_warps=4)
    return out


# The read-only kernel's widths: 128 words (512 bytes of a row per load instruction, a warp on one row) is the
# ceiling; 16 words (64 bytes of each of 8 rows per instruction, 4 lanes per row) is how the streaming kernel's warps
# load (a step: 64 bytes of each row), 32 words between the two.  Same grids, same bytes.
READ_ONLY_WIDTHS = ((128, "read-only"), (32, "read-only-w32"), (16, "read-only-w16"))


# The same ceiling with the bytes brought in by TMA (sm_90+): boxes of [BLOCK_M rows, BLOCK_W words] into shared
# memory, NUM_STAGES of them in flight per program (Triton's software pipeliner), so the bytes a program keeps in
# flight no longer cost registers.  Rows past N read zeros (TMA fills out-of-bounds boxes), so the expected xor is the
# weight's alone.
@triton.jit
def _read_only_tma_kernel(w_desc, s_desc, out_ptr, WORDS, SWORDS, SPLIT_W, SPLIT_S,
                          BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, NUM_STAGES: tl.constexpr):
    pid_m, pid_k = tl.program_id(0), tl.program_id(1)
    row0 = pid_m * BLOCK_M
    acc = tl.zeros([BLOCK_M, BLOCK_W], dtype=tl.int32)
    lo = pid_k * SPLIT_W
    for w0 in tl.range(lo, tl.minimum(lo + SPLIT_W, WORDS), BLOCK_W, num_stages=NUM_STAGES):
        acc ^= w_desc.load([row0, w0])
    lo = pid_k * SPLIT_S
    for s0 in tl.range(lo, tl.minimum(lo + SPLIT_S, SWORDS), BLOCK_W, num_stages=NUM_STAGES):
        acc ^= s_desc.load([row0, s0])
    tl.store(out_ptr + pid_m * tl.num_programs(1) + pid_k, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def read_only_tma(codes, scales, out, block_m=128, block_w=32, split=1, num_stages=4):
    """:func:`read_only` through TMA descriptors (``block_w`` words of 4 bytes: 32 = one 128-byte swizzle row);
    rows past N contribute zeros, so the total is :func:`read_only_expected` with ``block_m=1``."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    n = codes.shape[0]
    c, s = codes.view(torch.int32), scales.view(torch.uint8).view(torch.int32)
    words, swords = c.shape[1], s.shape[1]
    split_w = triton.cdiv(triton.cdiv(words, split), block_w) * block_w
    split_s = triton.cdiv(triton.cdiv(swords, split), block_w) * block_w
    w_desc = TensorDescriptor.from_tensor(c, [block_m, block_w])
    s_desc = TensorDescriptor.from_tensor(s, [block_m, block_w])
    grid = (triton.cdiv(n, block_m), split)
    _read_only_tma_kernel[grid](w_desc, s_desc, out, words, swords, split_w, split_s, BLOCK_M=block_m,
                                BLOCK_W=block_w, NUM_STAGES=num_stages, num_warps=4)
    return out


def read_only_expected(codes, scales, block_m=32) -> int:
    """What read_only computes, in torch (the padded rows included: they re-read row N - 1)."""
    n = codes.shape[0]
    pad = (-n) % block_m
    c, s = codes.view(torch.int32), scales.view(torch.uint8).view(torch.int32)
    if pad:
        c, s = torch.cat([c, c[-1:].expand(pad, -1)]), torch.cat([s, s[-1:].expand(pad, -1)])
    return xor_words(c) ^ xor_words(s)


# ---------------------------------------------------------------------------------------------------------------
# Candidates: each a (name, spec); specs are plain tuples so the compile workers can rebuild them
# ---------------------------------------------------------------------------------------------------------------
# Sweep-only tiles below the caps that compile without spilling (the main loop keeps its instructions per code
# word; the spills are stack stores of values live across the loop): 5-8 CTAs of 4 warps per SM at T <= 8 instead of
# the listed tiles' 4-5, 4 at T = 16 instead of 3.
SPILL_PROBE_TILES = (
    gs.StreamTile(32, 8, max_regs=96), gs.StreamTile(32, 8, max_regs=80), gs.StreamTile(16, 8, max_regs=72),
    gs.StreamTile(16, 8, max_regs=64), gs.StreamTile(32, 16, max_regs=128),
)


# A sweep-only tile of 8 warps over K: each warp's step is the 4-warp plan tile's (the same loop, 117 registers on
# sm_90, no stack), but a CTA's step covers 512 bytes of each of its rows instead of 256; 16 warps per SM, as the plan.
# On an H100 (run 103) it was 1.02-1.08x the plan on Llama-3.3-70B's gate_up and down and 0.91-1.02x on the other
# twelve rows, so it is not listed.  (Its 16-row twin at 96 registers was 1.02-1.41x slower on every row and was
# dropped.)
WIDE_STEP_TILES = (gs.StreamTile(32, 8, 8, 1, max_regs=128),)


# A spec's grid that means "one CTA per row tile of the layer": each CTA's stream-K range is then exactly one row
# tile, so no tile is shared and no cross-CTA sum runs, in as many waves as the layer has row tiles.
ROW_TILE_GRID = 0


def grid_ctas(ctas: int, n: int, tile) -> int:
    """A spec's CTAs per token tile on a layer of ``n`` rows (:data:`ROW_TILE_GRID` resolved)."""
    return -(-n // tile.block_m) if ctas == ROW_TILE_GRID else ctas


def capped_wave_ctas(tile, t: int, sm: int) -> int:
    """The one-wave grid of a tile outside TILE_REGISTERS, from its register cap (an upper bound of its registers)."""
    return max(1, ctas_per_sm(tile.max_regs, tile.num_warps) * sm // -(-t // tile.block_t))


def stream_specs(t: int, sm: int, cc_major: int) -> list[tuple[str, tuple]]:
    plan = stream_plan(t, 0, 0, sm, cc_major)
    shift = gs.DECODE_SHIFT if cc_major < 10 else gs.DECODE_CVT
    out = [("stream-plan", ("stream", plan.tile, plan.ctas, shift))]
    if t > 8:
        two = gs.StreamTile(128, 8, 4, 2)
        out.append(("stream-2x8", ("stream", two, wave_ctas(two, t, sm, cc_major), shift)))
    # every other tile of the token block T needs, each on its one-wave grid
    for tile in gs.STREAM_TILES:
        if tile != plan.tile and tile.block_t == (8 if t <= 8 else 16):
            out.append((stream_name(tile), ("stream", tile, wave_ctas(tile, t, sm, cc_major), shift)))
    # Unlisted tiles, each on its cap's one-wave grid: the spill probes (more CTAs per SM than any listed tile, at
    # caps that spill a few values outside the main loop, which the compile proof refuses for the table: do more
    # warps per SM pay at all?) and the two-steps-ahead tiles (not listed: slower than the plan on most rows).
    for tiles, suffix in ((SPILL_PROBE_TILES, "-spill"), (gs.DEEP_PREFETCH_TILES, ""), (WIDE_STEP_TILES, "")):
        for tile in tiles:
            if tile.block_t == (8 if t <= 8 else 16):
                out.append((stream_name(tile) + suffix, ("stream", tile, capped_wave_ctas(tile, t, sm), shift)))
    # grid sensitivity (half and twice the one-wave grid) and the table decode, on the planned tile
    out.append(("stream-plan-half-grid", ("stream", plan.tile, max(1, plan.ctas // 2), shift)))
    out.append(("stream-plan-2waves", ("stream", plan.tile, 2 * plan.ctas, shift)))
    out.append(("stream-plan-nodecode", ("stream", plan.tile, plan.ctas, gs.DECODE_COPY)))
    out.append(("stream-plan-raw", ("stream", plan.tile, plan.ctas, gs.DECODE_RAW)))
    # The plan's loads alone on its grid (stream_loads_probe.py): ("loads", tile, ctas, activations, cross-CTA sums)
    out.append(("stream-plan-loads", ("loads", plan.tile, plan.ctas, True, True)))
    out.append(("stream-plan-loads-nox", ("loads", plan.tile, plan.ctas, False, True)))
    out.append(("stream-plan-loads-nosum", ("loads", plan.tile, plan.ctas, True, False)))
    # The same tile on the read-only ceiling's kind of grid: one CTA per row tile (ROW_TILE_GRID, resolved per layer)
    out.append(("stream-plan-rowtiles", ("stream", plan.tile, ROW_TILE_GRID, shift)))
    out.append(("stream-plan-loads-rowtiles", ("loads", plan.tile, ROW_TILE_GRID, True, True)))
    # The table decode needs ~255 registers (benchmarks/gemv_sass_counts.py): 2 CTAs per SM are one wave.
    out.append(("stream-plan-table", ("stream", plan.tile, 2 * sm // -(-t // plan.tile.block_t),
                                      gs.DECODE_PORTABLE)))
    return out


def is_probe(spec) -> bool:
    """A timing probe with no result to check: the streaming kernel without its decode (or without its scale
    arithmetic too), and the loads probe without its cross-CTA sums."""
    return (spec[0] == "stream" and spec[3] in gs.PROBE_DECODE_NAMES) or (spec[0] == "loads" and not spec[4])


def expected(spec, x, codes, scales, want):
    """What a checked candidate must return: the reference product, or the loads probe's exact sums."""
    if spec[0] == "loads":
        return stream_loads_expected(x, codes, scales, spec[1], load_x=spec[3])
    return want


def stream_name(tile) -> str:
    """``stream-32x8w4r1`` (rows x tokens, warps, row warps), ``...c128`` with a register cap, ``...ov`` with the
    runs overlapped, ``...pf2`` with two steps loaded ahead."""
    cap = f"c{tile.max_regs}" if tile.max_regs else ""
    ov = "ov" if tile.overlap_runs else ""
    pf = f"pf{tile.prefetch}" if tile.prefetch != 1 else ""
    return f"stream-{tile.block_m}x{tile.block_t}w{tile.num_warps}r{tile.row_warps}{cap}{ov}{pf}"


def gluon_today_spec(t, n, k, sm, cc_major):
    from vllm_nvfp4_sm120.dispatch.hw import Capability
    from vllm_nvfp4_sm120.dispatch.linear import gluon_gemv_plan

    plan = gluon_gemv_plan(Capability(cc_major * 10, sm), t, n, k)
    kind = "fma" if plan.kernel.endswith("fma") else "mma"
    tile = (gluon_gemv.FmaTile if kind == "fma" else gluon_gemv.MmaTile)(**plan.kwargs)
    return ("gluon", kind, tile)


def make_runner(spec, n, k, device):
    """``fn(x, codes, scales, dec_rows) -> out`` for a spec (a fresh workspace kept by the closure)."""
    if spec[0] == "stream":
        _, tile, ctas, decode = spec
        ctas = grid_ctas(ctas, n, tile)
        cache: dict = {}

        def run(x, codes, scales, dec_rows):
            grid = gs.stream_grid(x.shape[0], n, k, tile, ctas)
            if grid not in cache:
                cache[grid] = gs.StreamWorkspace.for_grid(grid, tile, device)
            return gs.gemv_stream(x, codes, scales, dec_rows, tile=tile, ctas=ctas, decode=decode,
                                  workspace=cache[grid])
        return run
    if spec[0] == "loads":
        _, tile, ctas, load_x, sums = spec
        ctas = grid_ctas(ctas, n, tile)
        cache = {}

        def run(x, codes, scales, dec_rows):
            grid = gs.stream_grid(x.shape[0], n, k, tile, ctas)
            if grid not in cache:
                cache[grid] = gs.StreamWorkspace.for_grid(grid, tile, device)
            return stream_loads(x, codes, scales, tile=tile, ctas=ctas, load_x=load_x, sums=sums,
                                workspace=cache[grid])
        return run
    if spec[0] == "gluon":
        _, kind, tile = spec
        fn = gluon_gemv.gemv_fma if kind == "fma" else gluon_gemv.gemv_mma
        return lambda x, codes, scales, dec_rows: fn(x, codes, scales, dec_rows, tile=tile)
    raise ValueError(spec)


def _warm(job):
    """Compile one (spec, K, T) on a small problem with the same constexprs and specializations."""
    spec, k, t = job
    try:
        gen = torch.Generator().manual_seed(0)
        n = 256
        w = random_nvfp4((n, k), gen=gen, device="cuda")
        x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
        make_runner(spec, n, k, "cuda")(x, w.codes, w.scales, torch.full((n,), DEC, device="cuda"))
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported by the main process, which will hit the same error
        return f"{spec} K={k} T={t}: {type(e).__name__}: {e}"


def _probe_gemlite(shapes, tokens, mode):
    """Build and call gemlite's layer once per shape and T (compiles its kernels into the shared cache)."""
    build, reason = gemlite_factory(mode)
    if build is None:
        return
    gen = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w = random_nvfp4((n, k), gen=gen, device="cuda")
        layer = build(w.codes, w.scales, torch.full((n,), DEC, device="cuda"), dtype=torch.bfloat16)
        if isinstance(layer, str):
            return
        for t in tokens:
            layer(torch.randn(t, k, device="cuda").to(torch.bfloat16))
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------------------
def selected(name: str, patterns: list[str] | None) -> bool:
    """``name`` contains one of the patterns, or equals one that ends in ``$`` (``stream-plan$``: the plan alone)."""
    return patterns is None or any(p[:-1] == name if p.endswith("$") else p in name for p in patterns)


def check(name, got, want, failures, exact=False) -> bool:
    try:
        tolerance = dict(rtol=0, atol=0) if exact else dict(rtol=1.6e-2, atol=1e-4)
        torch.testing.assert_close(got, want, **tolerance)
        return True
    except AssertionError as e:
        failures.append(f"{name}: {str(e).splitlines()[0]} / {str(e).splitlines()[-1]}")
        print(f"  FAILED check: {failures[-1]}", flush=True)
        return False


def sweep(args) -> dict:
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    sm, cc_major = props.multi_processor_count, props.major
    t0 = time.time()
    dram = dram_read_tbs()
    print(f"# {props.name} ({sm} SMs, sm_{props.major}{props.minor}), torch {torch.__version__}, triton "
          f"{triton.__version__}; DRAM read {dram:.2f} TB/s", flush=True)
    shapes = [(m, layer, n, k) for m, layers in MODELS.items() for layer, n, k in layers
              if args.shapes is None or any(s in f"{m}/{layer}" for s in args.shapes)]
    tokens = args.t
    patterns = args.candidates
    gemlite_build, gemlite_reason = gemlite_factory(args.gemlite_autotune) if selected("gemlite", patterns) else (
        None, "not selected")
    if gemlite_reason:
        print(f"# gemlite: {gemlite_reason}", flush=True)

    # ---- compile everything in parallel first (and probe gemlite in its own process: a Triton compile can abort)
    jobs = []
    for _, _, n, k in shapes:
        for t in tokens:
            specs = [s for name, s in stream_specs(t, sm, cc_major) if selected(name, patterns)]
            if selected("gluon-today", patterns):
                specs.append(gluon_today_spec(t, n, k, sm, cc_major))
            jobs += [(s, k, t) for s in specs]
    # One job per distinct compile: the streaming kernel's constexprs are its tile and decode (not the grid, not
    # K); gluon-today's include K; T = 1 is a JIT specialization of both.
    distinct = {}
    for spec, k, t in jobs:
        if spec[0] == "stream":
            key = (spec[1], spec[3])
        elif spec[0] == "loads":
            key = spec[:2] + spec[3:]
        else:
            key = (spec, k)
        distinct.setdefault((key, t == 1), (spec, k, t))
    jobs = list(distinct.values())
    ctx = multiprocessing.get_context("spawn")
    probe = None
    if gemlite_build is not None:
        probe = ctx.Process(target=_probe_gemlite, args=([(n, k) for _, _, n, k in shapes], tokens,
                                                         args.gemlite_autotune))
        probe.start()
    if jobs:
        from concurrent.futures import ProcessPoolExecutor
        from concurrent.futures.process import BrokenProcessPool

        try:
            with ProcessPoolExecutor(max(1, min(args.jobs, len(jobs))), mp_context=ctx) as pool:
                for err in pool.map(_warm, jobs):
                    if err:
                        print(f"# compile: {err}", flush=True)
        except BrokenProcessPool as e:
            print(f"# compile: a worker died ({e}); the main process compiles what is left", flush=True)
    if probe is not None:
        probe.join()
        if probe.exitcode != 0:
            gemlite_build, gemlite_reason = None, f"gemlite crashed in a probe process (exit code {probe.exitcode})"
            print(f"# gemlite: {gemlite_reason}", flush=True)
    print(f"# compiled {len(jobs)} kernel variants in {time.time() - t0:.0f} s", flush=True)

    rows, failures = [], []
    gen = torch.Generator().manual_seed(0)
    for model, layer, n, k in shapes:
        wbytes = n * k // 2 + n * k // 16
        copies = max(1, math.ceil(args.min_bytes / wbytes))
        base = random_nvfp4((n, k), gen=gen, device=dev)
        ws = [(base.codes, base.scales)] + [(base.codes.clone(), base.scales.clone()) for _ in range(copies - 1)]
        dec_rows = torch.full((n,), DEC, device=dev)
        w_bf16 = None
        gem_layers = None
        for t in tokens:
            x = torch.randn(t, k, device=dev).to(torch.bfloat16)
            want = linear_w4a16_ref(x, base.codes, base.scales, dec_rows)
            cands: dict[str, tuple] = {}
            for name, spec in stream_specs(t, sm, cc_major):
                cands[name] = spec
            cands["gluon-today"] = gluon_today_spec(t, n, k, sm, cc_major)
            for name, spec in cands.items():
                if not selected(name, patterns):
                    continue
                run = make_runner(spec, n, k, dev)
                if is_probe(spec):  # nothing to check: run once, then time
                    run(x, *ws[0], dec_rows)
                elif not check(f"{model}/{layer} T={t} {name}", run(x, *ws[0], dec_rows),
                               expected(spec, x, base.codes, base.scales, want), failures, exact=spec[0] == "loads"):
                    continue
                sec = time_graph(lambda: [run(x, c, s, dec_rows) for c, s in ws], args.repeats) / copies
                rows.append(_row(model, layer, n, k, t, name, sec, wbytes, dram, spec))
            if selected("cublas-bf16", patterns):
                if w_bf16 is None:
                    wb = unit_values(base.codes, base.scales).to(torch.bfloat16)
                    w_bf16 = [wb] + [wb.clone() for _ in range(max(1, math.ceil(args.min_bytes / (2 * n * k))) - 1)]
                if check(f"{model}/{layer} T={t} cublas-bf16", (x @ w_bf16[0].t()) * DEC, want, failures):
                    sec = time_graph(lambda: [x @ w.t() for w in w_bf16], args.repeats) / len(w_bf16)
                    rows.append(_row(model, layer, n, k, t, "cublas-bf16", sec, 2 * n * k, dram, None))
            if gemlite_build is not None:
                if gem_layers is None:
                    gem_layers = gemlite_copies(gemlite_build, ws, dec_rows, dtype=torch.bfloat16)
                if isinstance(gem_layers, str):
                    print(f"# gemlite: {gem_layers}", flush=True)
                else:
                    # Checked against our reference within its split-K allowance (peers.check_gemlite); its
                    # distance from the reference and from its split-K model are reported beside the time.
                    got = gem_layers[0](x)
                    split_k, block_k = gemlite_config()
                    model_out = gemlite_split_k_ref(x, base.codes, base.scales, dec_rows, split_k=split_k,
                                                    block_k=block_k)
                    top = float(want.float().abs().max())
                    _, why = check_gemlite(got, want)
                    if why:
                        failures.append(f"{model}/{layer} T={t} gemlite: {why}")
                        print(f"  FAILED check: {failures[-1]}", flush=True)
                    else:
                        sec = time_graph(lambda: [g(x) for g in gem_layers], args.repeats) / copies
                        row = _row(model, layer, n, k, t, f"gemlite ({args.gemlite_autotune}, split {split_k})",
                                   sec, wbytes, dram, None)
                        row["max_diff_vs_ref_over_max_ref"] = float((got.float() - want.float()).abs().max()) / top
                        row["max_diff_vs_split_model_over_max_ref"] = float(
                            (got.float() - model_out.float()).abs().max()) / top
                        rows.append(row)
        for words, prefix in READ_ONLY_WIDTHS:  # independent of T
            if not selected(prefix, patterns):
                continue
            best = None
            for bm, split in ((32, 1), (16, max(1, 8 * sm * 16 // n)), (64, max(1, 4 * sm * 64 // n))):
                out = torch.empty(triton.cdiv(n, bm) * split, dtype=torch.int32, device=dev)
                got = xor_words(read_only(ws[0][0], ws[0][1], out, block_m=bm, block_w=words, split=split))
                if got != read_only_expected(base.codes, base.scales, bm):
                    failures.append(f"{model}/{layer} {prefix} bm={bm}: xor {got:#x} is wrong")
                    continue
                sec = time_graph(lambda: [read_only(c, s, out, block_m=bm, block_w=words, split=split)
                                          for c, s in ws], args.repeats) / copies
                if best is None or sec < best[0]:
                    best = (sec, f"{prefix} (rows {bm}, split {split})")
            if best:
                for t in tokens:
                    rows.append(_row(model, layer, n, k, t, best[1], best[0], wbytes, dram, None))
        if selected("read-only-tma", patterns) and cc_major >= 9:  # independent of T
            best = None
            want_xor = read_only_expected(base.codes, base.scales, 1)
            for bm, bw, stages, waves in TMA_READ_CONFIGS:
                split = max(1, round(waves * sm * bm / n))
                name = f"read-only-tma (rows {bm}, words {bw}, stages {stages}, split {split})"
                out = torch.empty(triton.cdiv(n, bm) * split, dtype=torch.int32, device=dev)
                try:
                    got = xor_words(read_only_tma(ws[0][0], ws[0][1], out, bm, bw, split, stages))
                except Exception as e:  # a box or shared-memory size this GPU's compile refuses
                    print(f"# {model}/{layer} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                if got != want_xor:
                    failures.append(f"{model}/{layer} {name}: xor {got:#x} is wrong")
                    continue
                sec = time_graph(lambda: [read_only_tma(c, s, out, bm, bw, split, stages) for c, s in ws],
                                 args.repeats) / copies
                print(f"#   {model}/{layer} {name}: {sec * 1e6:.1f} us, {wbytes / sec / 1e12:.2f} TB/s", flush=True)
                if best is None or sec < best[0]:
                    best = (sec, name)
            if best:
                for t in tokens:
                    rows.append(_row(model, layer, n, k, t, best[1], best[0], wbytes, dram, None))
        del ws, w_bf16, gem_layers
        torch.cuda.empty_cache()
    return {"device": props.name, "sm_count": sm, "dram_read_tbs": dram, "torch": torch.__version__,
            "triton": triton.__version__, "rows": rows, "failures": failures,
            "registers": stream_registers(), "seconds": time.time() - t0}


def _row(model, layer, n, k, t, name, sec, nbytes, dram, spec):
    row = {"model": model, "layer": layer, "n": n, "k": k, "t": t, "kernel": name, "us": sec * 1e6,
           "tbs": nbytes / sec / 1e12, "frac": nbytes / sec / 1e12 / dram}
    if spec is not None and spec[0] == "stream":
        decodes = gs.DECODE_NAMES | gs.PROBE_DECODE_NAMES
        row["tile"], row["ctas"], row["decode"] = str(spec[1]), grid_ctas(spec[2], n, spec[1]), decodes[spec[3]]
    elif spec is not None and spec[0] == "loads":
        row["tile"], row["ctas"], row["decode"] = str(spec[1]), grid_ctas(spec[2], n, spec[1]), "loads only"
    print(f"{model:14} {layer:8} {n:6}x{k:<6} T={t:<3} {name:32} {row['us']:8.1f} us {row['tbs']:5.2f} TB/s "
          f"{row['frac']:5.2f}", flush=True)
    return row


def stream_registers() -> dict:
    """Registers of every streaming-kernel variant this process compiled (diagnostic; JIT internals)."""
    out = {}
    try:
        for cache in gs._stream_kernel.device_caches.values():
            for key, kernel in cache[0].items():
                out[str(key)] = {"registers": kernel.n_regs, "spills": kernel.n_spills}  # the whole key: its constants
    except Exception as e:  # the JIT's cache layout is not an API
        out["unavailable"] = f"{type(e).__name__}: {e}"
    return out


# The "decode" of a timing probe's row: never the best streaming candidate (its output is not a product).
PROBE_ROW_DECODES = frozenset(gs.PROBE_DECODE_NAMES.values()) | {"loads only"}


def summary(result: dict) -> str:
    """One line per (layer, T): best streaming candidate, today's kernel, cuBLAS, gemlite, the ceilings."""
    by = {}
    for r in result["rows"]:
        by.setdefault((r["model"], r["layer"], r["n"], r["k"], r["t"]), []).append(r)
    lines = [f"# DRAM read {result['dram_read_tbs']:.2f} TB/s; frac = TB/s / DRAM read; x = time / ours",
             f"{'layer':22} {'T':>3} {'best stream (us, TB/s, frac)':44} {'plan us':>8} {'today us':>9} "
             f"{'cuBLAS us (x)':>14} {'gemlite us (x)':>15} {'read-only TB/s':>15} {'TMA read TB/s':>14}"]
    for (model, layer, n, k, t), rs in by.items():
        pick = {r["kernel"]: r for r in rs}
        streams = [r for r in rs if r["kernel"].startswith("stream") and r.get("decode") not in PROBE_ROW_DECODES]
        best = min(streams, key=lambda r: r["us"]) if streams else None
        ours = best["us"] if best else float("nan")

        def col(prefix, fmt="{us:8.1f} ({x:4.2f})"):
            r = next((r for name, r in pick.items() if name.startswith(prefix)), None)
            return fmt.format(us=r["us"], x=r["us"] / ours, tbs=r["tbs"]) if r else "-"

        b = f"{best['kernel'][7:]:22} {best['us']:6.1f} {best['tbs']:4.2f} {best['frac']:4.2f}" if best else "-"
        plan = pick.get("stream-plan")
        lines.append(f"{model[:9] + '/' + layer:22} {t:3} {b:44} {plan['us'] if plan else float('nan'):8.1f} "
                     f"{col('gluon-today', '{us:9.1f}'):>9} {col('cublas'):>14} {col('gemlite'):>15} "
                     f"{col('read-only (', '{tbs:15.2f}'):>15} {col('read-only-tma', '{tbs:14.2f}'):>14}")
    if result["failures"]:
        lines.append(f"# {len(result['failures'])} candidate checks FAILED: " + "; ".join(result["failures"]))
    return "\n".join(lines)


# The probe ladder's columns (names as the sweep gives them; "read-only" is the best read-only ceiling of the layer).
LADDER = ("stream-plan", "stream-plan-nodecode", "stream-plan-raw", "stream-plan-loads", "stream-plan-loads-nox",
          "stream-plan-loads-nosum", "stream-plan-rowtiles", "stream-plan-loads-rowtiles", "read-only")


def ladder(result: dict) -> str:
    """One line per (layer, T) with the fraction of DRAM read bandwidth of the plan, its probes, its row-tile grid and
    the read-only ceiling (``-`` where a column did not run); empty when no probe ran."""
    by = {}
    for r in result["rows"]:
        name = "read-only" if r["kernel"].startswith("read-only (") else r["kernel"]
        by.setdefault((r["model"], r["layer"], r["t"]), {})[name] = r["frac"]
    if not any(name in fracs for fracs in by.values() for name in LADDER[1:-1]):
        return ""
    heads = ["plan", "nodecode", "raw", "loads", "-nox", "-nosum", "rowtiles", "loads-rt", "read-only"]
    lines = ["# fraction of DRAM read bandwidth: the plan, its timing probes, its row-tile grid, the read ceiling",
             f"{'layer':22} {'T':>3} " + " ".join(f"{h:>9}" for h in heads)]
    for (model, layer, t), fracs in by.items():
        cells = [f"{fracs[name]:9.2f}" if name in fracs else f"{'-':>9}" for name in LADDER]
        lines.append(f"{model[:9] + '/' + layer:22} {t:3} " + " ".join(cells))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for linear_decode.json")
    p.add_argument("--shapes", type=lambda s: s.split(","), help="substrings of model/layer, e.g. qwen3-32b/down")
    p.add_argument("--t", type=lambda s: [int(v) for v in s.split(",")], default=list(TOKENS))
    p.add_argument("--candidates", type=lambda s: s.split(","),
                   help="substrings of candidate names (NAME$: that name only)")
    p.add_argument("--min-bytes", type=float, default=2e9)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="parallel compile processes")
    p.add_argument("--gemlite-autotune", choices=["default", "fast", "max"], default="default")
    args = p.parse_args(argv)
    result = sweep(args)
    table = summary(result)
    if probes := ladder(result):
        table += "\n\n" + probes
    print(table, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "linear_decode.json").write_text(json.dumps(result, indent=1))
    (out / "linear_decode.txt").write_text(table + "\n")
    print(f"# {result['seconds']:.0f} s; wrote {out / 'linear_decode.json'}", flush=True)
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
