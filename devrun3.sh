# Device run: MoE GPU tests after the MoE flow's signature cache, bench host, the split-K gate_up sweep.
source .carry/env.sh >/dev/null
export TRITON_CACHE_DIR=/tmp/tc
t0=$(date +%s)
timeout 95 python3 -m vllm_nvfp4_sm120.bench host --json $OUT/bench_host.json > $OUT/bench_host.txt 2>&1
echo "host rc=$? $(( $(date +%s) - t0 )) s"; grep -E "moe|linear (triton|w4a16)|trivial|cublas" $OUT/bench_host.txt | grep -v "x trivial" | head -20
t0=$(date +%s)
timeout 170 python3 -m pytest -q -m gpu -n 8 -p no:randomly -p no:benchmark tests/dispatch/test_moe_flow.py \
  tests/dispatch/test_moe_flow_cache.py tests/kernels/test_moe_decode.py -rfE > $OUT/gpu_moe.txt 2>&1
echo "gpu rc=$? $(( $(date +%s) - t0 )) s"; grep -E "passed|failed" $OUT/gpu_moe.txt | tail -1; grep -E "^(FAILED|ERROR)" $OUT/gpu_moe.txt | head
t0=$(date +%s)
timeout 100 python3 benchmarks/moe_decode_sweep.py --out $OUT --tokens 1,2,4 \
  --gate-up gu-n16k512-w2-tma,gu-n16k256-w2-tma,gu-n16k256-w2-tma-s2,gu-n16k256-w2-tma-s4 --down exp-n32k256-w2-tma \
  > $OUT/sweep.txt 2>&1; echo "sweep rc=$? $(( $(date +%s) - t0 )) s"; tail -30 $OUT/sweep.txt
