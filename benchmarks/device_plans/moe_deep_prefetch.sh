#!/usr/bin/env bash
# Two steps loaded ahead in the streaming MoE gate_up ("-pf2" tiles, MoeStreamTile.prefetch = 2): its GPU tests
# first (the bits of the one-step tile, the layer against moe_ref), then the layer with each of the table's two
# streaming gate_up tiles and its -pf2 twin, the table's streaming down after both, on the four shapes at T = 2, 4, 8.
# Writes $OUT/moe_tests.log, $OUT/moe_sweep.log and $OUT/moe/moe_decode.json.  About four minutes.
source .carry/env.sh
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout ${TESTS_S:-150} python3 -m pytest -q -m gpu -n 8 tests/kernels/test_gluon_moe_decode.py \
  -k deep_prefetch > $OUT/moe_tests.log 2>&1
echo "tests rc $?"; tail -3 $OUT/moe_tests.log
D=dns-m64t8-rw2-lc-c4
timeout ${SWEEP_S:-300} python3 benchmarks/moe_decode_sweep.py --out $OUT/moe --tokens ${SWEEP_T:-2,4,8} --no-baseline \
  --repeats 10 --pairs "gus-m32t8+$D,gus-m32t8-pf2+$D,gus-m64t8-rw2+$D,gus-m64t8-rw2-pf2+$D" > $OUT/moe_sweep.log 2>&1
echo "sweep rc $?"; grep -c FAIL $OUT/moe_sweep.log; sed -n '/rows in/,$p' $OUT/moe_sweep.log | tail -60
