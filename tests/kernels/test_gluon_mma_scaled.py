"""The Gluon block-scaled MMA building block: it emits the sm_120 OMMA, and its layouts are Triton's own.

The reference layouts are read from the TTGIR of Triton's W4A4 ``tl.dot_scaled`` kernel compiled for sm_120 with
the same tile and warps (kernels/w4a4_gemm.py), never copied by hand.  Numerics need an sm_120 GPU (the CLI
selftest): ``NUMERICS_VERIFIED_ON_SM120`` stays False until one has run.
"""

from __future__ import annotations

import re

import pytest

from vllm_nvfp4_sm120.kernels import gluon_mma_scaled as ms
from vllm_nvfp4_sm120.kernels.aot import PTX_MMA_NVFP4, SASS_OMMA_NVFP4, CompileError, compile_kernel
from vllm_nvfp4_sm120.kernels.w4a4_gemm import W4A4_DIVISIBLE, W4A4_SIGNATURE

TRITON_KERNEL = "vllm_nvfp4_sm120.kernels.w4a4_gemm:_w4a4_gemm_kernel"
GLUON_KERNEL = "vllm_nvfp4_sm120.kernels.gluon_mma_scaled:_mma_scaled_tile_kernel"
# (BM, BN, BK, num_warps): the 4-warp tile of the W4A4 route, a wide-K one, and an 8-warp one.
TILES = [(64, 64, 128, 4), (128, 128, 64, 4), (128, 64, 128, 8)]
_DOT = re.compile(r"tt\.dot_scaled .*? : (tensor<.*?>), (tensor<.*?>) \* (tensor<.*?>), (tensor<.*?>) -> (tensor<.*?>) loc")


def _aliases(ttgir: str) -> dict[str, str]:
    return dict(re.findall(r"^(#[\w.]+) = (.*)$", ttgir, flags=re.M))


def _expand(text: str, aliases: dict[str, str]) -> str:
    """Replace ``#name`` aliases by their definitions (recursively), so two modules' types compare as text."""
    for _ in range(4):
        text = re.sub(r"#[\w.]+\b(?![<{])", lambda m: aliases.get(m.group(0), m.group(0)), text)
    return text


def dot_scaled_types(ttgir: str) -> dict[str, str]:
    """Types (shape, element, full layout) of the first ``tt.dot_scaled``'s a, a_scale, b, b_scale, result."""
    m = _DOT.search(ttgir)
    assert m, "no tt.dot_scaled in the TTGIR"
    al = _aliases(ttgir)
    return dict(zip(["a", "a_scale", "b", "b_scale", "acc"], (_expand(g, al) for g in m.groups())))


def _bases(layout_text: str) -> dict[str, list]:
    m = re.search(r"#ttg\.linear<\{register = (.*?), lane = (.*?), warp = (.*?), block = (.*?)\}>", layout_text)
    assert m, layout_text
    return dict(zip(["register", "lane", "warp", "block"], (eval(g) for g in m.groups())))


_cache: dict = {}


def _triton(bm, bn, bk, warps):
    key = ("triton", bm, bn, bk, warps)
    if key not in _cache:
        consts = dict(HAS_BIAS=False, DECODE=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8)
        _cache[key] = compile_kernel(TRITON_KERNEL, W4A4_SIGNATURE, consts, num_warps=warps, divisible=W4A4_DIVISIBLE)
    return _cache[key]


def _mma_warps(ttgir: str) -> tuple[int, int]:
    m = re.search(r"#ttg\.nvidia_mma<\{versionMajor = 2, versionMinor = 0, warpsPerCTA = \[(\d+), (\d+)\]", ttgir)
    assert m, "Triton did not choose an mma v2 layout for dot_scaled on sm_120"
    return int(m.group(1)), int(m.group(2))


def _gluon(bm, bn, bk, warps_mn):
    key = ("gluon", bm, bn, bk, warps_mn)
    if key not in _cache:
        consts = dict(K=2 * bk, BM=bm, BN=bn, BK=bk, WARPS_M=warps_mn[0], WARPS_N=warps_mn[1])
        _cache[key] = compile_kernel(GLUON_KERNEL, ms.MMA_SCALED_TILE_SIGNATURE, consts,
                                     num_warps=warps_mn[0] * warps_mn[1], divisible=ms.MMA_SCALED_TILE_DIVISIBLE,
                                     gluon=True)
    return _cache[key]


pytestmark = pytest.mark.compile


def test_version_check_passes_here():
    ms.check_version()
    assert ms.NUMERICS_VERIFIED_ON_SM120 is False  # flip only after the sm_120 selftest has passed


@pytest.mark.parametrize("bm,bn,bk,warps", TILES)
def test_scale_layouts_equal_tritons(bm, bn, bk, warps):
    ttgir = _triton(bm, bn, bk, warps).ttgir
    want = dot_scaled_types(ttgir)
    mma_warps = _mma_warps(ttgir)
    # The Python port against Triton's C++ (getSM120DotScaledScaleLayout), base by base.
    assert ms.sm120_scale_bases(0, (bm, bk // 16), mma_warps) == _bases(want["a_scale"])
    assert ms.sm120_scale_bases(1, (bn, bk // 16), mma_warps) == _bases(want["b_scale"])


@pytest.mark.parametrize("bm,bn,bk,warps", TILES)
def test_gluon_block_emits_omma_with_tritons_layouts(bm, bn, bk, warps):
    triton_rep = _triton(bm, bn, bk, warps)
    mma_warps = _mma_warps(triton_rep.ttgir)
    rep = _gluon(bm, bn, bk, mma_warps)
    rep.require_ptx(PTX_MMA_NVFP4).require_sass(SASS_OMMA_NVFP4).require_no_local().require_smem()
    # Operands, scales and accumulator of the Gluon op are, as full layouts, those Triton chose.
    got, want = dot_scaled_types(rep.ttgir), dot_scaled_types(triton_rep.ttgir)
    for name in want:
        assert got[name] == want[name], f"{name}: gluon {got[name]} != triton {want[name]}"
    print(rep.summary())


def test_k32_is_refused_before_the_compiler_aborts():
    with pytest.raises(ValueError, match="multiple of 64"):
        ms.sm120_scaled_layouts(64, 64, 32, (2, 2))


def test_not_for_sm90():
    # The block-scaled mma.sync exists on sm_120a only: ptxas rejects it for sm_90a (the H200 uses decode + bf16 MMA).
    with pytest.raises(CompileError):
        compile_kernel(GLUON_KERNEL, ms.MMA_SCALED_TILE_SIGNATURE,
                       dict(K=128, BM=64, BN=64, BK=128, WARPS_M=2, WARPS_N=2), arch=90, num_warps=4,
                       divisible=ms.MMA_SCALED_TILE_DIVISIBLE, gluon=True)
