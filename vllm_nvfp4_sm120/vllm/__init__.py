"""Layer 4 — the vLLM glue (the only layer that imports vLLM; no math, no choices of its own).

  register.py       the ``vllm.general_plugins`` entry point: every patch of vLLM, with one undo log
  linear.py         NVFP4 linear kernel classes, one thin class per route of ``dispatch.linear``
  moe.py            the NVFP4 MoE experts class
  scale_policy.py   which global scales our kernels use, picked from what vLLM leaves on the layer
  backend_names.py  extends vLLM's closed backend-name Literals (``--linear-backend``, ``--moe-backend``)
  platform.py       vLLM's view of the GPU as a ``dispatch.hw.Capability``
  log.py            the plugin's logger and its once-per-choice lines
"""
