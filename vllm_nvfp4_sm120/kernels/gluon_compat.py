"""Everything that differs between the Triton versions our Gluon kernels meet, in one place.

vLLM 0.33 pins Triton 3.8.0; the H200 proof machine ships 3.6 (a 3.8 wheel is carried there, see DEVELOPERS.md);
3.9 is the next wheel.  Gluon is experimental and its API moved between them (read from each wheel's
``triton/experimental/gluon`` sources):

  warp_specialize   3.6: (functions_and_args, worker_num_warps, worker_num_regs)  -- regs required
                    3.7+: worker_num_regs optional
  mbarrier.expect   <=3.6: expect(bar, bytes);  >=3.7: expect(bar, bytes_per_cta=None, pred=True)
  hopper.tma        <=3.7: async_copy_global_to_shared / async_copy_shared_to_global
                    >=3.8: async_load / async_store (3.8 keeps the old names as aliases, 3.9 removes them)
  dot_scaled        <=3.7: TritonSemantic.dot_scaled takes the formats as constexpr; >=3.8 as plain str

Kernels import the names below instead of branching on versions themselves.  ``gluon_enabled()`` is the switch
the dispatch layer asks before routing to any Gluon kernel.
"""

from __future__ import annotations

import inspect
import os
import re

import triton

ENV_DISABLE = "VLLM_NVFP4_SM120_DISABLE_GLUON"

# Gluon's ampere.mma_v2 appeared in 3.6: nothing here compiles on older wheels.
MIN_TRITON = (3, 6)


def _parse_version(v: str) -> tuple[int, int, int]:
    nums = [int(x) for x in re.findall(r"\d+", v)[:3]]
    return tuple(nums + [0] * (3 - len(nums)))  # type: ignore[return-value]


TRITON_VERSION = _parse_version(triton.__version__)

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import ampere, hopper

    HAS_GLUON = TRITON_VERSION[:2] >= MIN_TRITON and hasattr(ampere, "mma_v2")
except ImportError:  # a Triton without Gluon: every Gluon route is off, the Triton kernels remain
    gluon = gl = ampere = hopper = None
    HAS_GLUON = False


def gluon_enabled() -> bool:
    """True when Gluon kernels may be used: a Triton with Gluon >= 3.6 and ``VLLM_NVFP4_SM120_DISABLE_GLUON`` unset.

    Read on every call (not cached) so tests and users can flip the variable in a running process before the
    dispatch table is built.
    """
    if os.environ.get(ENV_DISABLE, "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    return HAS_GLUON


def require_gluon(what: str) -> None:
    if not HAS_GLUON:
        raise RuntimeError(
            f"{what}: needs Triton >= {'.'.join(map(str, MIN_TRITON))} with Gluon (found {triton.__version__})"
        )


# ---- PTX features that follow the PTX ISA version Triton emits (bundled ptxas: 3.6 -> 8.8, 3.8 -> 9.3) ----
# cvt.rn.bf16x2.e2m1x2 needs PTX ISA 9.2; cvt.rn.f16x2.e2m1x2 only 8.7 (sm_120a).  Triton derives the ISA version
# from the ptxas it will use, which a user can override (TRITON_PTXAS_BLACKWELL_PATH), so ask Triton itself.
def ptx_isa_version(arch: int = 120) -> int:
    """PTX ISA version (e.g. 93 for 9.3) Triton would emit for ``sm_<arch>`` with the ptxas it would use."""
    from triton.backends.nvidia import compiler as nv

    try:
        tool = nv.get_ptxas(arch)  # 3.8+: chooses ptxas-blackwell for arch >= 100
    except TypeError:  # 3.6/3.7: no argument
        tool = nv.get_ptxas()
    version = tool.version
    return nv.ptx_get_version(version)


# ---- TMA and mbarrier names ----
if HAS_GLUON:
    tma = hopper.tma
    tma_async_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_async_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # Called positionally, expect(bar, nbytes) means the same on every version.
    mbarrier_expect = hopper.mbarrier.expect
    # 3.6 insists on worker_num_regs; passing them always (as a list) is valid on every version >= 3.6.
    warp_specialize = gl.warp_specialize
    WARP_SPECIALIZE_NEEDS_REGS = TRITON_VERSION[:2] <= (3, 6)
else:
    tma = tma_async_load = tma_async_store = mbarrier_expect = warp_specialize = None
    WARP_SPECIALIZE_NEEDS_REGS = False


def _dot_scaled_formats_are_constexpr() -> bool:
    from triton.language.semantic import TritonSemantic

    try:
        return "lhs_format.value" in inspect.getsource(TritonSemantic.dot_scaled)
    except (OSError, TypeError):  # no source on disk: decide by version
        return TRITON_VERSION[:2] <= (3, 7)


# True on <= 3.7: TritonSemantic.dot_scaled reads ``lhs_format.value``; >= 3.8 wants a plain str.
DOT_SCALED_FORMAT_IS_CONSTEXPR = _dot_scaled_formats_are_constexpr()
