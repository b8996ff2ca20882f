#!/usr/bin/env bash
# The linear decode table beside gemlite through `bench linear --peers gemlite` (every row of the issue's 40: both
# models' four layers at T = 1, 2, 4, 8, 16, with cuBLAS bf16), and the MoE decode op through `bench moe_decode` at
# T = 1, 2, 3, 4, 8, 16 with today's rules.  PARTS picks: warm (gemlite's compiles, one process per shape, into the
# shared cache: ~150 s a shape one after another), lin, moe_n (the narrow layers), moe_w (the wide ones), t16 (the
# narrow layers' Triton pairs at T = 12 and 16 with the three downs, every pair checked against moe_ref first), ds1
# (the table's DeepSeek-V3 T = 1 pair as two kernels, beside the op's time of moe_w on the same machine), t16op (the
# op at T = 12 and 16 on Qwen3-30B-A3B after the T = 16 token-major rule, and its GPU tests), ds12 (DeepSeek-V3 at T =
# 1 and 2: three gate_ups with the streaming and the pointer down), ncu (Nsight Compute metrics of the narrow layers'
# decode kernels at T = 1-4 through the op: time, DRAM bytes, issue and the ALU / FMA pipes; to $OUT/ncu.csv), ncul
# (the same metrics for the linear plans of Qwen3-32B's four layers; to $OUT/ncu_linear.csv), downs12 (the narrow
# layers at T = 1-2: the rows' gate_ups with eight downs, smaller and pointer / TMA / token-major / streaming).
set -x
source .carry/env.sh && source .carry/peers.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}  # kept by a warm machine between calls
on() { [[ " ${PARTS:-warm lin moe_n moe_w t16 ds1 t16op ds12 ncu ncul downs12} " == *" $1 "* ]]; }  # whole words
show() {  # the sweep's layer times per shape and T
  python3 - "$1" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["shape"], "T", r["T"], "floor", round(r["floor_us"], 1), "failed", r["failed"], r["errors"])
    print("   layer:", {k: round(v, 1) for k, v in sorted(r["pairs_us"].items(), key=lambda kv: kv[1])})
PY
}
if on warm; then
  # (from a file: spawned workers import the main module, which a script on stdin is not; device run 94)
  cat > /tmp/gemlite_warm.py <<'PY'
import multiprocessing as mp, sys, time
sys.path.insert(0, "benchmarks")
import linear_decode_sweep as sweep
from vllm_nvfp4_sm120.bench import MODELS
if __name__ == "__main__":  # (the spawned workers import this file too)
    shapes = [(n, k) for layers in MODELS.values() for _, n, k in layers]
    t0, ctx = time.time(), mp.get_context("spawn")
    procs = [ctx.Process(target=sweep._probe_gemlite, args=([s], [1, 2, 4, 8, 16], "default")) for s in shapes]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    print("gemlite warm:", [p.exitcode for p in procs], f"{time.time() - t0:.0f} s", flush=True)
PY
  timeout ${WARM_S:-240} python3 /tmp/gemlite_warm.py
fi
on lin && timeout ${LIN_S:-400} python3 -m vllm_nvfp4_sm120.bench linear --models qwen3-32b,llama-3.3-70b \
  --tokens 1,2,4,8,16 --kernels dispatch,cublas-bf16 --peers gemlite --min-bytes 1e9 --json $OUT/linear_peers.json
on moe_n && timeout ${MOE_S:-280} python3 -m vllm_nvfp4_sm120.bench moe_decode \
  --models qwen3-30b-a3b,qwen3-next-80b-a3b --tokens 1,2,3,4,8,16 --json $OUT/moe_decode_narrow.json
on moe_w && timeout ${MOE_S:-280} python3 -m vllm_nvfp4_sm120.bench moe_decode \
  --models qwen3-235b-a22b,deepseek-v3 --tokens 1,2,3,4,8,16 --json $OUT/moe_decode_wide.json
if on t16; then
  P=$(for g in gu-n32k128-w2-st3-shift gu-n16k128-w2-st3 gu-n32k128-w1-st3-shift; do
      for d in exp-n64k256-w2-tma-st2-shift exp-n64k256-w2-st2-shift tok-n32k128-w1-st3-shift; do echo -n "$g+$d,"; done
    done | sed 's/,$//')
  timeout ${T16_S:-200} python3 benchmarks/moe_decode_sweep.py --out $OUT/t16 --shapes qwen3-30b-a3b,qwen3-next-80b \
    --tokens 12,16 --no-baseline --repeats 10 --pairs $P 2>&1 | grep -v '^#  ' | tail -30
  show $OUT/t16/moe_decode.json
