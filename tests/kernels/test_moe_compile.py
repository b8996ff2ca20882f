"""sm_120 compile checks for every MoE kernel and every tile the dispatch can pick (no GPU needed).

Each distinct (kernel, constexprs, warps, stages) is compiled once per module.  Asserted: the native FP4 MMA
(OMMA) in the W4A4 GEMMs with IEEE divisions and the RNE e4m3 convert in their scale math, TMA
(``cp.async.bulk.tensor``) where the plan promises it, no local memory and no stack frame, shared memory within
sm_120's 99 KB.
"""

import functools

import pytest

from vllm_nvfp4_sm120.dispatch.hw import Capability
from vllm_nvfp4_sm120.dispatch.moe import all_moe_plans
from vllm_nvfp4_sm120.kernels import moe_align as al
from vllm_nvfp4_sm120.kernels import moe_w4a4 as w4
from vllm_nvfp4_sm120.kernels import moe_w4a16 as w16
from vllm_nvfp4_sm120.kernels.aot import PTX_TMA_LOAD, SASS_OMMA_NVFP4, compile_kernel

pytestmark = pytest.mark.compile
SM120 = Capability(120)
E4M3_CVT = r"cvt\.rn\.satfinite\.e4m3x2\.f32"
_LOG = []


@functools.cache
def _compile(kernel, sig_items, const_items, divisible, num_warps, num_stages):
    rep = compile_kernel(kernel, dict(sig_items), dict(const_items), divisible=list(divisible),
                         num_warps=num_warps, num_stages=num_stages)
    _LOG.append(rep.summary())
    print(rep.summary(), dict(const_items))
    return rep


def compile_(kernel, sig, consts, divisible, num_warps=4, num_stages=3):
    return _compile(kernel, tuple(sig.items()), tuple(sorted(consts.items())), tuple(divisible), num_warps,
                    num_stages)


def _gemm_jobs():
    jobs = {}
    for p in all_moe_plans(SM120):
        if p.impl in ("gluon", "decode"):
            continue  # the Gluon GEMM's tiles are compiled in test_gluon_moe.py, the decode ones in test_moe_decode.py
        for which, tile in (("gate_up", p.gate_up), ("down", p.down)):
            if p.kernel == "w4a16":
                mod = "vllm_nvfp4_sm120.kernels.moe_w4a16:"
                name = "_moe_w4a16_gate_up_kernel" if which == "gate_up" else "_moe_w4a16_down_kernel"
                sig = w16.MOE_W4A16_GATE_UP_SIGNATURE if which == "gate_up" else w16.MOE_W4A16_DOWN_SIGNATURE
                div = w16.MOE_W4A16_GATE_UP_DIVISIBLE if which == "gate_up" else w16.MOE_W4A16_DOWN_DIVISIBLE
                if tile.use_tma:
                    sig = w16.tma_signature(sig, tile.block_n, tile.block_k)
                    div = [d for d in div if d != "w_desc"]
                consts = dict(USE_TMA=tile.use_tma, FAST_DECODE=p.fast_decode, STREAM_W=p.stream_weights,
                              EVEN_K=True)
            else:
                mod = "vllm_nvfp4_sm120.kernels.moe_w4a4:"
                name = "_moe_w4a4_gate_up_kernel" if which == "gate_up" else "_moe_w4a4_down_kernel"
                sig = w4.MOE_W4A4_GATE_UP_SIGNATURE if which == "gate_up" else w4.MOE_W4A4_DOWN_SIGNATURE
                div = w4.MOE_W4A4_GATE_UP_DIVISIBLE if which == "gate_up" else w4.MOE_W4A4_DOWN_DIVISIBLE
                consts = dict(DECODE=p.decode) | (dict(NATIVE_E4M3=True, NATIVE_E2M1=True) if which == "gate_up"
                                                  else {})
            consts |= (dict(ACTIVATION="silu") if which == "gate_up" else dict(DETERMINISTIC=False))
            consts |= dict(BLOCK_M=p.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, GROUP_M=tile.group_m)
            key = (name, tuple(sorted(consts.items())), tile.num_warps, tile.num_stages)
            jobs[key] = (p.kernel, tile.use_tma, mod + name, sig, consts, div, tile.num_warps, tile.num_stages)
    return list(jobs.values())


