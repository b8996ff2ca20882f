"""Process-wide numerics policy and load-time plan substitutions: what the selectors consult besides the shape.

**Batch numerics.**  On W4A4 checkpoints the default (``decode = w4a16``) runs small batches weight-only: the
activations stay bf16/fp16 up to the route's decode threshold (linears, T <= 16) or a few tokens per expert (MoE),
and are quantized to NVFP4 above it.  Decode stays at full activation precision, but one token's output then
depends on the batch it shares: the two numerics differ by ~9.5 % of a row's norm per linear and ~16 % per MoE
layer (random NVFP4 problems, the format references).

* ``decode = w4a4``: one numerics at every T, W4A4 wherever the layer has static input scales (tiles still change
  with T; the results differ by fp32 summation order only).
* ``batch_invariant`` (vLLM's batch-invariant mode): one numerics *and* one kernel and tile per layer at every T,
  no split-K and no library whose algorithm depends on M, and the MoE top-k sum in slot order, so a row's output is
  bitwise the same whatever batch it is in.  Prefill and decode pay for it (one prefill-sized tile everywhere).

The glue reads the environment and vLLM's state and calls :func:`set_policy` at load; nothing here reads either.

**Substitutions.**  The load-time numerics guard (``dispatch/guard.py``) records a plan that failed on this GPU
with the plan to run instead (:func:`substitute`); the MoE selector applies them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Decode(StrEnum):
    """What small batches of a W4A4 checkpoint compute with."""

    W4A16 = "w4a16"  # weight-only below the decode threshold (the default)
    W4A4 = "w4a4"  # the checkpoint's W4A4 numerics at every T


@dataclass(frozen=True)
class NumericsPolicy:
    decode: Decode = Decode.W4A16
    batch_invariant: bool = False

    @property
    def one_numerics(self) -> bool:
        """Whether a W4A4 layer must run W4A4 at every T."""
        return self.decode is Decode.W4A4 or self.batch_invariant


DEFAULT = NumericsPolicy()
_policy = DEFAULT
# Bumped by every change of what the selectors read here (the policy, the substitutions): callers that cache a
# selected plan (the MoE flow) key on it, so a change takes effect at the next call.
_generation = 0


def generation() -> int:
    """A counter that changes whenever the policy or a substitution changes."""
    return _generation


def _bump() -> None:
    global _generation
    _generation += 1


def parse_decode(value: str | None, source: str = "decode") -> Decode:
    """``w4a16`` / ``w4a4`` (case and blanks ignored; empty or None: the default); anything else a ValueError."""
    v = (value or "").strip().lower()
    if not v:
        return DEFAULT.decode
    try:
        return Decode(v)
    except ValueError:
        raise ValueError(f"{source}={value!r}: expected one of {[str(d) for d in Decode]}") from None


def set_policy(policy: NumericsPolicy) -> None:
    global _policy
    if not isinstance(policy, NumericsPolicy):
        raise TypeError(f"policy: expected a NumericsPolicy, got {type(policy).__name__}")
    _policy = policy
    _bump()


def current_policy() -> NumericsPolicy:
    return _policy


# ---- plan substitutions (the numerics guard's fallbacks) ----------------------------------------------------------

_substitutes: dict[tuple, object] = {}


def set_substitute(key: tuple, plan: object) -> None:
    """From now on, where the selector would return the plan of ``key`` (the plan and the shape it failed at), it
    returns ``plan``."""
    _substitutes[key] = plan
    _bump()


def substitute(key: tuple, plan):
    return _substitutes.get(key, plan)


def clear_substitutes() -> None:
    """Forget every substitution (tests)."""
    _substitutes.clear()
    _bump()
