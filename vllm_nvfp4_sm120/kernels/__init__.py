"""Layer 2 — Triton and Gluon kernels with their launchers, one file per kernel family, and ``aot``, the harness
that compiles them for sm_120 on a machine without one.  No vLLM import here."""