fi
if on ds1; then
  timeout ${DS1_S:-150} python3 benchmarks/moe_decode_sweep.py --out $OUT/ds1 --shapes deepseek-v3 --tokens 1 \
    --no-baseline --repeats 10 --pairs gus-m32t8+dns-m64t8-rw2-lc-c4,gu-n16k256-kw4-st3-shift+dns-m64t8-rw2-lc-c4 \
    2>&1 | grep -v '^#  ' | tail -10
  show $OUT/ds1/moe_decode.json
fi
if on t16op; then
  timeout 200 python3 -m pytest -q -m gpu -n 4 tests/dispatch/test_moe_flow.py \
    -k "op_runs_the_decode_plan and qwen3-30b and (12 or 16 or 32)" 2>&1 | tail -5
  timeout 150 python3 -m vllm_nvfp4_sm120.bench moe_decode --models qwen3-30b-a3b --tokens 12,16 \
    --json $OUT/moe_decode_t16.json 2>&1 | grep -v '^|'
fi
if on ds12; then
  P=$(for g in gus-m32t8 gu-n16k256-kw4-st3-shift gu-n32k128-w1-st3-shift; do
      for d in dns-m64t8-rw2-lc-c4 exp-n64k256-w2-st2-shift; do echo -n "$g+$d,"; done
    done | sed 's/,$//')
  timeout ${DS12_S:-200} python3 benchmarks/moe_decode_sweep.py --out $OUT/ds12 --shapes deepseek-v3 --tokens 1,2 \
    --no-baseline --repeats 20 --pairs $P 2>&1 | grep -v '^#  ' | tail -3
  show $OUT/ds12/moe_decode.json
fi
M=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
M=$M,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.per_cycle_active
M=$M,smsp__issue_active.avg.per_cycle_active,smsp__inst_executed.sum
P=avg.pct_of_peak_sustained_active
M=$M,sm__pipe_alu_cycles_active.$P,sm__pipe_fma_cycles_active.$P
M=$M,sm__inst_executed_pipe_alu.$P,sm__inst_executed_pipe_fma.$P
if on ncu; then
  timeout ${NCU_S:-300} ncu --clock-control none --nvtx --nvtx-include 'regex:moe-.*/' -k regex:moe --metrics $M \
    --csv python3 benchmarks/ncu_probe.py --moe 'qwen3-30b-a3b:1,2,3,4;qwen3-next-80b-a3b:1,2,4' --linear '' \
    > $OUT/ncu.csv 2> $OUT/ncu.err
  echo "ncu rc $?"; grep -v '^"' $OUT/ncu.csv | tail -12; tail -5 $OUT/ncu.err; wc -l $OUT/ncu.csv
fi
if on ncul; then
  timeout ${NCU_S:-300} ncu --clock-control none --nvtx --nvtx-include 'regex:linear-.*/' -k 'regex:gemv|stream' \
    --metrics $M --csv python3 benchmarks/ncu_probe.py --moe '' \
    --linear '10240x5120:1,2,16;5120x8192:1,2,16;51200x5120:1,8,16;5120x25600:1,8,16' \
    > $OUT/ncu_linear.csv 2> $OUT/ncu_linear.err
  echo "ncu rc $?"; grep -v '^"' $OUT/ncu_linear.csv | tail -14; tail -5 $OUT/ncu_linear.err; wc -l $OUT/ncu_linear.csv
fi
if on downs12; then
  P=$(for g in gu-n16k256-kw4-st3-shift gu-n16k128-w2-st3; do
      for d in exp-n64k256-w2-st2-shift exp-n32k256-w2-tma-st2 exp-n32k256-w2-tma-st2-shift exp-n32k256-w2-st2 \
               exp-n16k128-w1-st3 exp-n32k128-w2-st3 tok-n16k256-w4-fma dns-m32t8-w2; do echo -n "$g+$d,"; done
    done | sed 's/,$//')
  timeout ${D12_S:-300} python3 benchmarks/moe_decode_sweep.py --out $OUT/downs12 --shapes qwen3-30b-a3b,qwen3-next-80b \
    --tokens 1,2 --no-baseline --repeats 10 --pairs $P 2>&1 | grep -v '^#  ' | tail -3
  show $OUT/downs12/moe_decode.json
fi
true