@pytest.mark.parametrize("job", _gemm_jobs(), ids=lambda j: f"{j[2].split(':')[1]}-" + "-".join(
    f"{k}{int(v) if isinstance(v, bool) else v}" for k, v in j[4].items() if k.startswith(("BLOCK", "USE"))))
def test_gemm_compiles_for_sm120(job):
    kernel, use_tma, name, sig, consts, div, warps, stages = job
    rep = compile_(name, sig, consts, div, warps, stages)
    if kernel == "w4a4":
        rep.require_sass(SASS_OMMA_NVFP4)
        # Exact scales: IEEE divisions (alpha's 1 / enc; the epilogue's 1 / block decode) and the RNE e4m3 convert.
        rep.require_ptx(r"div\.rn\.f32")
        if "gate_up" in name:  # the intermediate's block scales and codes by the hardware converts
            rep.require_ptx(E4M3_CVT).require_ptx(r"cvt\.rn\.satfinite\.e2m1x2\.f32")
    if use_tma:
        rep.require_ptx(PTX_TMA_LOAD)
    rep.require_no_local().require_smem()


def test_gated_variants_compile():
    # The other activation and the deterministic store, on the largest W4A4 tile.
    plan = [p for p in all_moe_plans(SM120) if p.kernel == "w4a4"][-1]
    base = dict(DECODE=False, BLOCK_M=plan.block_m, BLOCK_K=plan.gate_up.block_k, GROUP_M=8)
    rep = compile_("vllm_nvfp4_sm120.kernels.moe_w4a4:_moe_w4a4_gate_up_kernel", w4.MOE_W4A4_GATE_UP_SIGNATURE,
                   base | dict(ACTIVATION="gelu_tanh", NATIVE_E4M3=True, NATIVE_E2M1=True,
                               BLOCK_N=plan.gate_up.block_n),
                   w4.MOE_W4A4_GATE_UP_DIVISIBLE,
                   plan.gate_up.num_warps, plan.gate_up.num_stages)
    rep.require_sass(SASS_OMMA_NVFP4).require_no_local().require_smem()
    rep = compile_("vllm_nvfp4_sm120.kernels.moe_w4a4:_moe_w4a4_down_kernel", w4.MOE_W4A4_DOWN_SIGNATURE,
                   base | dict(DETERMINISTIC=True, BLOCK_N=plan.down.block_n), w4.MOE_W4A4_DOWN_DIVISIBLE,
                   plan.down.num_warps, plan.down.num_stages)
    rep.require_sass(SASS_OMMA_NVFP4).require_no_local().require_smem()


def test_align_and_sum_kernels_compile():
    m = "vllm_nvfp4_sm120.kernels.moe_align:"
    for bm in (16, 32, 64, 128):
        compile_(m + "_prefix_kernel", al.MOE_PREFIX_SIGNATURE,
                 dict(BLOCK_M=bm, MAX_CHUNKS=al._MAX_CHUNKS, BLOCK_E=al._PREFIX_BLOCK_E),
                 al.MOE_PREFIX_DIVISIBLE).require_no_local().require_smem()
        compile_(m + "_scatter_kernel", al.MOE_SCATTER_SIGNATURE,
                 dict(HAS_MAP=True, BLOCK_M=bm, ROUTES=al._SCATTER_ROUTES, BLOCKS=al._SCATTER_BLOCKS,
                      BLOCK_E=al._PREFIX_BLOCK_E), al.MOE_SCATTER_DIVISIBLE).require_no_local().require_smem()
    compile_(m + "_count_kernel", al.MOE_COUNT_SIGNATURE, dict(HAS_MAP=True, SUB=al._SUB, BLOCK_E=al._PREFIX_BLOCK_E),
             al.MOE_COUNT_DIVISIBLE).require_no_local().require_smem()
    compile_(m + "_moe_sum_kernel", al.MOE_SUM_SIGNATURE, dict(BLOCK_H=1024),
             al.MOE_SUM_DIVISIBLE).require_no_local()
    # The input quantization is act_quant's kernel, compiled for sm_120 in tests/kernels/test_act_quant.py.
