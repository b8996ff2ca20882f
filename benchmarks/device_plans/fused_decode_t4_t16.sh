# The fused decode MoE layer at T = 4, 8, 16 side by side with the table's pairs (planned with fused_decode_t1_t2.sh).
source .carry/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
(cd tests/dispatch && timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider test_moe_ready.py -k "fused or token" \
  > $OUT/gpu_ready.txt 2>&1; echo "gpu ready rc $?"; tail -3 $OUT/gpu_ready.txt)
G2=gu-n16k128-w2-st3; G4=gu-n32k128-w2-st3-shift; GW=gu-n32k128-w1-st3-shift
D=exp-n64k256-w2-st2-shift
timeout 300 python3 benchmarks/moe_decode_sweep.py --out $OUT/t4 --tokens 4,8,16 --no-baseline --repeats 10 --pairs \
"$G4+$D,$G4+exp-n64k256-w2-tma-st2-shift,$G4+tok-n32k128-w1-st3-shift,$GW+$D,$G4-r248+$D-r248-fused,\
$G4-r248+exp-n32k256-w2-st2-shift-r248-fused,$G2+$D-fused,$GW+exp-n32k128-w1-st3-shift-fused" > $OUT/t4.txt 2>&1
echo "t4 rc $?"; grep -v "^#" $OUT/t4.txt | tail -60
