#!/usr/bin/env python3
"""Offline generation with vllm.LLM and the plugin (it registers itself through vLLM's plugin entry point).

    python examples/offline.py MODEL_DIR [--linear-backend nvfp4_sm120] [--moe-backend nvfp4_sm120]

A W4A4 checkpoint on sm_120 needs no flag (vLLM's auto selection picks our linear kernels); a W4A16 checkpoint
needs --linear-backend nvfp4_sm120 (vLLM forces Marlin otherwise).  The log line "vllm.nvfp4_sm120" names the
kernel each layer kind got.
"""

import argparse

from vllm import LLM, SamplingParams


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--linear-backend", default="auto")
    p.add_argument("--moe-backend", default="auto")
    p.add_argument("--prompt", default="The capital of France is")
    args = p.parse_args()
    llm = LLM(model=args.model, linear_backend=args.linear_backend, moe_backend=args.moe_backend,
              max_model_len=1024, gpu_memory_utilization=0.5)
    out = llm.generate([args.prompt], SamplingParams(max_tokens=16, temperature=0.0))
    print(repr(out[0].outputs[0].text))


if __name__ == "__main__":
    main()
