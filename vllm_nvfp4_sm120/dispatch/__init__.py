"""Layer 3 — what runs for a call: dispatch tables (kernel + tile per GPU, route and shape), the MoE layer flow,
and the torch custom ops that the vLLM glue calls."""
