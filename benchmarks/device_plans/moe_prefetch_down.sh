# The gate_up kernel's L2 prefetch of the down rows ("-pfd" tiles) against the table's pairs, with the read ceiling
# of a two-kernel layer beside them: GPU checks first (the prefetch changes no bit), then T = 1, 2 and T = 4, 8, 16
# on the four shapes.  ~8 minutes.
source .carry/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/kernels/test_moe_decode.py \
  -k "prefetch_down or (every_sweep_candidate and pfd)" > $OUT/tests.txt 2>&1
echo "tests rc $?"; tail -3 $OUT/tests.txt
G1=gu-n16k256-kw4-st3-shift; G2=gu-n16k128-w2-st3; G4=gu-n32k128-w2-st3-shift; GW=gu-n32k128-w1-st3-shift
D=exp-n64k256-w2-st2-shift; DT=exp-n32k256-w2-tma-st2; D4T=exp-n64k256-w2-tma-st2-shift; TOK=tok-n32k128-w1-st3-shift
P12="$G1+$D,$G1-pfd+$D,$G2+$D,$G2-pfd+$D,$GW+$D,$GW-pfd+$D,$G1+$DT,$G1-pfd+$DT,$G1-pfd+$D-s2"
P416="$G4+$D,$G4-pfd+$D,$G4+$TOK,$G4-pfd+$TOK,$G4+$D4T,$G4-pfd+$D4T,$GW+$D,$GW-pfd+$D"
timeout 200 python3 benchmarks/moe_decode_sweep.py --out $OUT/t12 --tokens 1,2 --read-ceiling --no-baseline \
  --repeats 10 --pairs "$P12" > $OUT/t12.txt 2>&1
echo "t12 rc $?"; grep -c FAIL $OUT/t12.txt; sed -n '/rows in/,$p' $OUT/t12.txt
timeout 220 python3 benchmarks/moe_decode_sweep.py --out $OUT/t416 --tokens 4,8,16 --read-ceiling --no-baseline \
  --repeats 10 --pairs "$P416" > $OUT/t416.txt 2>&1
echo "t416 rc $?"; grep -c FAIL $OUT/t416.txt; sed -n '/rows in/,$p' $OUT/t416.txt
