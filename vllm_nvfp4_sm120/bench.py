"""Benchmarks on the GPU present: ``python -m vllm_nvfp4_sm120.bench WHAT [options]`` (``--help`` lists WHAT).

The one bench entry point: ``linear``, ``moe``, ``moe_decode``, ``act_quant``, the ``sweep_*`` runs and
``ceilings`` time our kernels and run without vLLM (the H200 used for measurements has none); ``compare`` times
them next to vLLM's NVFP4 kernel classes (when vLLM is importable) and is what ``vllm-nvfp4-sm120 bench`` runs.
Method, so the numbers can be trusted:
- every candidate is timed side by side in one process, on the same inputs, as a median over repeats;
- each weight is replicated into ``copies`` distinct buffers totalling ≥ ``--min-bytes`` (2 GB), and one timed
  run calls the kernel once per copy, so every call reads its weight from DRAM, not from the 50 MB L2;
- the calls of one run are captured in a CUDA graph and the graph is replayed, so launch gaps do not count;
- the DRAM read bandwidth and the cuBLAS bf16 rate are measured in the same run as ceilings.
Results print as a table and, with ``--json``, as machine-readable rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton

from .format import GlobalScale, NvFp4, linear_w4a16_ref, random_nvfp4, unit_values
from .peers import GEMLITE_AUTOTUNE, PEERS, check_gemlite, gemlite_copies, gemlite_factory

MODELS = {  # (name, N, K) of the linears of one decoder layer, unsharded
    "qwen3-32b": [("qkv", 10240, 5120), ("o", 5120, 8192), ("gate_up", 51200, 5120), ("down", 5120, 25600)],
    "llama-3.3-70b": [("qkv", 10240, 8192), ("o", 8192, 8192), ("gate_up", 57344, 8192), ("down", 8192, 28672)],
}
TOKENS = (1, 2, 4, 8, 16, 32, 128, 2048, 8192)


@dataclass
class Row:
    model: str
    layer: str
    n: int
    k: int
    t: int
    kernel: str
    us: float  # median microseconds per call
    tflops: float
    read_tbs: float  # weight (codes + scales) bytes read per second, TB/s
    note: str = ""


def time_graph(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of one replay of a CUDA graph capturing ``fn`` (which may launch many kernels)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm up: compile and autotune outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_eager(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median seconds of ``fn`` run eagerly (for code that cannot be captured, e.g. allocating per call)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def dram_read_tbs(nbytes: int = 4 << 30) -> float:
    """Read bandwidth ceiling: a sum over a buffer 80x larger than L2 (reads dominate; the write is one scalar)."""
    x = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").uniform_()
    out = torch.empty((), device="cuda")
    sec = time_graph(lambda: torch.sum(x, dim=0, out=out))
    return nbytes / sec / 1e12


def xor_words(t: torch.Tensor) -> int:
    """The xor of a tensor's elements as 32-bit words: the check of the read-ceiling kernels (benchmarks/), which
    combine the bytes they read the same way (no decode, so their time is the bytes' arrival alone)."""
    v = t.reshape(-1).to(torch.int64) & 0xFFFFFFFF
    while v.numel() > 1:
        if v.numel() % 2:
            v = torch.cat([v, v.new_zeros(1)])
        v = v[0::2] ^ v[1::2]
    return int(v[0]) if v.numel() else 0


def cublas_bf16_tflops(n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    sec = time_graph(lambda: a @ b)
    return 2 * n**3 / sec / 1e12


def _copies(bytes_per_copy: int, min_bytes: int) -> int:
    return max(1, -(-min_bytes // bytes_per_copy))


def bench_linear(models: list[str], tokens: list[int], min_bytes: int, kernels: list[str], *,
                 peers: list[str] = (), gemlite_autotune: str = "default", device: str = "cuda",
                 cap=None) -> list[Row]:
    """Our kernels (``kernels``: the candidate groups) and the ``peers`` (``peers.PEERS``) at each shape and T.

    A peer runs only where it imports, takes the layer and matches our reference within its allowance; otherwise
    one line says why and its row is absent (it is never a dependency).  ``device`` / ``cap``: for the CPU tests
    of the row-building (with a faked timer); the benchmark itself runs on the GPU present."""
    from .dispatch.hw import capability_of
    from .dispatch import configs
    from .dispatch.gemv_stream_plan import STREAM_MAX_T
    from .dispatch.linear import (W4A16_GEMV_MAX_T, dequant_mm_chunk_n, gemv_stream_linear_plan, gluon_gemv_plan,
                                  select_linear, w4a16_plan)
    from .dispatch.registry import LINEAR_KERNELS, Ready, prepare_linear
    from .tune import linear_choice

    cap = cap or capability_of(torch.device(device))
    sm_count = cap.sm_count
    gemlite = None
    if "gemlite" in peers:
        gemlite, reason = gemlite_factory(gemlite_autotune)
        if reason:
            print(f"# gemlite: not timed: {reason}", flush=True)
    gen = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    for model in models:
        for layer, n, k in MODELS[model]:
            gem_layers: list | str | None = None  # gemlite's layer on each copy, or why it has none
            wbytes = n * k // 2 + n * k // 16
            copies = _copies(wbytes, min_bytes)
            base = random_nvfp4((n, k), gen=gen, device=device)
            ws = [base] + [NvFp4(base.codes.clone(), base.scales.clone()) for _ in range(copies - 1)]
            dec_rows = torch.full((n,), 0.01, device=device)
            in_enc = torch.tensor(100.0, device=device)
            alpha = torch.tensor(0.01 * 0.01, device=device)
            w_bf16 = None
            for t in tokens:
                x = torch.randn(t, k, device=device).to(torch.bfloat16)
                flops = 2 * t * n * k
                route_kernel = select_linear(cap, "w4a16", t, n, k).kernel
                candidates: dict[str, Callable[[], object]] = {}
                kernel_of: dict[str, str] = {}  # candidate -> dispatch kernel name, to mark what the w4a16 route runs
                if "w4a16" in kernels:  # the Triton W4A16 kernels (the Gluon gemv is its own candidate)
                    plan = w4a16_plan(cap, t, n, k, small=True)
                    run = LINEAR_KERNELS[plan.kernel]
                    candidates[f"ours-w4a16 ({plan.kernel})"] = lambda run=run, plan=plan: [
                        run(x, w.codes, w.scales, dec_rows, None, None, None, None, **plan.kwargs) for w in ws]
                    kernel_of[f"ours-w4a16 ({plan.kernel})"] = plan.kernel
                    if t > W4A16_GEMV_MAX_T:  # prefill: dequant + cuBLAS next to the Triton GEMM, at every prefill T
                        chunk = dequant_mm_chunk_n(t, n, k, sm_count)
                        run = LINEAR_KERNELS["w4a16_dequant_mm"]
                        name = f"ours-w4a16 (w4a16_dequant_mm chunk_n={chunk})"
                        candidates[name] = lambda run=run, chunk=chunk: [
                            run(x, w.codes, w.scales, dec_rows, None, None, None, None, chunk_n=chunk) for w in ws]
                        kernel_of[name] = "w4a16_dequant_mm"
                if "w4a4" in kernels:
                    plan = select_linear(cap, "triton", max(t, 17), n, k)  # the W4A4 GEMM at every T
                    run = LINEAR_KERNELS[plan.kernel]
                    candidates[f"ours-w4a4 ({plan.kernel}, emulated MMA below sm_120)"] = lambda run=run, plan=plan: [
                        run(x, w.codes, w.scales, dec_rows, None, in_enc, alpha, None, **plan.kwargs) for w in ws]
                if "gluon" in kernels and t <= 32:
                    # The Gluon gemv on its tile rule (the decode kernel the table ran before the streaming one).
                    plan = gluon_gemv_plan(cap, t, n, k)
                    run = LINEAR_KERNELS[plan.kernel]
                    name = f"ours-{plan.kernel.replace('_', '-')} (portable decode below sm_120)"
                    candidates[name] = lambda run=run, plan=plan: [
                        run(x, w.codes, w.scales, dec_rows, None, None, None, None, **plan.kwargs) for w in ws]
                    kernel_of[name] = plan.kernel
                if "dispatch" in kernels:
                    # What the w4a16 route's op runs at this T on this GPU (measured configs included), ready launch.
                    plan = select_linear(cap, "w4a16", t, n, k)
                    run = prepare_linear(plan, Ready(t, n, k, x.device, x.dtype, has_bias=False))
                    name = f"ours-dispatch ({configs.choice_label(linear_choice(plan))})"
                    candidates[name] = lambda run=run: [
                        run(x, w.codes, w.scales, dec_rows, None, None, None, None) for w in ws]
                if "stream" in kernels and t <= STREAM_MAX_T:
                    # The streaming kernel with the dispatch's tile and grid, through the ready launch the op caches.
                    plan = gemv_stream_linear_plan(cap, t, n, k)
                    run = prepare_linear(plan, Ready(t, n, k, x.device, x.dtype, has_bias=False))
                    name = "ours-gluon-gemv-stream (portable decode below sm_120)"
                    candidates[name] = lambda run=run: [
                        run(x, w.codes, w.scales, dec_rows, None, None, None, None) for w in ws]
                    kernel_of[name] = plan.kernel
                if "cublas-bf16" in kernels:
                    if w_bf16 is None:
                        wb = unit_values(ws[0].codes, ws[0].scales).to(torch.bfloat16)
                        w_bf16 = [wb] + [wb.clone() for _ in range(_copies(2 * n * k, min_bytes) - 1)]
                    candidates["cublas-bf16 (dequantized weight)"] = lambda: [x @ w.t() for w in w_bf16]
                if gemlite is not None and not isinstance(gem_layers, str):
                    if gem_layers is None:
                        gem_layers = gemlite_copies(gemlite, [(w.codes, w.scales) for w in ws], dec_rows,
                                                    dtype=x.dtype)
                        if isinstance(gem_layers, str):
                            print(f"# gemlite {model}/{layer}: not timed: {gem_layers}", flush=True)
                    if not isinstance(gem_layers, str):
                        name, problem = check_gemlite(gem_layers[0](x),
                                                      linear_w4a16_ref(x, base.codes, base.scales, dec_rows))
                        if problem:
                            print(f"# {name} {model}/{layer} T={t}: not timed: {problem}", flush=True)
                        else:
                            candidates[name] = lambda gem_layers=gem_layers: [g(x) for g in gem_layers]
                if "naive" in kernels:
                    candidates["torch dequant + matmul"] = lambda: x @ unit_values(ws[0].codes, ws[0].scales).to(
                        torch.bfloat16).t()
                for name, fn in candidates.items():
                    calls = len(w_bf16) if name.startswith("cublas") else (1 if name.startswith("torch") else copies)
                    sec = (time_eager(fn) if name.startswith("torch") else time_graph(fn)) / calls
                    read = (2 * n * k if name.startswith("cublas") else wbytes) / sec / 1e12
                    routed = kernel_of.get(name) and route_kernel.startswith(kernel_of[name])
                    note = "<- w4a16 route" if routed else ("peer" if name.startswith("gemlite") else "")
                    rows.append(Row(model, layer, n, k, t, name, sec * 1e6, flops / sec / 1e12, read, note))
                    print(_fmt(rows[-1]), flush=True)
            del ws, w_bf16, gem_layers
            torch.cuda.empty_cache()
    return rows


def peer_ratios(rows: list[Row]) -> list[dict]:
    """Per shape and T where a peer was timed: our fastest candidate against it (``x``: peer time / ours)."""
    out = []
    for key in dict.fromkeys((r.model, r.layer, r.t) for r in rows):
        same = [r for r in rows if (r.model, r.layer, r.t) == key]
        ours = min((r for r in same if r.kernel.startswith("ours-")), key=lambda r: r.us, default=None)
        for peer in (r for r in same if r.note == "peer"):
            if ours is not None:
                out.append({"model": key[0], "layer": key[1], "t": key[2], "ours": ours.kernel, "ours_us": ours.us,
                            "peer": peer.kernel, "peer_us": peer.us, "x": peer.us / ours.us})
    return out


def act_quant_bytes(t: int, k: int) -> int:
    """Bytes the activation quantizer moves for bf16 ``[t, k]``: the input read, the codes and the scales written."""
    return 2 * t * k + t * k // 2 + t * k // 16


def bench_act_quant(ks: list[int], tokens: list[int], dram_read_tbs: float | None = None) -> list[Row]:
    """bf16 ``[T, K]`` → NVFP4 codes + linear scales on the dispatch's tile; the note gives the bytes moved (in + out)
    per second and, with ``dram_read_tbs`` (the same run's read ceiling), their fraction of it (the goal: 0.85)."""
    from .dispatch.linear import act_quant_config
    from .kernels.act_quant import quantize_act_nvfp4

    rows = []
    in_enc = torch.tensor(100.0, device="cuda")
    for k in ks:
        for t in tokens:
            xs = [torch.randn(t, k, device="cuda").to(torch.bfloat16) for _ in range(_copies(2 * t * k, 1 << 30))]
            tile = act_quant_config(t, k)
            sec = time_graph(lambda: [quantize_act_nvfp4(x, in_enc, **tile) for x in xs]) / len(xs)
            moved = act_quant_bytes(t, k)
            note = f"{moved / sec / 1e12:.2f} TB/s read+write"
            if dram_read_tbs:
                note += f", {moved / sec / 1e12 / dram_read_tbs:.2f} of read BW"
            note += f", tile {tile['block_t']}x{tile['block_k']} w{tile['num_warps']}"
            rows.append(Row("-", "act_quant", 0, k, t, "ours-act-quant", sec * 1e6, 0.0, 2 * t * k / sec / 1e12,
                            note))
            print(_fmt(rows[-1]), flush=True)
            del xs
    return rows


# Candidate tiles of the activation quantizer (block_t, block_k, num_warps) for the large-T rule of
# dispatch.linear.act_quant_config: the rule's own first, then more elements per thread or fewer warps.
ACT_QUANT_SWEEP_TILES = [(8, 1024, 4), (16, 1024, 4), (8, 2048, 4), (4, 2048, 4), (8, 1024, 2), (16, 512, 4),
                         (8, 512, 2)]


def sweep_act_quant(ks: list[int], tokens: list[int], dram_read_tbs: float) -> list[Row]:
    """Every tile of ACT_QUANT_SWEEP_TILES on each (T, K), bf16 input, linear scales; each tile's codes and scales
    are checked equal to the first tile's before it is timed."""
    from .kernels.act_quant import quantize_act_nvfp4

    rows = []
    in_enc = torch.tensor(100.0, device="cuda")
    for k in ks:
        for t in tokens:
            xs = [torch.randn(t, k, device="cuda").to(torch.bfloat16) for _ in range(_copies(2 * t * k, 1 << 30))]
            moved = act_quant_bytes(t, k)
            first = None
            for bt, bk, nw in ACT_QUANT_SWEEP_TILES:
                tile = dict(block_t=bt, block_k=bk, num_warps=nw)
                out = quantize_act_nvfp4(xs[0], in_enc, **tile)
                if first is None:
                    first = out
                elif not (torch.equal(out[0], first[0]) and torch.equal(out[1].view(torch.uint8),
                                                                         first[1].view(torch.uint8))):
                    raise AssertionError(f"act_quant tile {tile} differs from the first tile at T={t} K={k}")
                sec = time_graph(lambda: [quantize_act_nvfp4(x, in_enc, **tile) for x in xs]) / len(xs)
                rows.append(Row("-", "act_quant", 0, k, t, f"act-quant {bt}x{bk} w{nw}", sec * 1e6, 0.0,
                                2 * t * k / sec / 1e12,
                                f"{moved / sec / 1e12:.2f} TB/s read+write, {moved / sec / 1e12 / dram_read_tbs:.2f}"
                                f" of read BW"))
                print(_fmt(rows[-1]), flush=True)
            del xs, first
    return rows


def sweep_w4a16_gemv(models: list[str], tokens: list[int], min_bytes: int) -> list[Row]:
    """Every (block_n, block_k, warps, stages, split_k) of the Triton W4A16 decode kernel on each shape: the data
    the dispatch rules are written from."""
    import itertools

    from .kernels.w4a16_linear import w4a16_gemv

    gen = torch.Generator().manual_seed(0)
    rows = []
    for model in models:
        for layer, n, k in MODELS[model]:
            wbytes = n * k // 2 + n * k // 16
            base = random_nvfp4((n, k), gen=gen, device="cuda")
            ws = [base] + [NvFp4(base.codes.clone(), base.scales.clone()) for _ in range(_copies(wbytes, min_bytes) - 1)]
            dec_rows = torch.full((n,), 0.01, device="cuda")
            for t in tokens:
                x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
                best = None
                for bn, bk, nw, ns, sk in itertools.product((32, 64, 128), (256, 512), (4, 8), (3, 4), (1, 2, 4)):
                    if bk * sk > k or (bn == 128 and nw == 4):
                        continue
                    cfg = dict(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, split_k=sk)
                    try:
                        sec = time_graph(lambda: [w4a16_gemv(x, w.codes, w.scales, dec_rows, **cfg) for w in ws]) / len(ws)
                    except Exception as e:  # a config that does not compile or fit is reported, not fatal
                        print(f"# {layer} t={t} {cfg}: {type(e).__name__}", flush=True)
                        continue
                    row = Row(model, layer, n, k, t, f"w4a16_gemv {cfg}", sec * 1e6, 2 * t * n * k / sec / 1e12,
                              wbytes / sec / 1e12)
                    rows.append(row)
                    best = row if best is None or row.us < best.us else best
                print("best:", _fmt(best), flush=True)
            del ws
    return rows


def sweep_dequant_mm(models: list[str], tokens: list[int]) -> list[Row]:
    """W4A16 prefill by dequant + cuBLAS: chunk sizes around the dispatch rule's, the dequant kernel alone (weight
    bytes read + 16-bit bytes written per second), and cuBLAS bf16 on the whole dequantized weight (the ceiling).
    The data ``dispatch.linear.dequant_mm_chunk_n`` is written from.  Prefill is compute bound: one weight copy."""
    from .dispatch.linear import dequant_mm_chunk_n
    from .kernels.w4a16_dequant import dequantize_rows, w4a16_dequant_mm

    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator().manual_seed(0)
    rows = []
    for model in models:
        for layer, n, k in MODELS[model]:
            w = random_nvfp4((n, k), gen=gen, device="cuda")
            dec_rows = torch.full((n,), 0.01, device="cuda")
            wb = torch.empty((n, k), dtype=torch.bfloat16, device="cuda")
            sec = time_graph(lambda: dequantize_rows(w.codes, w.scales, dec_rows, torch.bfloat16, out=wb))
            moved = n * k // 2 + n * k // 16 + 2 * n * k
            rows.append(Row(model, layer, n, k, 0, "dequantize_rows (whole weight)", sec * 1e6, 0.0,
                            moved / sec / 1e12, "TB/s = codes + scales read + bf16 written"))
            print(_fmt(rows[-1]), flush=True)
            for t in tokens:
                x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
                flops = 2 * t * n * k
                sec = time_graph(lambda: x @ wb.t())
                rows.append(Row(model, layer, n, k, t, "cublas-bf16 (dequantized weight)", sec * 1e6,
                                flops / sec / 1e12, 0.0))
                print(_fmt(rows[-1]), flush=True)
                ceiling = sec
                rule = dequant_mm_chunk_n(t, n, k, sm_count)
                n_r = -(-n // 128) * 128
                for chunk in sorted({min(c, n_r) for c in (rule // 2 // 128 * 128 or 128, rule, 2 * rule, 4 * rule,
                                                          n_r)}):
                    sec = time_graph(lambda: w4a16_dequant_mm(x, w.codes, w.scales, dec_rows, chunk_n=chunk))
                    rows.append(Row(model, layer, n, k, t, f"w4a16_dequant_mm chunk_n={chunk}", sec * 1e6,
                                    flops / sec / 1e12, 0.0,
                                    f"{ceiling / sec:.2f}x cuBLAS" + (" <- rule" if chunk == rule else "")))
                    print(_fmt(rows[-1]), flush=True)
            del w, wb
            torch.cuda.empty_cache()
    return rows


MOE_SHAPES = {  # name: (H, I, E, top_k)
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "deepseek-v3": (7168, 2048, 256, 8),
    "qwen3-next-80b-a3b": (2048, 512, 512, 10),
}
MOE_TOKENS = (16, 64, 256, 1024, 4096, 8192)


def gpu_nvfp4(shape, gen: torch.Generator) -> NvFp4:
    """Random codes and e4m3 scales drawn on ``gen``'s device, the GPU for GBs of expert weights (drawing them on
    the CPU is too slow)."""
    *lead, k = shape
    codes = torch.randint(0, 256, (*lead, k // 2), dtype=torch.uint8, device=gen.device, generator=gen)
    exp = torch.randint(-3, 2, (*lead, k // 16), device=gen.device, generator=gen).float()
    mant = torch.randint(0, 8, (*lead, k // 16), device=gen.device, generator=gen).float()
    return NvFp4(codes, (torch.exp2(exp) * (1 + mant / 8)).to(torch.float8_e4m3fn))


def bench_moe(shapes: list[str], tokens: list[int]) -> list[Row]:
    """Whole MoE layer (align + gate_up + act + down + top-k sum) vs the cuBLAS bf16 ceiling on the same FLOPs."""
    from .dispatch.moe import as_gluon
    from .dispatch.moe_flow import nvfp4_moe, plan_for

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in shapes:
        h, i, e, k = MOE_SHAPES[name]
        w13, w2 = gpu_nvfp4((e, 2 * i, h), gen), gpu_nvfp4((e, h, i), gen)
        d13 = torch.full((e,), 0.01, device="cuda")
        d2 = torch.full((e,), 0.01, device="cuda")
        enc = torch.full((1,), 50.0, device="cuda")
        for t in tokens:
            x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
            logits = torch.randn(t, e, device="cuda", generator=gen)
            tw, ti = torch.softmax(logits, -1).topk(k, -1)
            tw, ti = (tw / tw.sum(-1, keepdim=True)).float(), ti.to(torch.int32)
            flops = 2 * t * k * 3 * h * i  # useful FLOPs: gate, up and down per routed token
            a = torch.randn(t * k, h, device="cuda").to(torch.bfloat16)
            wg = torch.randn(2 * i, h, device="cuda").to(torch.bfloat16)
            a2 = torch.randn(t * k, i, device="cuda").to(torch.bfloat16)
            wd = torch.randn(h, i, device="cuda").to(torch.bfloat16)
            candidates = {
                "ours-w4a16": lambda: nvfp4_moe(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti),
                "ours-w4a4 (emulated MMA below sm_120)": lambda: nvfp4_moe(
                    x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, a13_enc=enc, a2_enc=enc),
                "cublas-bf16 same FLOPs (ceiling)": lambda: (a @ wg.t(), a2 @ wd.t()),
            }
            # A proxy for sm_120: the same work on the Gluon GEMMs with their sm_120 tiles (W4A4: the block-scaled
            # MMA emulated by decode + bf16 MMA below sm_120, so not representative for speed).
            gluon = {w4a4: as_gluon(plan_for(x, w13.codes, w2.codes, ti, w4a4=w4a4), i) for w4a4 in (False, True)}
            if gluon[False] is not None:
                candidates["ours-w4a16 gluon"] = lambda: nvfp4_moe(
                    x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, plan=gluon[False])
            if gluon[True] is not None and gluon[True].kernel == "w4a4":
                candidates["ours-w4a4 gluon (emulated MMA below sm_120)"] = lambda: nvfp4_moe(
                    x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, a13_enc=enc, a2_enc=enc,
                    plan=gluon[True])
            for cand, fn in candidates.items():
                plan = (gluon["w4a4" in cand] if " gluon" in cand
                        else plan_for(x, w13.codes, w2.codes, ti, w4a4="w4a4" in cand))
                sec = time_graph(fn)
                note = "" if cand.startswith("cublas") else f"{plan.kernel} {plan.impl} block_m={plan.block_m}"
                rows.append(Row(name, "moe", h, i, t, cand, sec * 1e6, flops / sec / 1e12, 0.0, note))
                print(_fmt(rows[-1]), flush=True)
        del w13, w2
        torch.cuda.empty_cache()
    return rows


# ---- moe_decode: the decode plan against today's path and the bytes floor -----------------------------------------

DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64)
DECODE_MAX_COPIES = 16
DECODE_MAX_BANK_BYTES = 24e9  # all copies of one shape's banks together (DeepSeek-V3: 6.3 GB per copy)


@dataclass
class DecodeRow:
    model: str
    h: int
    i: int
    e: int
    top_k: int
    t: int
    experts_touched: float  # distinct experts per call, mean over the copies' routings
    floor_us: float  # codes + scales of the touched experts / DRAM read bandwidth of this run
    decode_us: float  # the decode plan (its tiles at this T, also where the table does not pick it)
    fraction_of_floor: float
    today_us: float  # the tiers' plan (align + BLOCK_M GEMMs), W4A16
    speedup: float  # today_us / decode_us
    table_picks_decode: bool  # what the dispatch runs at this T (W4A16 checkpoint)
    decode_plan: str
    today_plan: str
    rel_err: float  # max |decode - moe_ref| / max |moe_ref| on the first copy
    copies: int


def expert_bytes(h: int, i: int) -> int:
    """Codes (1/2 byte) + e4m3 scales (1/16 byte) per weight of one expert's gate, up and down."""
    return 3 * h * i * 9 // 16


def decode_copies(h: int, i: int, e: int, top_k: int, min_bytes: float) -> int:
    """Bank copies for one shape: each call reads its own copy's experts, so one graph of the calls reads at least
    ``min_bytes`` at T = 1 (several L2 sizes), within :data:`DECODE_MAX_COPIES` and :data:`DECODE_MAX_BANK_BYTES`."""
    want = -(-int(min_bytes) // (top_k * expert_bytes(h, i)))
    room = int(DECODE_MAX_BANK_BYTES // (e * expert_bytes(h, i)))
    return max(2, min(want, DECODE_MAX_COPIES, room))


def decode_row(model: str, h: int, i: int, e: int, top_k: int, t: int, touched: list[int], read_tbs: float,
               decode_s: float, today_s: float, table_picks_decode: bool, decode_plan: str, today_plan: str,
               rel_err: float) -> DecodeRow:
    """One row from what was measured (pure: the CPU tests build rows with the timer stubbed)."""
    mean_touched = sum(touched) / len(touched)
    floor_us = mean_touched * expert_bytes(h, i) / (read_tbs * 1e12) * 1e6
    decode_us, today_us = decode_s * 1e6, today_s * 1e6
    return DecodeRow(model, h, i, e, top_k, t, mean_touched, floor_us, decode_us, floor_us / decode_us, today_us,
                     today_us / decode_us, table_picks_decode, decode_plan, today_plan, rel_err, len(touched))


def bench_moe_decode(shapes: list[str], tokens: list[int], min_bytes: float, read_tbs: float, *,
                     device: str = "cuda", cap=None, layer=None) -> list[DecodeRow]:
    """The MoE layer at decode sizes: the decode plan and today's path (the tiers' W4A16 plan) side by side, each
    call on its own copy of the banks with its own routing (so its experts come from DRAM), CUDA graphs, medians;
    the floor from the experts actually touched.  ``cap`` / ``layer``: the GPU and the layer function (the CPU
    tests fake them; default the device's and ``dispatch.moe_flow.nvfp4_moe``)."""
    from .dispatch.hw import capability_of
    from .dispatch.moe import decode_tier_plan, table_moe_plan, tiers_moe_plan
    from .dispatch.moe_flow import nvfp4_moe
    from .format import moe_ref

    layer = nvfp4_moe if layer is None else layer
    dev = torch.device(device)
    cap = capability_of(dev) if cap is None else cap
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float16
    rows = []
    for name in shapes:
        h, i, e, k = MOE_SHAPES[name]
        copies = decode_copies(h, i, e, k, min_bytes)
        gen = torch.Generator(device=dev).manual_seed(0)
        banks = []
        for _ in range(copies):
            w13, w2 = gpu_nvfp4((e, 2 * i, h), gen), gpu_nvfp4((e, h, i), gen)
            d13 = 0.004 + 0.004 * torch.rand(e, device=dev, generator=gen)
            d2 = 0.004 + 0.004 * torch.rand(e, device=dev, generator=gen)
            banks.append((w13, d13, w2, d2))
        print(f"# {name}: H={h} I={i} E={e} top_k={k}, {copies} bank copies "
              f"({copies * e * expert_bytes(h, i) / 1e9:.1f} GB)", flush=True)
        for t in tokens:
            shape = dict(num_tokens=t, top_k=k, global_experts=e, hidden=h, intermediate=i)
            decode = decode_tier_plan(cap, t, hidden=h, intermediate=i)
            today = tiers_moe_plan(cap, w4a4=False, **shape)
            if decode is None:
                raise ValueError(f"{cap}: the dispatch has no decode plan here (rows for sm_90 and sm_120)")
            x = torch.randn(t, h, device=dev, generator=gen).to(dtype)
            routes = []
            for _ in range(copies):
                tw, ti = torch.softmax(torch.randn(t, e, device=dev, generator=gen), -1).topk(k, -1)
                routes.append(((tw / tw.sum(-1, keepdim=True)).float().contiguous(), ti.to(torch.int32).contiguous()))
            touched = [int(torch.unique(ti).numel()) for _, ti in routes]
            out = torch.empty_like(x)

            def calls(plan):
                def run():
                    for (w13, d13, w2, d2), (tw, ti) in zip(banks, routes):
                        layer(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, plan=plan, out=out)
                return run

            (w13, d13, w2, d2), (tw, ti) = banks[0], routes[0]
            got = layer(x, w13.codes, w13.scales, d13, w2.codes, w2.scales, d2, tw, ti, plan=decode)
            ref = moe_ref(x, w13, d13, w2, d2, tw, ti)
            scale = float(ref.float().abs().max()) if ref.numel() else 1.0
            rel_err = float((got.float() - ref.float()).abs().max()) / (scale or 1.0) if ref.numel() else 0.0
            decode_s = time_graph(calls(decode)) / copies
            today_s = time_graph(calls(today)) / copies
            picks = table_moe_plan(cap, w4a4=False, **shape).impl == "decode"
            rows.append(decode_row(name, h, i, e, k, t, touched, read_tbs, decode_s, today_s, picks, decode.tier,
                                   today.tier, rel_err))
            print(_fmt_decode(rows[-1]), flush=True)
        del banks
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _fmt_decode(r: DecodeRow) -> str:
    flag = "" if r.rel_err <= 2.0**-7 else f"  WRONG (relative error {r.rel_err:.3g})"
    return (f"{r.model:20} T={r.t:3} experts {r.experts_touched:6.1f} floor {r.floor_us:7.1f} us | decode "
            f"{r.decode_us:8.1f} us ({r.fraction_of_floor:4.2f} of floor) | today {r.today_us:8.1f} us | "
            f"{r.speedup:4.2f}x | table: {'decode' if r.table_picks_decode else 'tiers'} [{r.decode_plan}]{flag}")


def decode_markdown(rows: list[DecodeRow]) -> str:
    """The rows as the docs' table."""
    lines = ["| model (H, I, E, top_k) | T | experts touched | floor µs | decode µs (of floor) | today's path µs | "
             "speedup | table picks |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} ({r.h}, {r.i}, {r.e}, {r.top_k}) | {r.t} | {r.experts_touched:.1f} | "
                     f"{r.floor_us:.1f} | {r.decode_us:.1f} ({r.fraction_of_floor:.2f}) | {r.today_us:.1f} | "
                     f"{r.speedup:.2f}× | {'decode' if r.table_picks_decode else 'tiers'} |")
    return "\n".join(lines)


@triton.jit
def _empty_kernel(x_ptr):
    pass


def empty_launch_us() -> dict:
    """A graph of two empty kernels replayed alone (graph launch latency), and two empty kernels inside a long graph
    (what two dependent launches cost inside a model's graph)."""
    buf = torch.empty(1, device="cuda")
    kernel = _empty_kernel

    def pair():
        kernel[(1,)](buf)
        kernel[(1,)](buf)

    alone = time_graph(pair)
    many = time_graph(lambda: [pair() for _ in range(50)]) / 50
    return {"graph_of_two_empty_kernels_us": alone * 1e6, "two_empty_kernels_in_a_long_graph_us": many * 1e6}


def _fmt(r: Row) -> str:
    return (f"{r.model:14} {r.layer:9} {r.n:6} {r.k:6} {r.t:5}  {r.kernel:58} {r.us:10.1f} us "
            f"{r.tflops:8.1f} TFLOP/s {r.read_tbs:6.2f} TB/s {r.note}")


# ---- compare: our kernels next to vLLM's NVFP4 kernels and cuBLAS bf16 (``vllm-nvfp4-sm120 bench``)-----------------

# vLLM 0.33's NVFP4 linear kernel classes we time (``vllm.model_executor.kernels.linear``), by short name:
# (label, class name, needs activation scales).  Each is used through its public class API
# (``process_weights_after_loading`` + ``apply_weights``), i.e. exactly what a vLLM layer runs.
VLLM_LINEAR_KERNELS = (
    ("vllm-cutlass", "CutlassNvFp4LinearKernel", True),
    ("vllm-flashinfer-cutlass", "FlashInferCutlassNvFp4LinearKernel", True),
    ("vllm-flashinfer-b12x", "FlashInferB12xNvFp4LinearKernel", True),
    ("vllm-b12x", "B12xNvFp4LinearKernel", True),
    ("vllm-flashinfer-cute-dsl-w4a16", "FlashInferCuteDslNvFp4W4A16LinearKernel", False),
    ("vllm-b12x-w4a16", "B12xNvFp4W4A16LinearKernel", False),
    ("vllm-marlin", "MarlinNvFp4LinearKernel", False),
    ("vllm-emulation", "EmulationNvFp4LinearKernel", True),
)
COMPARE_GROUPS = ("ours", "vllm", "cublas")


def progress(total: int, desc: str):
    """tqdm when installed (vLLM brings it), else a plain counter on stderr (the H200 image may lack tqdm)."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="run", file=sys.stderr)
    except ImportError:
        class _Plain:
            n = 0

            def update(self, k=1):
                self.n += k
                print(f"\r{desc}: {self.n}/{total}", end="", file=sys.stderr, flush=True)

            def set_postfix_str(self, s):
                pass

            def close(self):
                print(file=sys.stderr)

        return _Plain()


def require_matplotlib():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt
    except ImportError:
        return None


def bench_shapes(args: argparse.Namespace) -> tuple[list[tuple[str, str, int, int]], bool | None]:
    """``[(model, layer, N, K), ...]`` from ``--checkpoint`` (via inspect) or the built-in ``--models``.

    Also returns the checkpoint's W4A4-ness (None for the built-in list: both kinds are timed).
    """
    if args.checkpoint:
        from .inspect_ckpt import inspect_checkpoint

        r = inspect_checkpoint(args.checkpoint)
        name = Path(args.checkpoint).name
        return [(name, kind, n, k) for kind, n, k in r.runtime_shapes], r.quant.scheme != "W4A16"
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        raise ValueError(f"--models: unknown {unknown}; built in: {', '.join(MODELS)}")
    return [(m, layer, n, k) for m in args.models.split(",") for layer, n, k in MODELS[m]], None


def _why(e: Exception) -> str:
    """An exception as one line for the table's "not run" list."""
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def _vllm_layer(codes, scales, w_dec, in_dec, n: int, k: int):
    """A stand-in for a vLLM linear layer after the checkpoint is loaded (what a kernel class reads)."""
    p = lambda t: torch.nn.Parameter(t, requires_grad=False)  # noqa: E731
    layer = torch.nn.Module()
    layer.weight = p(codes.clone())
    layer.weight_scale = p(scales.clone())
    layer.weight_global_scale = p(w_dec.clone())
    if in_dec is not None:
        layer.input_global_scale = p(in_dec.clone())
        layer.input_global_scale_inv = p(GlobalScale.from_decode(in_dec).enc)
        layer.alpha = p((in_dec * w_dec).to(torch.float32))
    layer.input_size_per_partition, layer.output_size_per_partition = k, n
    layer.input_size, layer.output_size, layer.logical_widths = k, n, [n]
    layer.params_dtype = torch.bfloat16
    return layer


def vllm_kernel_factories(w4a4: bool | None) -> tuple[dict[str, tuple[type, bool]], dict[str, str]]:
    """``({label: (class, w4a4)}, {label: why skipped})`` for vLLM's kernels that can run on this GPU."""
    skipped: dict[str, str] = {}
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.kernels import linear as L
        from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig
    except Exception as e:  # vLLM absent (the H200 image) or broken
        return {}, {label: f"vLLM not importable ({type(e).__name__}: {e})" for label, _, _ in VLLM_LINEAR_KERNELS}
    usable = {}
    with set_current_vllm_config(VllmConfig()):
        for label, cls_name, needs_act in VLLM_LINEAR_KERNELS:
            if w4a4 is not None and needs_act != w4a4 and label != "vllm-emulation":
                skipped[label] = "not for this checkpoint's scheme"
                continue
            cls = getattr(L, cls_name, None)
            if cls is None:
                skipped[label] = f"{cls_name} not in this vLLM"
                continue
            try:
                ok, why = cls.is_supported()
                if ok:
                    ok, why = cls.can_implement(NvFp4LinearLayerConfig())
            except Exception as e:
                ok, why = False, f"{type(e).__name__}: {e}"
            if not ok:
                skipped[label] = why or "is_supported() is False"
                continue
            usable[label] = (cls, needs_act)
    return usable, skipped


def run_compare(args: argparse.Namespace) -> dict:
    """Time every candidate for every (shape, T); returns ``{"device", "ceilings", "rows", "skipped"}``."""
    from .dispatch.hw import capability_of
    from .dispatch.linear import select_linear
    from .dispatch.registry import LINEAR_KERNELS

    shapes, ckpt_w4a4 = bench_shapes(args)
    tokens = [int(t) for t in args.tokens.split(",")]
    groups = set(args.kernels.split(","))
    cap = capability_of(torch.device("cuda"))
    vllm_kernels, skipped = vllm_kernel_factories(ckpt_w4a4) if "vllm" in groups else ({}, {})
    ceilings = {"dram_read_tbs": dram_read_tbs(), "cublas_bf16_tflops_8192": cublas_bf16_tflops()}
    gen = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    bar = progress(len(shapes) * len(tokens), "bench compare")
    w_dec, in_dec = torch.tensor(0.01, device="cuda"), torch.tensor(0.01, device="cuda")
    for model, layer, n, k in shapes:
        wbytes = n * k // 2 + n * k // 16
        copies = max(1, -(-int(args.min_bytes) // wbytes))  # every call reads its weight from DRAM, not L2
        base = random_nvfp4((n, k), gen=gen, device="cuda")
        ws = [base] + [NvFp4(base.codes.clone(), base.scales.clone()) for _ in range(copies - 1)]
        dec_rows = w_dec.expand(n).contiguous()
        in_enc, alpha = GlobalScale.from_decode(in_dec).enc, in_dec * w_dec
        vlayers: dict[str, list] = {}
        for label, (cls, needs_act) in vllm_kernels.items():
            try:
                from vllm.config import VllmConfig, set_current_vllm_config
                from vllm.model_executor.kernels.linear.nvfp4.base import NvFp4LinearLayerConfig

                with set_current_vllm_config(VllmConfig()):
                    built = []
                    for w in ws:
                        kern = cls(NvFp4LinearLayerConfig())
                        lay = _vllm_layer(w.codes, w.scales, w_dec, in_dec if needs_act else None, n, k)
                        kern.process_weights_after_loading(lay)
                        built.append((kern, lay))
                vlayers[label] = built
            except Exception as e:
                skipped[f"{label} ({layer} {n}x{k})"] = _why(e)
        w_bf16 = None
        if "cublas" in groups:
            wb = unit_values(base.codes, base.scales).to(torch.bfloat16)
            w_bf16 = [wb] + [wb.clone() for _ in range(max(1, -(-int(args.min_bytes) // (2 * n * k))) - 1)]
        for t in tokens:
            x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
            cands: dict[str, tuple[Callable[[], object], int, int]] = {}  # name -> (fn, calls, bytes per call)
            if "ours" in groups:
                routes = {"triton": ckpt_w4a4 is not False, "w4a16": True}
                for route, wanted in routes.items():
                    if not wanted:
                        continue
                    plan = select_linear(cap, route, t, n, k)
                    fn = LINEAR_KERNELS[plan.kernel]
                    cands[f"ours-{route} ({plan.kernel})"] = (
                        lambda fn=fn, plan=plan: [fn(x, w.codes, w.scales, dec_rows, None, in_enc, alpha, None,
                                                     **plan.kwargs) for w in ws], copies, wbytes)
            for label, built in vlayers.items():
                cands[label] = (lambda built=built: [kern.apply_weights(lay, x) for kern, lay in built], copies, wbytes)
            if w_bf16 is not None:
                cands["cublas-bf16"] = (lambda: [x @ w.t() for w in w_bf16], len(w_bf16), 2 * n * k)
            for name, (fn, calls, nbytes) in cands.items():
                bar.set_postfix_str(f"{layer} {n}x{k} T={t} {name}"[:60])
                try:
                    sec = time_graph(fn, repeats=args.repeats) / calls
                except Exception as e:
                    skipped[f"{name} ({layer} {n}x{k} T={t})"] = _why(e)
                    torch.cuda.synchronize()
                    continue
                rows.append(Row(model, layer, n, k, t, name, sec * 1e6, 2 * t * n * k / sec / 1e12,
                                nbytes / sec / 1e12))
            bar.update(1)
        del ws, vlayers, w_bf16
        torch.cuda.empty_cache()
    bar.close()
    return {"device": f"{torch.cuda.get_device_name()} ({cap.name})", "torch": torch.__version__,
            "ceilings": ceilings, "rows": [asdict(r) for r in rows], "skipped": skipped}


def speedups(rows: list[dict]) -> list[dict]:
    """Per (model, layer, T): our best kernel against vLLM's best NVFP4 kernel and against cuBLAS bf16."""
    by_key: dict[tuple, dict[str, float]] = {}
    for r in rows:
        by_key.setdefault((r["model"], r["layer"], r["n"], r["k"], r["t"]), {})[r["kernel"]] = r["us"]
    out = []
    for (model, layer, n, k, t), us in by_key.items():
        ours = {kk: v for kk, v in us.items() if kk.startswith("ours")}
        vllm = {kk: v for kk, v in us.items() if kk.startswith("vllm-") and kk != "vllm-emulation"}
        best_ours = min(ours.items(), key=lambda kv: kv[1]) if ours else None
        best_vllm = min(vllm.items(), key=lambda kv: kv[1]) if vllm else None
        out.append(dict(
            model=model, layer=layer, n=n, k=k, t=t,
            ours=best_ours[0] if best_ours else None, ours_us=best_ours[1] if best_ours else None,
            vllm=best_vllm[0] if best_vllm else None, vllm_us=best_vllm[1] if best_vllm else None,
            cublas_us=us.get("cublas-bf16"),
            vs_vllm=best_vllm[1] / best_ours[1] if best_ours and best_vllm else None,
            vs_cublas=us["cublas-bf16"] / best_ours[1] if best_ours and "cublas-bf16" in us else None,
        ))
    return out


def format_bench_table(result: dict) -> str:
    rows = result["rows"]
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    ceil = result["ceilings"]
    lines = [f"# {result['device']}  torch {result['torch']}  DRAM read {ceil['dram_read_tbs']:.2f} TB/s, "
             f"cuBLAS bf16 {ceil['cublas_bf16_tflops_8192']:.0f} TFLOP/s",
             "# microseconds per call (weight read from DRAM); speedup = best vLLM NVFP4 kernel (or cuBLAS bf16) "
             "/ ours"]
    head = f"{'model':14} {'layer':8} {'N':>6} {'K':>6} {'T':>5} " + " ".join(f"{k[:24]:>24}" for k in kernels)
    lines.append(head + f" {'vs vLLM':>8} {'vs bf16':>8}")
    sp = {(s["model"], s["layer"], s["n"], s["k"], s["t"]): s for s in speedups(rows)}
    us = {(r["model"], r["layer"], r["n"], r["k"], r["t"], r["kernel"]): r["us"] for r in rows}
    for key, s in sp.items():
        cells = " ".join(f"{us[(*key, kk)]:24.1f}" if (*key, kk) in us else f"{'-':>24}" for kk in kernels)
        fmt = lambda v: f"{v:7.2f}x" if v else f"{'-':>8}"  # noqa: E731
        lines.append(f"{key[0][:14]:14} {key[1][:8]:8} {key[2]:6} {key[3]:6} {key[4]:5} {cells} "
                     f"{fmt(s['vs_vllm'])} {fmt(s['vs_cublas'])}")
    if result["skipped"]:
        lines.append("# not run:")
        lines += [f"#   {k}: {v}" for k, v in result["skipped"].items()]
    return "\n".join(lines)


def plot_speedups(result: dict, path: str, plt) -> None:
    sp = speedups(result["rows"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharex=True)
    for ax, key, title in ((axes[0], "vs_vllm", "ours vs vLLM's best NVFP4 kernel"),
                           (axes[1], "vs_cublas", "ours vs cuBLAS bf16")):
        series: dict[str, list[tuple[int, float]]] = {}
        for s in sp:
            if s[key]:
                series.setdefault(f"{s['model']} {s['layer']} {s['n']}x{s['k']}", []).append((s["t"], s[key]))
        for label, pts in series.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens (T)")
        ax.set_ylabel("speedup (x)")
        ax.set_title(title)
        if series:
            ax.legend(fontsize=7)
    fig.suptitle(result["device"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)




def emit_json(data, dest: str) -> None:
    """``data`` as JSON to the file ``dest`` (``-``: stdout); every tool's ``--json`` writes through here."""
    text = json.dumps(data, indent=2, default=str)
    if dest == "-":
        print(text)
    else:
        Path(dest).write_text(text)
        print(f"JSON written to {dest}")


def compare(args: argparse.Namespace) -> int:
    """``bench compare`` (the CLI's ``bench``): argument checks that need no GPU first, then the table."""
    from .inspect_ckpt import CheckpointError

    unknown = set(args.kernels.split(",")) - set(COMPARE_GROUPS)
    if unknown:
        print(f"error: --kernels: unknown {sorted(unknown)}; choose from {','.join(COMPARE_GROUPS)}", file=sys.stderr)
        return 2
    plt = None
    if args.plot:
        plt = require_matplotlib()
        if plt is None:
            print("error: --plot needs matplotlib, which is not installed (pip install matplotlib); "
                  "run without --plot, or with --json and plot later", file=sys.stderr)
            return 2
    try:
        bench_shapes(args)  # validate the shapes source before asking for a GPU
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: bench needs a CUDA GPU (none visible); `env` and `selftest` run without one", file=sys.stderr)
        return 2
    result = run_compare(args)
    print(format_bench_table(result))
    if args.json:
        emit_json(dict(result, speedups=speedups(result["rows"])), args.json)
    if plt is not None:
        plot_speedups(result, args.plot, plt)
        print(f"plot written to {args.plot}")
    return 0


def add_compare_args(p: argparse.ArgumentParser) -> None:
    """The options of ``compare``; the CLI's ``bench`` subcommand is built from the same function."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", metavar="DIR", help="time the linear shapes of this checkpoint")
    src.add_argument("--models", default=",".join(MODELS), help=f"built-in shape lists: {', '.join(MODELS)}")
    p.add_argument("--tokens", default="1,4,16,64,256,2048,8192", help="batch sizes T")
    p.add_argument("--kernels", default=",".join(COMPARE_GROUPS), help=f"groups: {','.join(COMPARE_GROUPS)}")
    p.add_argument("--min-bytes", type=float, default=2e9, help="weight bytes per timed run (defeats the L2)")
    p.add_argument("--repeats", type=int, default=20, help="graph replays per measurement (median)")
    p.add_argument("--plot", metavar="PNG", help="write a speedup-vs-tokens plot (needs matplotlib)")
    p.add_argument("--json", metavar="PATH", help="write rows, speedups and skips as JSON ('-': stdout)")
    p.set_defaults(func=compare)


# ---- the kernel benchmarks (no vLLM)--------------------------------------------------------------------------------

KERNEL_BENCHES = {  # name: (help, default --models, default --tokens)
    "linear": ("our linear kernels at every T, next to cuBLAS bf16", ",".join(MODELS), TOKENS),
    "moe": ("the whole MoE layer, next to cuBLAS bf16 on the same FLOPs", ",".join(MOE_SHAPES), MOE_TOKENS),
    "moe_decode": ("the MoE layer at decode sizes: the decode plan, today's path, the bytes floor",
                   ",".join(MOE_SHAPES), DECODE_TOKENS),
    "act_quant": ("the activation quantizer at the K of the built-in models", ",".join(MODELS), TOKENS),
    "sweep_gemv": ("every tile of the Triton W4A16 decode kernel (data for the dispatch rules)", ",".join(MODELS),
                   TOKENS),
    "sweep_dequant_mm": ("dequant + cuBLAS chunk sizes around the dispatch rule's", ",".join(MODELS), TOKENS),
    "ceilings": ("the DRAM read bandwidth and cuBLAS bf16 rate only", ",".join(MODELS), TOKENS),
    "sweep_act_quant": ("every candidate tile of the activation quantizer (data for its dispatch rule)",
                        ",".join(MODELS), (2048, 8192)),
}


def run_kernel_bench(args: argparse.Namespace) -> int:
    models, tokens, min_bytes = args.models.split(","), [int(t) for t in args.tokens.split(",")], int(args.min_bytes)
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    ceil = {"dram_read_tbs": dram_read_tbs(), "cublas_bf16_tflops_8192": cublas_bf16_tflops()}
    print(f"# ceilings: DRAM read {ceil['dram_read_tbs']:.2f} TB/s, cuBLAS bf16 8192^3 "
          f"{ceil['cublas_bf16_tflops_8192']:.0f} TFLOP/s", flush=True)
    rows: list[Row] = []
    ratios = None
    if args.what == "linear":
        rows = bench_linear(models, tokens, min_bytes, args.kernels.split(","), peers=args.peers,
                            gemlite_autotune=args.gemlite_autotune)
        ratios = peer_ratios(rows)
        for r in ratios:
            print(f"# {r['model']}/{r['layer']} T={r['t']}: {r['peer']} {r['peer_us']:.1f} us, ours {r['ours_us']:.1f} "
                  f"us ({r['ours']}): ours {r['x']:.2f}x faster", flush=True)
    elif args.what == "moe":
        rows = bench_moe(models, tokens)
    elif args.what == "moe_decode":
        ceil |= empty_launch_us()
        print(f"# empty launches: graph of two alone {ceil['graph_of_two_empty_kernels_us']:.2f} us, two inside a "
              f"long graph {ceil['two_empty_kernels_in_a_long_graph_us']:.2f} us", flush=True)
        rows = bench_moe_decode(models, tokens, args.min_bytes, ceil["dram_read_tbs"])
        print("\n" + decode_markdown(rows), flush=True)
    elif args.what == "sweep_dequant_mm":
        rows = sweep_dequant_mm(models, tokens)
    elif args.what == "sweep_gemv":
        rows = sweep_w4a16_gemv(models, tokens, min_bytes)
    elif args.what == "act_quant":
        rows = bench_act_quant([5120, 8192, 25600, 28672], tokens, ceil["dram_read_tbs"])
    elif args.what == "sweep_act_quant":
        rows = sweep_act_quant([5120, 8192, 25600, 28672], tokens, ceil["dram_read_tbs"])
    if args.json:
        emit_json({"ceilings": ceil, "rows": [asdict(r) for r in rows]} | (
            {"peer_ratios": ratios} if ratios is not None else {}), args.json)
    return 0


def _peer_list(text: str) -> list[str]:
    names = [p for p in text.split(",") if p]
    if bad := [p for p in names if p not in PEERS]:
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(bad)}; known: {', '.join(PEERS)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m vllm_nvfp4_sm120.bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    add_compare_args(sub.add_parser("compare", help="our kernels vs vLLM's NVFP4 kernels (where vLLM imports) and "
                                                    "cuBLAS bf16 (the CLI's `bench`)"))
    for what, (help_, models, tokens) in KERNEL_BENCHES.items():
        b = sub.add_parser(what, help=help_)
        b.add_argument("--models", default=models, help="comma list of built-in shapes")
        b.add_argument("--tokens", default=",".join(map(str, tokens)), help="batch sizes T")
        b.add_argument("--kernels", default="w4a16,gluon,stream,w4a4,cublas-bf16,naive", help="candidates (linear)")
        b.add_argument("--min-bytes", type=float, default=2e9, help="weight bytes per timed run (defeats the L2)")
        b.add_argument("--json", metavar="PATH", help="write rows as JSON ('-': stdout)")
        if what == "linear":
            b.add_argument("--peers", type=_peer_list, default=[],
                           help=f"peer libraries timed beside ours where importable, comma list of: {', '.join(PEERS)}")
            b.add_argument("--gemlite-autotune", choices=GEMLITE_AUTOTUNE, default="default",
                           help="gemlite's autotuner setting (fast / max: minutes of compiles per shape)")
        b.set_defaults(func=run_kernel_bench)
    from . import bench_host

    h = sub.add_parser("host", help="host time per call of our ops next to cuBLAS and a trivial Triton launch; "
                                    "--cold: compile time from an empty Triton cache")
    bench_host.add_args(h)
    h.set_defaults(func=bench_host.run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
