#!/usr/bin/env bash
# The TMA expert-major down at I = 768 and T = 6-8 through the op (GPU tests against moe_ref, then the dispatch's
# table timed against today's path), and the linear streaming plan against twice its one-wave grid.  About 6 minutes.
set -x
source .carry/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu -n 6 tests/dispatch/test_moe_flow.py -k "decode" 2>&1 | tail -5
timeout 100 python3 -m vllm_nvfp4_sm120.bench moe_decode --tokens 4,6,8 --json $OUT/bench_moe_decode.json 2>&1 | tail -16
timeout 150 python3 benchmarks/linear_decode_sweep.py --out $OUT/linear --shapes qwen3-32b,llama-3.3-70b --t 1,8 \
  --candidates stream-plan,read-only --min-bytes 1e9 --repeats 10 2>&1 | tail -40
