"""``vllm-nvfp4-sm120 bench --e2e --checkpoint DIR``: vLLM serving a checkpoint with our kernels and with its own.

Two arms, each in its own process (the plugin registers itself per process, so one process cannot hold both):

    ours   VLLM_NVFP4_SM120=1, linear_backend / moe_backend "nvfp4_sm120"
    vllm   VLLM_NVFP4_SM120=0, linear_backend / moe_backend "auto" (vLLM's in-tree choice)

Each arm (``python -m vllm_nvfp4_sm120.e2e``, :func:`run_arm`) builds vLLM's ``LLM`` once and measures, after a
warm-up request:

- time to first token at each ``--prompt-tokens`` length (~1k / 4k / 8k): one request of that many random token
  ids with ``max_tokens=1``, the median over ``--e2e-repeats`` distinct prompts (prefix caching off, so every
  repeat prefills);
- decode tokens/s at each ``--concurrency`` (1 / 4 / 16 requests at once): N requests of 128 prompt tokens run
  once with 1 and once with ``--decode-tokens`` M output tokens (EOS ignored); ``N (M - 1) / (t_M - t_1)``, the
  median over the repeats;
- greedy outputs (temperature 0) of :data:`GREEDY_PROMPTS`.

The parent (:func:`run_e2e`) compares the arms: speedups, and per prompt the first character where the greedy
outputs differ (kernels that round differently may drift apart after many tokens; a difference in the first few
characters points at a kernel or scale bug).  Table, JSON, and a PNG with ``--plot`` (matplotlib optional).

The engine boundary is :class:`VllmEngine` (``generate(prompts, max_tokens, ignore_eos) -> (seconds, texts)``); the
arm process builds the class ``--engine module:name`` names, which the CPU tests point at a stub.  This module
imports neither torch nor vLLM at import time: the arm processes import only what their engine needs.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV_SWITCH = "VLLM_NVFP4_SM120"  # vllm/register.py's switch (that module imports vLLM)
ARMS = {  # arm: (plugin switch, linear and MoE backend, label)
    "ours": ("1", "nvfp4_sm120", "ours (nvfp4_sm120)"),
    "vllm": ("0", "auto", "vLLM in-tree (plugin off)"),
}
DEFAULT_ENGINE = "vllm_nvfp4_sm120.e2e:VllmEngine"
PROMPT_TOKENS = (1024, 4096, 8192)
CONCURRENCY = (1, 4, 16)
DECODE_PROMPT_TOKENS = 128
GREEDY_PROMPTS = (
    "The capital of France is",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences why the sky is blue.",
    "List the first five prime numbers:",
)
GREEDY_TOKENS = 64


class VllmEngine:
    """vLLM's offline ``LLM`` on the checkpoint with the arm's backends; prefix caching off (see the module doc)."""

    def __init__(self, checkpoint: str, *, backend: str, max_model_len: int, gpu_memory_utilization: float):
        from vllm import LLM

        self.llm = LLM(model=checkpoint, linear_backend=backend, moe_backend=backend, max_model_len=max_model_len,
                       gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=False, seed=0)
        self.vocab_size = self.llm.get_tokenizer().vocab_size

    def generate(self, prompts: list, max_tokens: int, ignore_eos: bool = True) -> tuple[float, list[str]]:
        """Seconds for the whole batch and each request's text; a prompt is a string or a list of token ids."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
        inputs = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
        start = time.perf_counter()
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        return time.perf_counter() - start, [o.outputs[0].text for o in outs]


