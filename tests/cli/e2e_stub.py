"""A stand-in for vLLM's engine at the ``bench --e2e`` boundary (``e2e.VllmEngine``), for the CPU tests.

Deterministic: times are fixed per arm (the plugin's arm twice as fast at prefill, 1.5x at decode) and the greedy
texts are the prompts' upper case, except that the plugin's arm changes character 7 of the second prompt's.
It checks what each arm process must see: its backend and its plugin switch.
"""

import os

from vllm_nvfp4_sm120 import e2e


class StubEngine:
    vocab_size = 32000

    def __init__(self, checkpoint, *, backend, max_model_len, gpu_memory_utilization):
        switch = os.environ[e2e.ENV_SWITCH]
        assert (backend, switch) in (("nvfp4_sm120", "1"), ("auto", "0")), (backend, switch)
        self.ours = backend == "nvfp4_sm120"
        self.max_model_len = max_model_len

    def generate(self, prompts, max_tokens, ignore_eos=True):
        for p in prompts:
            if isinstance(p, list):
                assert len(p) + max_tokens <= self.max_model_len and all(0 <= i < self.vocab_size for i in p)
        if prompts and isinstance(prompts[0], str) and prompts[0] in e2e.GREEDY_PROMPTS:
            texts = [p.upper() for p in prompts]
            if self.ours:
                texts[1] = texts[1][:7] + "#" + texts[1][8:]
            return 0.5, texts
        tokens = sum(len(p) if isinstance(p, list) else 1 for p in prompts)
        prefill = tokens * (1e-6 if self.ours else 2e-6)
        decode = (max_tokens - 1) * (0.01 if self.ours else 0.015)
        return prefill + decode, ["x"] * len(prompts)
