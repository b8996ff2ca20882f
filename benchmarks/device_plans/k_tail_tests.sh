#!/usr/bin/env bash
# The GPU tests of the K-tail rules that no GPU has run: a K that is not a multiple of 128 through the linear op (the
# dispatch's uncapped streaming tile) and the MoE flow's odd shape (I = 704: the Triton down beside the streaming
# gate_up), with the streaming kernels' K-tail shapes again.  Writes $OUT/k_tail_tests.log.  About two minutes.
source .carry/env.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${TESTS_S:-200} python3 -m pytest -q -m gpu -n 8 tests/dispatch/test_linear_ops.py \
  tests/dispatch/test_moe_flow.py tests/kernels/test_gemv_stream.py -k "k_tail or odd or every_tile_small" > $OUT/k_tail_tests.log 2>&1
echo "tests rc $?"; tail -5 $OUT/k_tail_tests.log
