"""Layer 4 — the vLLM glue (the only layer that imports vLLM).

  register.py       the ``vllm.general_plugins`` entry point (``register``), re-entrant and version-guarded
  linear.py         NVFP4 linear kernel classes, one per route of ``dispatch.linear``, and name resolution
  backend_names.py  extends vLLM's closed backend-name Literals (``--linear-backend``; reusable for ``--moe-backend``)
  scale_policy.py   which weight global scales the routes use, from what vLLM leaves on the layer
"""
