"""Instruction counts of a kernel's main loop, read from its SASS (``kernels.aot.CompiledKernel.sass``).

The main loop is the innermost backward branch whose body holds the tensor-core instructions (``HMMA``, or
``OMMA`` for the FP4 MMA).  The counts are static (every instruction between the loop's head and its backward
branch), which is what executes per iteration when the body has no branches: the streaming kernel keeps its
loop body branch-free for that reason (its partial steps are peeled out of the loop).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_PRED = re.compile(r"^@!?U?P\w+\s+")
_TARGET = re.compile(r"\b0x([0-9a-f]+)\b")


def parse_sass(sass: str) -> list[tuple[int, str, str]]:
    """``(address, opcode with modifiers, full text)`` for every instruction of a cuobjdump listing."""
    out = []
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m:
            text = _PRED.sub("", m.group(2).strip())
            out.append((int(m.group(1), 16), text.split()[0], text))
    return out


@dataclass(frozen=True)
class LoopStats:
    start: int
    end: int
    ops: Counter  # full opcode (e.g. "LDG.E.128") -> count

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    def by_class(self) -> Counter:
        """Counts by the opcode's first component (``LOP3.LUT`` -> ``LOP3``)."""
        c: Counter = Counter()
        for op, n in self.ops.items():
            c[op.split(".")[0]] += n
        return c

    def count(self, pattern: str) -> int:
        return sum(n for op, n in self.ops.items() if re.fullmatch(pattern, op))


def main_loop(sass: str, mma: str = r"[HO]MMA") -> LoopStats:
    """The innermost loop containing an MMA; raises if there is none (e.g. a fully unrolled K loop)."""
    ins = parse_sass(sass)
    best = None
    for addr, op, text in ins:
        if not op.startswith("BRA"):
            continue
        m = _TARGET.search(text)
        if not m or int(m.group(1), 16) >= addr:
            continue
        lo, hi = int(m.group(1), 16), addr
        if any(lo <= a <= hi and re.match(mma, o) for a, o, _ in ins) and (best is None or hi - lo < best[1] - best[0]):
            best = (lo, hi)
    if best is None:
        raise ValueError("no loop containing an MMA in this SASS")
    lo, hi = best
    return LoopStats(lo, hi, Counter(o for a, o, _ in ins if lo <= a <= hi))


def main_path(sass: str) -> LoopStats:
    """Every instruction of a loop-free kernel from its entry to its last ``EXIT`` (``NOP`` padding excluded).

    The subroutines the compiler appends after the last ``EXIT`` (the slow paths of IEEE division and
    reciprocal, reached by ``CALL``) are left out; the call stubs inside the main path are counted, so this is a
    static upper bound on what one thread executes.
    """
    ins = [(a, o) for a, o, _ in parse_sass(sass) if o != "NOP"]
    exits = [a for a, o in ins if o == "EXIT"]
    if not exits:
        raise ValueError("no EXIT in this SASS")
    return LoopStats(ins[0][0], exits[-1], Counter(o for a, o in ins if a <= exits[-1]))
