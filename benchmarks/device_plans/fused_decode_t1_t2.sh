# The fused one-launch decode MoE layer: GPU tests, then the layer side by side with the table's two-launch pairs
# (T = 1, 2).  Planned 2026-12-04 (no device lent that session); code at the commit that adds it.
source .carry/env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
export PYTHONPATH=$PWD:$PYTHONPATH
(cd tests/kernels && timeout 200 python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider test_moe_decode_fused.py -x \
  > $OUT/gpu_fused.txt 2>&1; echo "gpu fused rc $?"; tail -5 $OUT/gpu_fused.txt)
G1=gu-n16k256-kw4-st3-shift; G2=gu-n16k128-w2-st3; G4=gu-n32k128-w2-st3-shift; GW=gu-n32k128-w1-st3-shift
D=exp-n64k256-w2-st2-shift
timeout 170 python3 benchmarks/moe_decode_sweep.py --out $OUT/t1 --tokens 1 --no-baseline --repeats 10 --pairs \
"$G1+$D,$G1+exp-n32k256-w2-tma-st2,$GW+$D,$G1+exp-n32k256-kw4-st2-shift-fused,$G1+exp-n64k256-kw4-st2-shift-fused,\
$G2+$D-fused,$GW+exp-n32k128-w1-st3-shift-fused" > $OUT/t1.txt 2>&1
echo "t1 rc $?"; grep -v "^#" $OUT/t1.txt | tail -40
timeout 150 python3 benchmarks/moe_decode_sweep.py --out $OUT/t2 --tokens 2 --no-baseline --repeats 10 --pairs \
"$G2+$D,$G2+exp-n32k256-w2-tma-st2,$GW+$D,$G2+$D-fused,$G4-r248+$D-r248-fused,$G4-r248+exp-n32k256-w2-st2-shift-r248-fused,\
$GW+exp-n32k128-w1-st3-shift-fused,$G1+exp-n32k256-kw4-st2-shift-fused" > $OUT/t2.txt 2>&1
echo "t2 rc $?"; grep -v "^#" $OUT/t2.txt | tail -40
