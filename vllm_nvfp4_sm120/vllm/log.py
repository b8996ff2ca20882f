"""The plugin's logger and its once-per-choice lines (shared by the linear and MoE glue)."""

from __future__ import annotations

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
