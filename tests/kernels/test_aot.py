"""The sm_120 compile harness itself: it must find what is there, and notice what is not."""

import pytest

from vllm_nvfp4_sm120.kernels.aot import (
    PTX_MMA_NVFP4,
    SASS_LDSM,
    SASS_OMMA_NVFP4,
    CompileError,
    compile_kernel,
)
from vllm_nvfp4_sm120.kernels.w4a4_gemm import W4A4_DIVISIBLE, W4A4_SIGNATURE

pytestmark = pytest.mark.compile
KERNEL = "vllm_nvfp4_sm120.kernels.w4a4_gemm:_w4a4_gemm_kernel"


def _consts(**kw):
    return dict(HAS_BIAS=False, DECODE=False, BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8) | kw


def test_dot_scaled_nvfp4_emits_omma_on_sm120():
    rep = compile_kernel(KERNEL, W4A4_SIGNATURE, _consts(), divisible=W4A4_DIVISIBLE)
    rep.require_sass(SASS_OMMA_NVFP4).require_ptx(PTX_MMA_NVFP4).require_sass(SASS_LDSM)
    rep.require_no_local().require_smem()
    assert "sm_120a" in rep.ptx and rep.registers > 0 and rep.shared_bytes > 0


def test_same_source_is_emulated_on_sm90():
    rep = compile_kernel(KERNEL, W4A4_SIGNATURE, _consts(), divisible=W4A4_DIVISIBLE, arch=90)
    assert not rep.has_sass(SASS_OMMA_NVFP4) and not rep.has_ptx("mxf4nvf4")
    rep.require_sass(r"HGMMA\.\w+\.F32\.BF16")  # Triton 3.8 decomposes to fp4 -> bf16 + wgmma


def test_missing_instruction_is_reported():
    rep = compile_kernel(KERNEL, W4A4_SIGNATURE, _consts(DECODE=True), divisible=W4A4_DIVISIBLE)
    with pytest.raises(AssertionError, match="SASS has no match"):
        rep.require_sass(SASS_OMMA_NVFP4)


def test_spills_are_reported():
    # Without the divisibility the JIT would add, this tile is not pipelined and spills to the stack.
    rep = compile_kernel(KERNEL, W4A4_SIGNATURE, _consts())
    with pytest.raises(AssertionError, match="uses local memory"):
        rep.require_no_local()


def test_smem_limit_is_checked():
    rep = compile_kernel(KERNEL, W4A4_SIGNATURE, _consts(), divisible=W4A4_DIVISIBLE)
    with pytest.raises(AssertionError, match="shared memory"):
        rep.require_smem(limit=rep.shared_bytes - 1)


def test_compiler_abort_becomes_compile_error():
    # K = 32 per dot_scaled aborts Triton's sm_120 lowering (a C++ assert, not a Python exception).
    with pytest.raises(CompileError) as err:
        compile_kernel(KERNEL, W4A4_SIGNATURE, _consts(BLOCK_K=32))
    assert err.value.returncode != 0


def test_signature_mismatch_is_an_error():
    with pytest.raises(CompileError, match="signature does not match"):
        compile_kernel(KERNEL, {"a_ptr": "*u8"}, {})
