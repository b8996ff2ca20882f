"""vLLM plugin: fast NVFP4 linears and MoE experts on sm_120 GPUs (RTX 5090, RTX PRO 6000).

Layers, each importing only from those above it:
  format/    NVFP4 codes, scales, swizzle, global-scale conventions, torch references (no GPU)
  kernels/   Triton and Gluon kernels with their launchers, and the sm_120 compile harness (no vLLM)
  dispatch/  which kernel and tile for (GPU, route, shape)
  vllm/      kernel classes, MoE experts, registration (the only layer that imports vLLM)
  cli        ``vllm-nvfp4-sm120 env|inspect|bench|selftest``
"""

__version__ = "0.1.0"
