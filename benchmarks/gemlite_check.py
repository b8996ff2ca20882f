"""gemlite's NVFP4 layer through ``peers.gemlite_nvfp4_linear`` against our reference, on the GPU present.

    source .carry/env.sh && source .carry/peers.sh && python benchmarks/gemlite_check.py [--autotune default]

For Qwen3-32B qkv (10240 x 5120) and o (5120 x 8192) and T in {1, 16}, on one random NVFP4 weight per shape
(``random_nvfp4``, one decode global as in linear_decode_sweep.py), three checks per row:

* ``columns``: x = rows of the identity at ``--columns`` random K positions, T at a time.  Every K-split of
  gemlite's kernel but one then sums zeros, so the output is column k of the dequantized weight times the global,
  rounded once, whatever the split: it must equal ``bf16(unit_values[:, k] * dec)`` bit for bit.  A layout, nibble
  order, code table, scale orientation or global mistake shows here as O(1) errors.
* ``random``: x ~ N(0, 1) against ``linear_w4a16_ref``: the greatest relative difference (as
  ``torch.testing.assert_close`` reports it), the mismatches at linear_decode_sweep.py's check (rtol 1.6e-2,
  atol 1e-4) and the largest difference over the largest output; then against ``peers.gemlite_split_k_ref`` with
  the SPLIT_K and BLOCK_SIZE_K gemlite's autotuner chose (split-K rounding modelled: only atomic-add order left).
* ``split1``: the same x with gemlite's gemm_splitK kernel pinned to its SPLIT_K = 1 default config: the
  elementwise reference check must then pass.

Prints one line per check and exits 1 if a ``columns`` or ``split1`` check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_nvfp4_sm120.format import linear_w4a16_ref, random_nvfp4, unit_values  # noqa: E402
from vllm_nvfp4_sm120.peers import gemlite_nvfp4_linear, gemlite_split_k_ref  # noqa: E402

SHAPES = (("qwen3-32b/qkv", 10240, 5120), ("qwen3-32b/o", 5120, 8192))
DEC = 0.0125


def import_gemlite(mode: str):
    """gemlite's gemm_splitK kernel module, its autotuner set to ``mode`` first (gemlite reads the setting when its
    kernel modules load, which importing any part of gemlite does)."""
    if "gemlite" not in sys.modules:
        spec = importlib.util.find_spec("gemlite")
        if spec is None:
            sys.exit("gemlite not importable (not on the path; source .carry/peers.sh)")
        cfg_path = Path(spec.origin).parent / "triton_kernels" / "config.py"
        cfg_spec = importlib.util.spec_from_file_location("gemlite.triton_kernels.config", cfg_path)
        cfg = importlib.util.module_from_spec(cfg_spec)
        cfg_spec.loader.exec_module(cfg)
        for key in cfg.MATMUL_DTYPES:
            setattr(cfg.AUTOTUNE, key, mode)
        sys.modules["gemlite.triton_kernels.config"] = cfg
    import gemlite
    from gemlite.triton_kernels import gemm_splitK_kernels

    print(f"# gemlite {gemlite.__version__}, triton {triton.__version__}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()}, autotune {mode}", flush=True)
    return gemm_splitK_kernels


def pin_split1(gk) -> None:
    """Restrict gemlite's NVFP4 gemm_splitK kernel to its first default config (SPLIT_K = 1): with one config
    Triton's autotuner neither prunes nor benchmarks, so the kernel's NUM_STAGES (the pruner adds it) is given."""
    base = gk.get_default_config_nvidia()[0]
    assert base.kwargs["SPLIT_K"] == 1, base
    kern = gk.gemm_splitK_MX_kernel
    kern.configs = [triton.Config({**base.kwargs, "NUM_STAGES": base.num_stages}, num_warps=base.num_warps,
                                  num_stages=base.num_stages)]
    kern.cache.clear()


def compare(got: torch.Tensor, want: torch.Tensor) -> str:
    d = (got.float() - want.float()).abs()
    w = want.float().abs()
    rel = (d / w).nan_to_num(nan=0.0, posinf=float("inf")).max().item()  # assert_close's "greatest relative"
    bad = int((d > 1e-4 + 1.6e-2 * w).sum())
    return (f"greatest rel {rel:.3g}, mismatched {bad}/{d.numel()} at rtol 1.6e-2 atol 1e-4, "
            f"max|d|/max|ref| {(d.max() / w.max()).item():.2e}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--autotune", choices=["default", "fast", "max"], default="default")
    p.add_argument("--columns", type=int, default=256, help="K positions probed by the one-hot check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shapes", default=",".join(f"{n}x{k}" for _, n, k in SHAPES),
                   help="NxK,... (default: %(default)s)")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (the interpreter version of these checks is tests/test_peers.py)")
    gk = import_gemlite(args.autotune)
    dev = torch.device("cuda")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    names = {(n, k): f"{name} {n}x{k}" for name, n, k in SHAPES}
    gen = torch.Generator().manual_seed(args.seed)
    problems = []
    for n, k in (tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")):
        name = names.get((n, k), f"{n}x{k}")
        w = random_nvfp4((n, k), gen=gen, device=dev)
        dec_rows = torch.full((n,), DEC, device=dev)
        layer = gemlite_nvfp4_linear(w.codes, w.scales, dec_rows, dtype=dtype)
        if isinstance(layer, str):
            sys.exit(f"gemlite: {layer}")
        ms = float(layer.meta_scale)
        print(f"{name}: W_q {list(layer.W_q.shape)} strides {layer.W_q.stride()}, scales "
              f"{list(layer.scales.shape)} {layer.scales.dtype} strides {layer.scales.stride()}, meta_scale {ms!r} "
              f"({'==' if ms == float(dec_rows[0]) else '!='} dec)", flush=True)
        problems.append((name, n, k, w, dec_rows, layer))

    failed = []
    for pinned in (False, True):
        if pinned:
            pin_split1(gk)
        for name, n, k, w, dec_rows, layer in problems:
            wdec = (unit_values(w.codes, w.scales) * DEC).to(dtype)  # [N, K]
            for t in (1, 16):
                tag = f"{name} T={t}"
                x = torch.randn(t, k, generator=gen).to(dev, dtype)
                want = linear_w4a16_ref(x, w.codes, w.scales, dec_rows)
                got = layer(x)
                cfg = gk.gemm_splitK_MX_kernel.best_config.kwargs
                split_k, block_k = cfg["SPLIT_K"], cfg["BLOCK_SIZE_K"]
                if pinned:
                    line = compare(got, want)
                    ok = bool(torch.isclose(got.float(), want.float(), rtol=1.6e-2, atol=1e-4).all())
                    print(f"  split1  {tag}: {line}  {'ok' if ok else 'FAILED'}", flush=True)
                    if not ok:
                        failed.append(f"split1 {tag}")
                    continue
                model = gemlite_split_k_ref(x, w.codes, w.scales, dec_rows, split_k=split_k, block_k=block_k)
                print(f"  random  {tag} (SPLIT_K {split_k}, BLOCK_SIZE_K {block_k}): vs reference: "
                      f"{compare(got, want)}; vs split-K model: {compare(got, model)}", flush=True)
                cols = torch.randperm(k, generator=gen)[:args.columns]
                worst, wrong = 0.0, 0
                for chunk in cols.split(t):
                    xe = torch.zeros(len(chunk), k, device=dev, dtype=dtype)
                    xe[torch.arange(len(chunk)), chunk.to(dev)] = 1
                    out = layer(xe)
                    ref = wdec[:, chunk.to(dev)].t()
                    wrong += int((out != ref).sum())
                    rel = (out.float() - ref.float()).abs() / ref.float().abs()
                    worst = max(worst, rel.nan_to_num(0).max().item())
                ok = wrong == 0
                print(f"  columns {tag}: {len(cols)} one-hot inputs, {wrong} output elements not bit-equal "
                      f"(greatest rel {worst:.3g})  {'ok' if ok else 'FAILED'}", flush=True)
                if not ok:
                    failed.append(f"columns {tag}")
    print("# all columns and split1 checks passed" if not failed else f"# FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
