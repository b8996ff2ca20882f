"""The activation quantizer against the ceiling of its own memory traffic, side by side on the GPU present.

    source .carry/env.sh && python benchmarks/act_quant_ceiling.py --out $OUT [--ks 5120,...] [--tokens 2048,8192]

For each ``[T, K]``: ``kernels.act_quant.quantize_act_nvfp4`` on the dispatch's tile, and a twin kernel with the same
grid, tile, loads and stores (bf16 read as 32-bit pairs, one byte written per pair, one per 16 elements) but no
quantization: each output byte is a fold of the words it stands for (the xor of a pair's halves; the xor of a
block's pairs), so nothing can be left out, and each is checked against torch before it is timed.  What the twin
takes is what any kernel of this access pattern takes on this GPU, the launch's ramp and tail included: where the
quantizer is at the twin, its row is limited by the traffic, not by its instructions.  Bytes moved = read + write;
fractions of the DRAM read bandwidth measured in the same run (``bench.dram_read_tbs``), medians of CUDA-graph
replays over copies of ``x`` beyond L2 (``bench.time_graph``).  Runs without vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@triton.jit(do_not_specialize=["T"])
def _traffic_twin_kernel(x_ptr, codes_ptr, sf_ptr, T, K, stride_xt, stride_ct, stride_st,
                         BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    # The quantizer's tile: BLOCK_T rows x BLOCK_K elements, read as BLOCK_K / 2 32-bit pairs per row.
    P: tl.constexpr = BLOCK_K // 2
    NB: tl.constexpr = BLOCK_K // 16
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    pairs = tl.program_id(1) * P + tl.arange(0, P)
    mask = (rows < T)[:, None] & (pairs < K // 2)[None, :]
    rows64 = rows.to(tl.int64)
    p = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + rows64[:, None] * (stride_xt // 2) + pairs[None, :],
                mask=mask, other=0, eviction_policy="evict_last")
    code = (p ^ (p >> 16)) & 0xFF  # one byte per pair, as the codes
    tl.store(codes_ptr + rows64[:, None] * stride_ct + pairs[None, :], code.to(tl.uint8), mask=mask)
    sf = tl.xor_sum(tl.reshape(p, (BLOCK_T, NB, 8)), axis=2) & 0xFF  # one byte per 16 elements, as the scales
    blk = tl.program_id(1) * NB + tl.arange(0, NB)
    tl.store(sf_ptr + rows64[:, None] * stride_st + blk[None, :], sf.to(tl.uint8),
             mask=(rows < T)[:, None] & (blk < K // 16)[None, :])


def traffic_twin(x: torch.Tensor, codes: torch.Tensor, sf: torch.Tensor, *, block_t: int, block_k: int,
                 num_warps: int):
    """Run the twin on ``x [T, K]`` bf16 (rows 4-byte aligned) into ``codes [T, K/2]`` / ``sf [T, K/16]`` uint8."""
    t, k = x.shape
    grid = (triton.cdiv(t, block_t), triton.cdiv(k, block_k))
    _traffic_twin_kernel[grid](x, codes, sf, t, k, x.stride(0), codes.stride(0), sf.stride(0), BLOCK_T=block_t,
                               BLOCK_K=block_k, num_warps=num_warps)
    return codes, sf


def traffic_twin_ref(x: torch.Tensor):
    """What :func:`traffic_twin` writes, in torch."""
    p = x.contiguous().view(torch.int32)
    code = ((p ^ (p >> 16)) & 0xFF).to(torch.uint8)
    t, half = p.shape
    blocks = p.reshape(t, half // 8, 8)
    sf = blocks[..., 0]
    for j in range(1, 8):
        sf = sf ^ blocks[..., j]
    return code, (sf & 0xFF).to(torch.uint8)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="5120,8192,25600,28672")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--out", default=None, help="folder for act_quant_ceiling.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("act_quant_ceiling.py: needs a CUDA GPU")
    from vllm_nvfp4_sm120.bench import _copies, act_quant_bytes, dram_read_tbs, time_graph
    from vllm_nvfp4_sm120.dispatch.linear import act_quant_config
    from vllm_nvfp4_sm120.kernels.act_quant import quantize_act_nvfp4

    bw = dram_read_tbs()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"DRAM read {bw:.2f} TB/s", flush=True)
    in_enc = torch.tensor(100.0, device="cuda")
    rows = []
    for k in [int(v) for v in args.ks.split(",")]:
        for t in [int(v) for v in args.tokens.split(",")]:
            tile = act_quant_config(t, k)
            xs = [torch.randn(t, k, device="cuda").to(torch.bfloat16) for _ in range(_copies(2 * t * k, 1 << 30))]
            codes = torch.empty(t, k // 2, dtype=torch.uint8, device="cuda")
            sf = torch.empty(t, k // 16, dtype=torch.uint8, device="cuda")
            want = traffic_twin_ref(xs[0])
            got = traffic_twin(xs[0], codes, sf, **tile)
            if not (torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])):
                raise AssertionError(f"traffic twin differs from torch at T={t} K={k}")
            moved = act_quant_bytes(t, k)
            quant = time_graph(lambda: [quantize_act_nvfp4(x, in_enc, **tile) for x in xs]) / len(xs)
            twin = time_graph(lambda: [traffic_twin(x, codes, sf, **tile) for x in xs]) / len(xs)
            row = {"K": k, "T": t, "tile": tile, "bytes": moved, "quant_us": quant * 1e6, "twin_us": twin * 1e6,
                   "floor_us": moved / (bw * 1e12) * 1e6, "quant_of_read_bw": moved / quant / 1e12 / bw,
                   "twin_of_read_bw": moved / twin / 1e12 / bw, "quant_over_twin": quant / twin}
            rows.append(row)
            print(f"K={k:6d} T={t:5d}  quant {row['quant_us']:7.1f} us ({row['quant_of_read_bw']:.2f} of read BW)  "
                  f"twin {row['twin_us']:7.1f} us ({row['twin_of_read_bw']:.2f})  quant / twin "
                  f"{row['quant_over_twin']:.2f}  floor {row['floor_us']:.1f} us", flush=True)
            del xs
            torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "act_quant_ceiling.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "dram_read_tbs": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
