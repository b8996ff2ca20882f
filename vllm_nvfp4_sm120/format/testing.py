"""Random NVFP4 problems for tests, the selftest and the benchmarks (weights quantized like a checkpoint)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .quant import NvFp4, quantize_nvfp4
from .scales import GlobalScale, per_row_decode


@dataclass
class LinearProblem:
    """A linear layer as a checkpoint stores it: codes ``[N, K/2]``, linear e4m3 scales, one global per part."""

    codes: torch.Tensor
    scales: torch.Tensor
    part_globals: list[GlobalScale]
    logical_widths: list[int]
    input_gs: GlobalScale

    @property
    def weight_gs(self) -> GlobalScale:
        """The single global a W4A4 route uses: the largest part decode (as vLLM does for ModelOpt)."""
        return self.parts_gs.max()

    @property
    def parts_gs(self) -> GlobalScale:
        """The per-part globals as one :class:`GlobalScale` ``[P]``."""
        return GlobalScale.from_decode(torch.stack([g.dec for g in self.part_globals]), per_tensor=False)

    @property
    def dec_rows(self) -> torch.Tensor:
        """Per-output-row decode global: what the W4A16 path applies, each part its own."""
        return per_row_decode(self.parts_gs.dec, self.logical_widths, self.codes.shape[0])

    def to(self, device) -> LinearProblem:
        return LinearProblem(self.codes.to(device), self.scales.to(device), [g.to(device) for g in self.part_globals],
                             self.logical_widths, self.input_gs.to(device))


def make_linear(
    n: int,
    k: int,
    *,
    gen: torch.Generator,
    logical_widths: Sequence[int] | None = None,
    weight_std: float = 0.05,
    input_amax: float = 4.0,
) -> LinearProblem:
    """Quantize a random ``[N, K]`` weight part by part; parts get different magnitudes, so different globals."""
    widths = list(logical_widths or [n])
    codes, scales, globals_ = [], [], []
    for p, width in enumerate(widths):
        w = torch.randn(width, k, generator=gen) * weight_std * (1.0 + 0.5 * p)
        gs = GlobalScale.of(w)
        q = quantize_nvfp4(w, gs)
        codes.append(q.codes)
        scales.append(q.scales)
        globals_.append(gs)
    return LinearProblem(torch.cat(codes), torch.cat(scales), globals_, widths, GlobalScale.from_amax(input_amax))


def make_moe_bank(e: int, rows: int, k: int, *, gen: torch.Generator, weight_std: float = 0.05) -> tuple[NvFp4, torch.Tensor]:
    """``E`` experts of ``[rows, K]``: codes ``[E, rows, K/2]``, scales ``[E, rows, K/16]``, decode globals ``[E]``."""
    qs, decs = [], []
    for _ in range(e):
        w = torch.randn(rows, k, generator=gen) * weight_std
        gs = GlobalScale.of(w)
        qs.append(quantize_nvfp4(w, gs))
        decs.append(gs.dec)
    return NvFp4(torch.stack([q.codes for q in qs]), torch.stack([q.scales for q in qs])), torch.stack(decs)


def random_nvfp4(shape: Sequence[int], *, gen: torch.Generator, device="cpu", scale_log2=(-3, 1)) -> NvFp4:
    """Random codes (all 256 byte values) and e4m3 block scales ``2^u * (1 + m/8)`` for ``shape = [..., K]``.

    Fast on any device (no quantizer loop): for GPU tests on real checkpoint shapes.  ``gen`` is a CPU generator;
    the tensors are drawn on CPU and moved, so a seed gives the same problem on every machine.
    """
    *lead, k = shape
    codes = torch.randint(0, 256, (*lead, k // 2), dtype=torch.uint8, generator=gen)
    lo, hi = scale_log2
    exp = torch.randint(lo, hi + 1, (*lead, k // 16), generator=gen).to(torch.float32)
    mant = torch.randint(0, 8, (*lead, k // 16), generator=gen).to(torch.float32)
    scales = (torch.exp2(exp) * (1 + mant / 8)).to(torch.float8_e4m3fn)
    return NvFp4(codes.to(device), scales.to(device))
