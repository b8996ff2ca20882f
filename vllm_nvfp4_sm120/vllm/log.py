"""The plugin's logger, its once-per-choice lines and its once-per-model layer warnings (shared by the linear and
MoE glue)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.logger import init_logger

logger = init_logger("vllm.nvfp4_sm120")

_logged: set[tuple] = set()


def log_once(level: str, key: tuple, msg: str, *args) -> None:
    """One line per distinct key (layer kind, route or format, kernel, reason), not one per layer."""
    if key in _logged:
        return
    _logged.add(key)
    getattr(logger, level)(msg, *args)


def layer_name(layer: torch.nn.Module) -> str:
    return getattr(layer, "prefix", None) or getattr(layer, "layer_name", None) or type(layer).__name__


@dataclass
class _Tally:
    count: int = 0
    worst: float = float("-inf")
    worst_layer: str = ""
    worst_text: str = ""


_tallies: dict[str, _Tally] = {}  # per-layer warning kind -> the layers that raised it since the last summary


def warn_layer(kind: str, layer: str, badness: float, worst_text: str, msg: str, *args) -> None:
    """A warning about one layer, once per model: the first layer's in full, the others counted into one line
    (:func:`summarize_layer_warnings`, at the end of the model's weight processing) naming the worst of them.

    ``kind`` names the problem in that line; ``badness`` orders the layers; ``worst_text`` says how bad.
    """
    tally = _tallies.setdefault(kind, _Tally())
    tally.count += 1
    if badness > tally.worst:
        tally.worst, tally.worst_layer, tally.worst_text = badness, layer, worst_text
    if tally.count == 1:
        logger.warning(msg + " (other layers with this: one summary line once the model is loaded)", *args)
    else:
        logger.debug(msg, *args)


def summarize_layer_warnings() -> None:
    """One line per warning kind that more than one layer raised, then start counting afresh (next model)."""
    for kind, tally in _tallies.items():
        if tally.count > 1:
            logger.warning("nvfp4_sm120: %s in %d layers of this model; the worst: %s (%s)",
                           kind, tally.count, tally.worst_layer, tally.worst_text)
    _tallies.clear()
