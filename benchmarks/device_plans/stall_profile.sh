#!/usr/bin/env bash
# Where the decode kernels' warps wait: Nsight Compute's stall reasons (warps stalled per issued instruction, per
# reason; they add up to the cycles per issued instruction) of the op's Qwen3-30B-A3B kernels at T = 1 and 4 and of
# the linear plans on Qwen3-32B's qkv (T = 1, 2), o (T = 2) and gate_up (T = 8, 16) layers, to $OUT/stall.csv.  The
# scheduler summary alone (device run 96, H200) says 0.49-0.58 issued per scheduler-cycle with ~1 eligible warp; this
# says why.
set -x
source .carry/env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
M=""  # per reason: warps stalled there per issued instruction
for r in long_scoreboard short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle barrier membar \
         not_selected selected dispatch_stall no_instruction branch_resolving drain imc_miss tex_throttle misc; do
  M=$M,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio
done
# Per-SM busy cycles (min / avg / max over the SMs) against the elapsed cycles: how long SMs sit empty in the
# one-wave grid's ramp and tail (an SM whose CTAs have all exited while others still run).
M=gpu__time_duration.sum,smsp__issue_active.avg.per_cycle_active,sm__warps_active.avg.per_cycle_active$M
M=$M,sm__cycles_active.min,sm__cycles_active.avg,sm__cycles_active.max,sm__cycles_elapsed.avg
timeout ${STALL_S:-240} ncu --clock-control none --nvtx --nvtx-include 'regex:(moe|linear)-.*/' \
  -k 'regex:moe|gemv|stream' --metrics $M --csv \
  python3 benchmarks/ncu_probe.py --moe 'qwen3-30b-a3b:1,4' --linear '10240x5120:1,2;5120x8192:2;51200x5120:8,16' \
  > $OUT/stall.csv 2> $OUT/stall.err
echo "ncu rc $?"; tail -3 $OUT/stall.err; wc -l $OUT/stall.csv
# One line per profiled kernel: its non-zero metrics, stall reasons by their short names.
python3 - "$OUT/stall.csv" <<'PY'
import csv, sys
from collections import defaultdict
rows = list(csv.reader(open(sys.argv[1])))
at = next(i for i, r in enumerate(rows) if "Metric Name" in r)
h = rows[at]
kid, kname, mname, mval = (h.index(c) for c in ("ID", "Kernel Name", "Metric Name", "Metric Value"))
by_id, names = defaultdict(dict), {}
for r in rows[at + 1:]:
    short = r[mname].replace("smsp__average_warps_issue_stalled_", "").replace("_per_issue_active.ratio", "")
    by_id[r[kid]][short] = r[mval]
    names[r[kid]] = r[kname][:32]
for i, m in by_id.items():
    print(i, names[i], " ".join(f"{k}={v}" for k, v in m.items() if v not in ("0", "0.00")))
PY
