"""Layer 4 — the vLLM glue: kernel classes, registration, backend names, scale policy (the only layer importing vLLM).

``register`` is the ``vllm.general_plugins`` entry point; importing this package imports nothing from vLLM.
"""


def register() -> None:
    from .register import register as _register

    _register()


__all__ = ["register"]
