#!/usr/bin/env bash
# Two steps loaded ahead in the streaming linear kernel (StreamTile.prefetch = 2): its GPU tests (the bits of the
# one-step tile on grids whose runs have 1 to many steps, every listed tile against the reference on the small
# shapes), then the linear sweep on the eight Qwen3-32B / Llama-3.3-70B layers at T = 1, 2, 8, 16 beside the plan.
# Writes $OUT/tests.log, $OUT/linear_decode.json and $OUT/sweep.log.
source .carry/env.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${TESTS_S:-240} python3 -m pytest -q -m gpu -n 8 tests/kernels/test_gemv_stream.py \
  -k "${TESTS_K:-deep_prefetch or every_tile_small or fp16_and_real_k}" > $OUT/tests.log 2>&1
echo "tests rc $?"; tail -3 $OUT/tests.log
timeout ${SWEEP_S:-240} python3 benchmarks/linear_decode_sweep.py --out $OUT --t ${SWEEP_T:-1,2,8,16} \
  --candidates stream-plan,pf2,16x8w4r1c96 --min-bytes 1e9 --repeats 10 > $OUT/sweep.log 2>&1
echo "sweep rc $?"
