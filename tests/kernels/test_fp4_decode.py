"""The 16-bit e2m1 decodes of ``kernels/fp4_decode.py``: the inline-PTX table is bit-exact against the pure-``tl``
decode and the format layer's table for all 256 bytes, and it compiles to the lop3/prmt sequence on sm_120."""

from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from vllm_nvfp4_sm120.format import E2M1_VALUES
from vllm_nvfp4_sm120.kernels.aot import compile_kernel
from vllm_nvfp4_sm120.kernels.fp4_decode import e2m1x2_to_16bit

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@triton.jit
def _decode_bytes_kernel(in_ptr, lo_ptr, hi_ptr, FAST: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    lo, hi = e2m1x2_to_16bit(tl.load(in_ptr + offs), lo_ptr.dtype.element_ty, FAST)
    tl.store(lo_ptr + offs, lo)
    tl.store(hi_ptr + offs, hi)


DECODE_SIGNATURE = {"in_ptr": "*u8", "lo_ptr": "*bf16", "hi_ptr": "*bf16", "FAST": "constexpr", "BLOCK": "constexpr"}


def _decode_all_bytes(dtype: torch.dtype, fast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).to(DEVICE)
    lo = torch.empty(256, dtype=dtype, device=DEVICE)
    hi = torch.empty(256, dtype=dtype, device=DEVICE)
    _decode_bytes_kernel[(1,)](packed, lo, hi, FAST=fast, BLOCK=256)
    return lo.cpu(), hi.cpu()


def _table(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.tensor(E2M1_VALUES, dtype=dtype)
    b = torch.arange(256)
    return values[b & 15], values[b >> 4]  # element 2i in the low nibble


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_pure_tl_decode_is_the_table(dtype):
    """Runs in the interpreter on CPU (and compiled on a GPU): every byte, both nibbles, -0 included."""
    lo, hi = _decode_all_bytes(dtype, fast=False)
    want_lo, want_hi = _table(dtype)
    assert torch.equal(_bits(lo), _bits(want_lo))
    assert torch.equal(_bits(hi), _bits(want_hi))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_fast_decode_is_bit_exact(dtype):
    fast_lo, fast_hi = _decode_all_bytes(dtype, fast=True)
    ref_lo, ref_hi = _decode_all_bytes(dtype, fast=False)
    want_lo, want_hi = _table(dtype)
    assert torch.equal(_bits(fast_lo), _bits(ref_lo)) and torch.equal(_bits(fast_hi), _bits(ref_hi))
    assert torch.equal(_bits(fast_lo), _bits(want_lo)) and torch.equal(_bits(fast_hi), _bits(want_hi))


@pytest.mark.compile
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fast_decode_compiles_to_prmt_lop3_on_sm120(dtype):
    sig = {k: (f"*{dtype}" if v == "*bf16" else v) for k, v in DECODE_SIGNATURE.items()}
    kernel = f"{Path(__file__).resolve()}:_decode_bytes_kernel"
    rep = compile_kernel(kernel, sig, {"FAST": True, "BLOCK": 256})
    rep.require_ptx(r"prmt\.b32\s+\S+, 0x8000, 0,").require_ptx(r"and\.b32\s+\S+, \S+, 0x77777777")
    rep.require_sass(r"\bPRMT\b").require_sass(r"\bLOP3\.LUT\b").require_no_local()
    # The table replaces the arithmetic decode: no exp2 (MUFU.EX2) left.
    assert not rep.has_sass(r"MUFU\.EX2"), "fast decode still contains the arithmetic e2m1 decode"
    reference = compile_kernel(kernel, sig, {"FAST": False, "BLOCK": 256})
    assert not reference.has_ptx(r"0x77777777"), "FAST=False must not use the inline-PTX table"