def _load_engine(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Random ids away from the low ids, where tokenizers keep their special tokens.
    return [rng.randrange(min(1000, vocab // 2), vocab) for _ in range(n)]


def run_arm(engine, *, prompt_tokens, concurrency, decode_tokens: int, repeats: int) -> dict:
    """Every measurement of one arm on ``engine`` (see the module docstring)."""
    rng = random.Random(0)
    vocab = engine.vocab_size
    engine.generate(["Hello"], 8)  # warm-up: compiles, CUDA graphs, allocator
    ttft = {}
    for n in prompt_tokens:
        ttft[n] = 1e3 * statistics.median(engine.generate([_ids(rng, n, vocab)], 1)[0] for _ in range(repeats))
    decode = {}
    for n in concurrency:
        rates = []
        for _ in range(repeats):
            prompts = [_ids(rng, DECODE_PROMPT_TOKENS, vocab) for _ in range(n)]
            first = engine.generate(prompts, 1)[0]
            full = engine.generate(prompts, decode_tokens)[0]
            rates.append(n * (decode_tokens - 1) / max(full - first, 1e-9))
        decode[n] = statistics.median(rates)
    greedy = engine.generate(list(GREEDY_PROMPTS), GREEDY_TOKENS, ignore_eos=False)[1]
    return {"ttft_ms": ttft, "decode_tok_s": decode, "greedy": greedy}


def first_difference(a: str, b: str) -> int | None:
    """Index of the first character where ``a`` and ``b`` differ (the shorter one's length if one is a prefix of
    the other); None when they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare_arms(ours: dict, theirs: dict) -> dict:
    """Speedups (ours over vLLM's: > 1 is faster) and the greedy outputs compared, prompt by prompt."""
    ttft = {n: theirs["ttft_ms"][n] / ours["ttft_ms"][n] for n in ours["ttft_ms"] if n in theirs["ttft_ms"]}
    decode = {n: ours["decode_tok_s"][n] / theirs["decode_tok_s"][n] for n in ours["decode_tok_s"]
              if n in theirs["decode_tok_s"]}
    outputs = []
    for prompt, a, b in zip(GREEDY_PROMPTS, ours["greedy"], theirs["greedy"]):
        i = first_difference(a, b)
        outputs.append({"prompt": prompt, "identical": i is None, "first_difference": i,
                        "ours": a, "vllm": b})
    return {"ttft_speedup": ttft, "decode_speedup": decode, "outputs": outputs}


def _arm_command(arm: str, checkpoint: str, out: Path, engine: str, opts: dict) -> list[str]:
    cmd = [sys.executable, "-m", "vllm_nvfp4_sm120.e2e", "--arm", arm, "--checkpoint", checkpoint, "--out", str(out),
           "--engine", engine]
    for key, value in opts.items():
        cmd += [f"--{key.replace('_', '-')}", ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return cmd


def run_e2e(checkpoint: str, *, engine: str = DEFAULT_ENGINE, prompt_tokens=PROMPT_TOKENS, concurrency=CONCURRENCY,
            decode_tokens: int = 128, repeats: int = 3, max_model_len: int | None = None,
            gpu_memory_utilization: float = 0.85, timeout: float | None = None) -> dict:
    """Both arms, each in a child process with its plugin switch; ``{"arms": {arm: result}, "compare": ...}``.

    An arm that fails is ``{"error": ...}`` (its last lines of output), and there is no comparison."""
    opts = dict(prompt_tokens=tuple(prompt_tokens), concurrency=tuple(concurrency), decode_tokens=decode_tokens,
                repeats=repeats, gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len or max(prompt_tokens) + max(decode_tokens, GREEDY_TOKENS) + 64)
    arms = {}
    with tempfile.TemporaryDirectory(prefix="nvfp4-e2e-") as tmp:
        for arm, (switch, _, _) in ARMS.items():
            out = Path(tmp) / f"{arm}.json"
            env = dict(os.environ, **{ENV_SWITCH: switch})
            print(f"bench --e2e: arm {arm} ({ENV_SWITCH}={switch}) ...", file=sys.stderr, flush=True)
            try:
                proc = subprocess.run(_arm_command(arm, checkpoint, out, engine, opts), env=env, capture_output=True,
                                      text=True, timeout=timeout)
                failed = proc.returncode != 0 or not out.is_file()
                log = (proc.stdout + proc.stderr).strip().splitlines()
            except subprocess.TimeoutExpired:
                failed, log = True, [f"timed out after {timeout} s"]
            if failed:
                arms[arm] = {"error": " | ".join(log[-3:]) or "exited without a result"}
            else:
                arms[arm] = _int_keys(json.loads(out.read_text()))
    result = {"checkpoint": checkpoint, "options": {k: list(v) if isinstance(v, tuple) else v for k, v in opts.items()},
              "arms": arms}
    if all("error" not in a for a in arms.values()):
        result["compare"] = compare_arms(arms["ours"], arms["vllm"])
    return result


def _int_keys(arm: dict) -> dict:
    """JSON keeps dict keys as strings; the prompt lengths and request counts are ints."""
    for key in ("ttft_ms", "decode_tok_s"):
        arm[key] = {int(k): v for k, v in arm[key].items()}
    return arm


def format_e2e(result: dict) -> str:
    arms, cmp_ = result["arms"], result.get("compare")
    ours, theirs = arms["ours"], arms["vllm"]
    lines = [f"# {result['checkpoint']}: vLLM with our kernels vs vLLM's in-tree choice (plugin off)",
             f"{'':28} {ARMS['ours'][2]:>22} {ARMS['vllm'][2]:>26} {'ours vs vLLM':>13}"]
    for key, what, unit, better in (("ttft_ms", "TTFT, {} prompt tokens", "ms", "ttft_speedup"),
                                    ("decode_tok_s", "decode, {} requests", "tok/s", "decode_speedup")):
        for n in result["options"]["prompt_tokens" if key == "ttft_ms" else "concurrency"]:
            cell = lambda arm: f"{arm[key][n]:.1f} {unit}" if key in arm and n in arm[key] else "-"  # noqa: E731
            speed = f"{cmp_[better][n]:.2f}x" if cmp_ and n in cmp_[better] else "-"
            lines.append(f"{what.format(n):28} {cell(ours):>22} {cell(theirs):>26} {speed:>13}")
    for arm, res in arms.items():
        if "error" in res:
            lines.append(f"arm {arm} failed: {res['error']}")
    if cmp_:
        same = sum(o["identical"] for o in cmp_["outputs"])
        lines.append(f"greedy outputs ({GREEDY_TOKENS} tokens): {same} of {len(cmp_['outputs'])} identical")
        for o in cmp_["outputs"]:
            if not o["identical"]:
                i = o["first_difference"]
                lines.append(f"  {o['prompt']!r}: first difference at character {i}: ours "
                             f"{o['ours'][max(0, i - 10):i + 20]!r} vs vLLM {o['vllm'][max(0, i - 10):i + 20]!r}")
    lines.append("(speedup > 1: ours faster; TTFT = prefill + first token of one request)")
    return "\n".join(lines)


def plot_e2e(result: dict, path: str, plt) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, opt, title in ((axes[0], "ttft_ms", "prompt_tokens", "time to first token (ms, lower is better)"),
                                (axes[1], "decode_tok_s", "concurrency", "decode tokens/s (higher is better)")):
        xs = result["options"][opt]
        width = 0.4
        for j, (arm, res) in enumerate(result["arms"].items()):
            ys = [res.get(key, {}).get(n, 0.0) for n in xs]
            ax.bar([i + (j - 0.5) * width for i in range(len(xs))], ys, width, label=ARMS[arm][2])
        ax.set_xticks(range(len(xs)), [str(n) for n in xs])
        ax.set_xlabel("prompt tokens" if key == "ttft_ms" else "concurrent requests")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(Path(result["checkpoint"]).name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- the CLI (bench --e2e) -----------------------------------------------------------------------------------------

def serving_problem() -> str | None:
    """Why vLLM cannot serve on this machine (None: it may)."""
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed"
    return None


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{what}: expected a comma list of positive integers, got {text!r}")
    return values


def e2e_command(args: argparse.Namespace) -> int:
    from .bench import emit_json, require_matplotlib
    from .inspect_ckpt import CheckpointError, inspect_checkpoint

    if not args.checkpoint:
        print("error: bench --e2e needs --checkpoint DIR (the model vLLM serves)", file=sys.stderr)
        return 2
    try:
        prompt_tokens = _ints(args.prompt_tokens, "--prompt-tokens")
        concurrency = _ints(args.concurrency, "--concurrency")
        if args.decode_tokens < 2:
            raise ValueError("--decode-tokens: at least 2 (the first token is not a decode step)")
        inspect_checkpoint(args.checkpoint)  # a checkpoint that cannot be read fails here, in one line
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plt = require_matplotlib() if args.plot else None
    if args.plot and plt is None:
        print(f"note: --plot {args.plot} skipped: matplotlib is not installed (pip install matplotlib)",
              file=sys.stderr)
    if (why := serving_problem()) is not None:
        print(f"error: bench --e2e needs a GPU vLLM can serve on: {why}", file=sys.stderr)
        return 2
    result = run_e2e(args.checkpoint, engine=args.e2e_engine, prompt_tokens=prompt_tokens, concurrency=concurrency,
                     decode_tokens=args.decode_tokens, repeats=args.e2e_repeats, max_model_len=args.max_model_len,
                     gpu_memory_utilization=args.gpu_memory_utilization)
    print(format_e2e(result))
    if args.json:
        emit_json(result, args.json)
    if plt is not None:
        plot_e2e(result, args.plot, plt)
        print(f"plot written to {args.plot}")
    return 0 if "compare" in result else 1


def add_e2e_args(p: argparse.ArgumentParser) -> None:
    """``--e2e`` and its options on the ``bench`` parser (``--checkpoint``, ``--json``, ``--plot`` are shared)."""
    g = p.add_argument_group("end to end (--e2e)")
    g.add_argument("--e2e", action="store_true", help="serve --checkpoint with vLLM, ours vs vLLM's own kernels")
    g.add_argument("--prompt-tokens", default=",".join(map(str, PROMPT_TOKENS)), help="TTFT prompt lengths")
    g.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)), help="decode: requests at once")
    g.add_argument("--decode-tokens", type=int, default=128, help="decode: output tokens per request")
    g.add_argument("--e2e-repeats", type=int, default=3, help="repeats per measurement (median)")
    g.add_argument("--max-model-len", type=int, help="default: the longest prompt + the output tokens + 64")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.85, help="vLLM's, per arm (one at a time)")
    g.add_argument("--e2e-engine", default=DEFAULT_ENGINE, help=argparse.SUPPRESS)  # the engine boundary (tests)
    compare = p.get_default("func")
    p.set_defaults(func=lambda args: e2e_command(args) if args.e2e else compare(args))


# ---- one arm (the child process) -----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_nvfp4_sm120.e2e", description="one arm of bench --e2e")
    p.add_argument("--arm", choices=list(ARMS), required=True)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--engine", default=DEFAULT_ENGINE)
    p.add_argument("--prompt-tokens", default=",".join(map(str, PROMPT_TOKENS)))
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)))
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    args = p.parse_args(argv)
    engine = _load_engine(args.engine)(args.checkpoint, backend=ARMS[args.arm][1], max_model_len=args.max_model_len,
                                       gpu_memory_utilization=args.gpu_memory_utilization)
    result = run_arm(engine, prompt_tokens=_ints(args.prompt_tokens, "--prompt-tokens"),
                     concurrency=_ints(args.concurrency, "--concurrency"), decode_tokens=args.decode_tokens,
                     repeats=args.repeats)
    result.update(pid=os.getpid(), plugin_switch=os.environ.get(ENV_SWITCH), backend=ARMS[args.arm][1])
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
