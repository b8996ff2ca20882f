#!/usr/bin/env python3
"""Write a tiny but real NVFP4 checkpoint (2-layer Qwen3-MoE, 4 experts, top-2, random weights) that vLLM loads.

    python examples/make_tiny_checkpoint.py /tmp/tiny                      # ModelOpt and compressed-tensors, W4A4
    python examples/make_tiny_checkpoint.py /tmp/tiny --format modelopt --w4a16
    vllm-nvfp4-sm120 inspect /tmp/tiny/modelopt-w4a4
    bash examples/serve.sh /tmp/tiny/modelopt-w4a4                         # on a GPU

Each checkpoint has config.json, the quant config (hf_quant_config.json for ModelOpt, quantization_config in
config.json for compressed-tensors), model.safetensors with the exporters' tensor names, and a byte-level
tokenizer, so `vllm serve` and `vllm.LLM` accept it.  The outputs are random text: this checks plumbing and
kernels, not accuracy.  The writer lives in the package (vllm_nvfp4_sm120/tiny_checkpoint.py) because
`vllm-nvfp4-sm120 inspect` and the tests use it too.
"""

import argparse

from vllm_nvfp4_sm120.tiny_checkpoint import FORMATS, write_tiny_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output folder; one sub-folder <format>-<w4a4|w4a16> per checkpoint")
    p.add_argument("--format", choices=[*FORMATS, "both"], default="both")
    p.add_argument("--w4a16", action="store_true", help="weight-only checkpoints (no static input scales)")
    p.add_argument("--shared-fused-globals", action="store_true",
                   help="one weight global per fused group (q/k/v, gate/up): no spread for the plugin to warn about")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for fmt in FORMATS if args.format == "both" else [args.format]:
        out = write_tiny_checkpoint(f"{args.out}/{fmt}-{'w4a16' if args.w4a16 else 'w4a4'}", fmt, w4a16=args.w4a16,
                                    shared_fused_globals=args.shared_fused_globals, seed=args.seed)
        print(out)


if __name__ == "__main__":
    main()
