"""Layer 3 — every choice of what runs for a call, and the torch custom ops that the vLLM glue calls.

  hw.py         the GPU a choice is made for: Capability (compute capability, family, SM count)
  linear.py     routes, linear plan kinds, their tables and tiles (``select_linear``)
  moe.py        MoE plan kinds, tiers and tiles (``select_moe_plan``)
  vendor.py     what the cuBLAS / FlashInfer routes need from this machine; the routes ``nvfp4_sm120`` stands for
  configs.py    measured configs per GPU model (``vllm-nvfp4-sm120 tune``), read by the selectors before the tables
  registry.py   plan kind → launcher
  ops.py        ``torch.ops.nvfp4_sm120.linear`` / ``.flashinfer_w4a16``
  moe_flow.py   the MoE layer as a sequence of kernels; moe_ops.py: ``torch.ops.nvfp4_sm120.moe``
"""
