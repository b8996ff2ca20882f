"""Tiny NVFP4 checkpoints for the CLI tests, written once per session into a temporary folder."""

import pytest

from vllm_nvfp4_sm120.tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``tiny[(format, "w4a4" | "w4a16")]`` → checkpoint folder; plus ``tiny["shared"]`` (one global per fused group)."""
    root = tmp_path_factory.mktemp("tiny-ckpts")
    out = {}
    for fmt in ("modelopt", "compressed-tensors"):
        for act in ("w4a4", "w4a16"):
            out[(fmt, act)] = write_tiny_checkpoint(root / f"{fmt}-{act}", fmt, w4a16=act == "w4a16")
    out["shared"] = write_tiny_checkpoint(root / "shared", "modelopt", shared_fused_globals=True, tokenizer=False)
    return out
