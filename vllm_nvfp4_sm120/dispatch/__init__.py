"""Layer 3 — every choice of what runs for a call, and the torch custom ops that the vLLM glue calls.

  hw.py         the GPU a choice is made for: Capability (compute capability, family, SM count)
  linear.py     routes, linear plan kinds, their tables and tiles (``select_linear``)
  moe.py        MoE plan kinds, tiers and tiles (``select_moe_plan``)
  vendor.py     what the cuBLAS / FlashInfer routes need from this machine; the routes ``nvfp4_sm120`` stands for
  configs.py    measured configs per GPU model (``vllm-nvfp4-sm120 tune``), read by the selectors before the tables
  policy.py     the batch numerics policy (``w4a16`` / ``w4a4`` decode, batch-invariant mode) and the guard's
                plan substitutions, which the selectors consult
  guard.py      the load-time numerics guard: each plan of a layer shape checked once on this GPU
  shards.py     which per-rank (tensor-parallel) shards of an NVFP4 layer can be served
  registry.py   plan kind → launcher
  ops.py        ``torch.ops.nvfp4_sm120.linear`` / ``.flashinfer_w4a16``
  moe_flow.py   the MoE layer as a sequence of kernels; moe_ops.py: ``torch.ops.nvfp4_sm120.moe``
"""
