# The read ceiling of a two-kernel decode MoE layer (two launches that only read the touched experts' codes and
# scales, xor-checked) beside the table's pairs and today's path, T = 1, 4, 16 on the four shapes.  ~3 minutes.
source .carry/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
G1=gu-n16k256-kw4-st3-shift; G2=gu-n16k128-w2-st3; G4=gu-n32k128-w2-st3-shift; D=exp-n64k256-w2-st2-shift
timeout 280 python3 benchmarks/moe_decode_sweep.py --out $OUT/rc --tokens 1,4,16 --read-ceiling --repeats 10 \
  --pairs "$G1+$D,$G2+$D,$G4+$D,$G4+tok-n32k128-w1-st3-shift" > $OUT/rc.txt 2>&1
echo "sweep rc $?"; grep -c FAIL $OUT/rc.txt; sed -n '/rows in/,$p' $OUT/rc.txt
