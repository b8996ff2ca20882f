"""The GPU a choice is made for: one :class:`Capability` (compute capability, architecture family, SM count, name).

Every table of the dispatch is keyed by :class:`Family`; every rule that depends on the GPU takes a
:class:`Capability`.  :func:`capability_of` reads it from a device; vLLM's view of the GPU (the glue) and the
tools build one from what they know.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import StrEnum

import torch

# An RTX 5090's SMs: tiles that depend on the SM count are chosen for it where the GPU is not known.
REFERENCE_SM_COUNT = 170


class Family(StrEnum):
    """Architecture families the dispatch tables distinguish."""

    SM120 = "sm120"  # sm_12x: RTX 5090, RTX PRO 6000, DGX Spark -- the target (native FP4 MMA and e2m1 converts)
    SM100 = "sm100"  # sm_10x: data-centre Blackwell
    SM90 = "sm90"  # Hopper: the H200 every GPU proof runs on (FP4 MMA emulated)
    SM80 = "sm80"  # Ampere and Ada
    OTHER = "other"  # no CUDA GPU (CPU, the interpreter), or an architecture the tables do not name


_FAMILY_OF_MAJOR = {12: Family.SM120, 10: Family.SM100, 9: Family.SM90, 8: Family.SM80}


@dataclass(frozen=True)
class Capability:
    """A GPU as the dispatch sees it.  ``cc`` is major * 10 + minor (120 = sm_120), ``None`` without a CUDA GPU.

    ``device`` is the CUDA device name as torch reports it ("NVIDIA GeForce RTX 5090"): measured configs
    (``dispatch/configs.py``) are per device; without it only the built-in tables serve.
    """

    cc: int | None
    sm_count: int = REFERENCE_SM_COUNT
    device: str | None = None

    @property
    def major(self) -> int | None:
        return None if self.cc is None else self.cc // 10

    @property
    def family(self) -> Family:
        return _FAMILY_OF_MAJOR.get(self.major, Family.OTHER)

    @property
    def name(self) -> str:
        return "no CUDA GPU" if self.cc is None else f"sm_{self.cc}"

    def __str__(self) -> str:
        return self.name


NO_GPU = Capability(None)
# What the linear op follows for CPU tensors, so the CPU tests see the numerics of the plan an sm_120 GPU runs.
SM120_REFERENCE = Capability(120)


@functools.cache
def _cuda_capability(index: int) -> Capability:
    major, minor = torch.cuda.get_device_capability(index)
    props = torch.cuda.get_device_properties(index)
    return Capability(major * 10 + minor, props.multi_processor_count, props.name)


def capability_of(device: torch.device) -> Capability:
    """The GPU of ``device`` (read once per GPU), or :data:`NO_GPU` for a CPU tensor."""
    if device.type != "cuda":
        return NO_GPU
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())
