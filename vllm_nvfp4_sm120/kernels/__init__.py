"""Layer 2 — Triton and Gluon kernels with their validating launchers (the tile is always an argument), one file
per kernel family, plus what the families share (``common.py``, ``gluon_common.py``, ``moe_common.py``,
``fp4_decode.py``, ``tile_order.py``, ``gluon_compat.py``) and ``aot``, the harness that compiles them for sm_120
on a machine without one.  No vLLM import here, and no choice: which kernel and tile run is ``dispatch``'s."""
