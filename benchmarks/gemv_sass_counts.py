"""SASS instructions per weight byte of the W4A16 decode kernels, for sm_90 (H200) and sm_120 (CPU only).

    python benchmarks/gemv_sass_counts.py [--out DIR]

Compiles each kernel with ``kernels.aot`` and counts, per code byte a thread decodes:
- the streaming kernel (``gluon_gemv_stream``): its main loop (two steps; see ``kernels.sass_stats``);
- today's ``gluon_gemv`` kernels (K unrolled, no loop): the whole kernel at K = 5120, divided by the code bytes
  of one thread (the prologue and epilogue are a few percent of it).
Pipes on sm_90 (CUDA guide, per SM and clock): 64 lanes for integer/logic (LOP3, SHF, PRMT, IADD3) and for IMAD,
128 for fp32 / fp16x2 (HMUL2, HFMA2, FMUL), 4 warp-instructions issued.  The H200 moves 16.8 weight bytes per SM
and clock at 4.4 TB/s, so at full read bandwidth the budget is 7.6 issued instructions per byte (128 / 16.8) and
3.8 integer/logic ones.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_nvfp4_sm120.kernels import gluon_gemv as gg  # noqa: E402
from vllm_nvfp4_sm120.kernels import gluon_gemv_stream as gs  # noqa: E402
from vllm_nvfp4_sm120.kernels.aot import compile_kernel  # noqa: E402
from vllm_nvfp4_sm120.kernels.sass_stats import main_loop, parse_sass  # noqa: E402

CLASSES = {
    "alu (LOP3 SHF PRMT IADD3 LEA SEL)": r"(LOP3|SHF|PRMT|IADD3|LEA|SEL|VIADD|IABS|ISETP)\b.*",
    "imad": r"IMAD\b.*",
    "fp16x2 / fp32": r"(HMUL2|HFMA2|HADD2|FMUL|FADD|FFMA)\b.*",
    "f2fp (cvt)": r"F2FP\b.*",
    "mma": r"HMMA\b.*",
    "loads": r"LDG\b.*",
}


def _counts(ops: dict[str, int], nbytes: float) -> dict[str, float]:
    out = {name: sum(n for op, n in ops.items() if re.fullmatch(pat, op)) / nbytes for name, pat in CLASSES.items()}
    out["total"] = sum(ops.values()) / nbytes
    return out


def stream_variant(tile, arch, decode, dtype="bf16"):
    sig = dict(gs.STREAM_SIGNATURE)
    for a in ("x_ptr", "bias_ptr", "out_ptr"):
        sig[a] = f"*{dtype}"
    consts = dict(HAS_BIAS=False, DECODE=decode, EVEN_K=True, **tile.constexprs)
    rep = compile_kernel("vllm_nvfp4_sm120.kernels.gluon_gemv_stream:_stream_kernel", sig, consts, arch=arch,
                         num_warps=tile.num_warps, divisible=gs.STREAM_DIVISIBLE, gluon=True, maxnreg=tile.max_regs)
    loop = main_loop(rep.sass)
    nbytes = 2 * (tile.block_m // tile.row_warps // 8) * 16  # two steps, 16 code bytes per row and lane
    return rep, _counts(dict(loop.ops), nbytes)


def today_variant(kind, tile, arch, decode, k=5120):
    sig = dict(gg.GEMV_FMA_SIGNATURE if kind == "fma" else gg.GEMV_MMA_SIGNATURE)
    consts = dict(K=k, HAS_BIAS=False, DECODE=decode, BLOCK_T=tile.block_t, WARPS=tile.num_warps)
    if kind == "fma":
        consts["ROWS_PER_WARP"] = tile.rows_per_warp
    name = "_gemv_fma_kernel" if kind == "fma" else "_gemv_mma_kernel"
    rep = compile_kernel(f"vllm_nvfp4_sm120.kernels.gluon_gemv:{name}", sig, consts, arch=arch,
                         num_warps=tile.num_warps, divisible=gg.GEMV_FMA_DIVISIBLE, gluon=True)
    ops: dict[str, int] = {}
    for _, op, _ in parse_sass(rep.sass):
        ops[op] = ops.get(op, 0) + 1
    rows = tile.rows_per_warp * tile.num_warps if kind == "fma" else 16
    nbytes = rows * k / 2 / (tile.num_warps * 32)
    return rep, _counts(ops, nbytes)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="folder for gemv_sass_counts.json")
    args = p.parse_args(argv)
    variants = []
    for arch, decode in ((90, gs.DECODE_SHIFT), (90, gs.DECODE_PORTABLE), (120, gs.DECODE_CVT), (120, gs.DECODE_SHIFT)):
        for tile in (gs.StreamTile(128, 8, 4, 2), gs.StreamTile(128, 16, 4, 2), gs.StreamTile(32, 8)):
            variants.append((f"stream {tile.block_m}x{tile.block_t} r{tile.row_warps} {gs.DECODE_NAMES[decode]}",
                             arch, lambda t=tile, a=arch, d=decode: stream_variant(t, a, d)))
    for arch, decode in ((90, gg.DECODE_PORTABLE), (120, gg.DECODE_CVT)):
        name = gs.DECODE_NAMES[decode]
        variants.append((f"today mma bt8 w4 {name}", arch, lambda a=arch, d=decode: today_variant(
            "mma", gg.MmaTile(8, 4), a, d)))
        variants.append((f"today mma bt16 w4 {name}", arch, lambda a=arch, d=decode: today_variant(
            "mma", gg.MmaTile(16, 4), a, d)))
        variants.append((f"today fma bt1 {name}", arch, lambda a=arch, d=decode: today_variant(
            "fma", gg.FmaTile(1, 1, 4), a, d)))
    results = []
    head = f"{'variant':34} {'sm':>4} {'regs':>5} {'total':>6} " + " ".join(f"{c.split()[0]:>7}" for c in CLASSES)
    print("# SASS instructions per code byte and thread (main loop for the streaming kernel)")
    print(head, flush=True)
    for name, arch, build in variants:
        rep, c = build()
        results.append({"variant": name, "arch": arch, "registers": rep.registers, **c})
        print(f"{name:34} {arch:4} {rep.registers:5} {c['total']:6.2f} "
              + " ".join(f"{c[k]:7.2f}" for k in CLASSES), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gemv_sass_counts.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
