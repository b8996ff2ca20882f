"""Add backend names to vLLM's closed ``Literal`` option types (``--linear-backend``, ``--moe-backend``).

vLLM 0.33 validates backend names twice: argparse ``choices`` built from the ``Literal`` of the ``EngineArgs``
field (``engine/arg_utils.py``, cached in ``_compute_kwargs``) and pydantic validation of ``KernelConfig``.  A
plugin cannot add a name through any API, so we replace the ``Literal`` everywhere vLLM reads it:

* the ``dataclasses`` field type and ``__annotations__`` of each owner class (argparse reads those),
* the pydantic field annotation of pydantic dataclasses, followed by a forced schema rebuild,
* the module-level alias (``LinearBackend``) in every ``vllm`` module that imported it, so string annotations and
  later imports resolve to the extended type,

and clear ``arg_utils._compute_kwargs``.  Every replacement is recorded so :func:`restore` can undo it.
Unknown names stay rejected: we only append to the ``Literal``.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import sys
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

# (module holding the Literal alias, alias name, classes whose fields use it)
LINEAR_BACKEND = ("vllm.config.kernel", "LinearBackend", ("vllm.config.kernel:KernelConfig", "vllm.engine.arg_utils:EngineArgs"))
MOE_BACKEND = ("vllm.config.kernel", "MoEBackend", ("vllm.config.kernel:KernelConfig", "vllm.engine.arg_utils:EngineArgs"))


def literal_names(tp: Any) -> tuple[str, ...]:
    if typing.get_origin(tp) is not Literal:
        raise TypeError(f"expected a typing.Literal, got {tp!r}")
    return typing.get_args(tp)


def _is_same_literal(tp: Any, old: Any) -> bool:
    return typing.get_origin(tp) is Literal and set(typing.get_args(tp)) == set(typing.get_args(old))


def substitute(tp: Any, old: Any, new: Any) -> Any:
    """``tp`` with every ``Literal`` equal to ``old`` replaced by ``new`` (inside ``dict[str, L] | None`` too)."""
    if _is_same_literal(tp, old):
        return new
    args = typing.get_args(tp)
    if not args or typing.get_origin(tp) is Literal:
        return tp
    new_args = tuple(substitute(a, old, new) for a in args)
    if new_args == args:
        return tp
    origin = typing.get_origin(tp)
    if isinstance(tp, types.UnionType):
        return functools.reduce(operator.or_, new_args)
    if origin is typing.Union:
        return typing.Union[new_args]
    if isinstance(tp, types.GenericAlias):
        return types.GenericAlias(origin, new_args)
    return tp.copy_with(new_args)  # typing._GenericAlias (typing.Dict[...], Optional, ...)


def _resolve(path: str) -> type:
    module, _, name = path.partition(":")
    __import__(module)
    return getattr(sys.modules[module], name)


@dataclass
class _Undo:
    steps: list[Callable[[], None]] = field(default_factory=list)

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        had, old = hasattr(obj, name), getattr(obj, name, None)
        setattr(obj, name, value)
        self.steps.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    def setitem(self, d: dict, key: Any, value: Any) -> None:
        old = d[key]
        d[key] = value
        self.steps.append(lambda: d.__setitem__(key, old))

    def run(self) -> None:
        while self.steps:
            self.steps.pop()()


_APPLIED: dict[tuple[str, str], tuple[Any, _Undo]] = {}  # (module, alias) -> (original Literal, undo log)


def _retype_class(cls: type, old: Any, new: Any, undo: _Undo) -> list[str]:
    """Retype every field of dataclass ``cls`` whose type mentions ``old``; returns the field names."""
    changed = []
    pyd_fields = vars(cls).get("__pydantic_fields__")
    for f in dataclasses.fields(cls):
        new_type = substitute(f.type, old, new)
        if new_type is f.type:
            continue
        changed.append(f.name)
        undo.setattr(f, "type", new_type)
        undo.setitem(cls.__annotations__, f.name, new_type)
        if pyd_fields is not None and f.name in pyd_fields:
            undo.setattr(pyd_fields[f.name], "annotation", substitute(pyd_fields[f.name].annotation, old, new))
    if changed and pyd_fields is not None:
        from pydantic.dataclasses import rebuild_dataclass

        rebuild_dataclass(cls, force=True)
        # Undo steps run in reverse, so this rebuild happens after the annotations are restored.
        undo.steps.insert(0, lambda: rebuild_dataclass(cls, force=True))
    return changed


def _clear_arg_caches() -> None:
    arg_utils = sys.modules.get("vllm.engine.arg_utils")
    if arg_utils is not None and hasattr(arg_utils, "_compute_kwargs"):
        arg_utils._compute_kwargs.cache_clear()


def extend_literal(spec: tuple[str, str, Sequence[str]], names: Sequence[str]) -> bool:
    """Append ``names`` to the vLLM ``Literal`` described by ``spec`` (:data:`LINEAR_BACKEND`, :data:`MOE_BACKEND`).

    Idempotent: returns False (and changes nothing) when every name is already accepted.
    """
    module_name, alias, owners = spec
    __import__(module_name)
    old = getattr(sys.modules[module_name], alias)
    missing = [n for n in names if n not in literal_names(old)]
    if not missing:
        return False
    new = Literal[literal_names(old) + tuple(missing)]  # type: ignore[valid-type]
    key = (module_name, alias)
    original, undo = _APPLIED.get(key, (old, _Undo()))
    # Owners go last in the undo log's reverse order: their rebuild must see the restored aliases.
    for owner in owners:
        _retype_class(_resolve(owner), old, new, undo)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.split(".")[0] == "vllm" and getattr(mod, "__dict__", {}).get(alias) is old:
            undo.setattr(mod, alias, new)
    undo.steps.insert(0, _clear_arg_caches)
    _APPLIED[key] = (original, undo)
    _clear_arg_caches()
    return True


def restore(spec: tuple[str, str, Sequence[str]]) -> None:
    """Undo every :func:`extend_literal` on ``spec`` (tests, and ``register.unregister``)."""
    module_name, alias, _ = spec
    entry = _APPLIED.pop((module_name, alias), None)
    if entry is not None:
        entry[1].run()
        _clear_arg_caches()


def accepted_names(spec: tuple[str, str, Sequence[str]]) -> tuple[str, ...]:
    module_name, alias, _ = spec
    __import__(module_name)
    return literal_names(getattr(sys.modules[module_name], alias))
