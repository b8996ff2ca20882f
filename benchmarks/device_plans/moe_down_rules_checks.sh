#!/usr/bin/env bash
# The decode table's down rules after run 71 (the token-major down at I <= 512 from T = 6, the TMA expert-major down
# at I = 768 for T = 5-16) through the op, and the streaming kernel after the prefetch option left it: GPU tests
# against moe_ref, then the narrow layers' table timed against the align + tile path.  About 3 minutes.
set -x
source .carry/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/kernels/test_gluon_moe_decode.py \
  tests/dispatch/test_moe_flow.py -k "row_pointers or op_runs_the_decode_plan" > $OUT/pytest.txt 2>&1
tail -3 $OUT/pytest.txt
timeout 90 python3 -m vllm_nvfp4_sm120.bench moe_decode --models qwen3-30b-a3b,qwen3-next-80b-a3b \
  --tokens 4,5,6,7,8,12,16 --json $OUT/bench_moe_decode.json 2>&1 | tail -18
