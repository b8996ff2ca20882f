"""Add backend names to vLLM's closed ``Literal`` option types (``--linear-backend``, ``--moe-backend``).

vLLM 0.33 validates backend names twice: argparse ``choices`` built from the ``Literal`` of the ``EngineArgs``
field (``engine/arg_utils.py``, cached in ``_compute_kwargs``) and pydantic validation of ``KernelConfig``.  A
plugin cannot add a name through any API, so we replace the ``Literal`` everywhere vLLM reads it:

* the ``dataclasses`` field type and ``__annotations__`` of each owner class (argparse reads those),
* the pydantic field annotation of pydantic dataclasses, followed by a forced schema rebuild,
* the module-level alias (``LinearBackend``) in every ``vllm`` module that imported it, so string annotations and
  later imports resolve to the extended type,

and clear ``arg_utils._compute_kwargs``.  Every replacement is recorded: each extension returns its own undo, and
undoing one re-installs the ``Literal`` of the others (vLLM may call the plugin's registration again at any time,
e.g. when ``EngineArgs`` loads the general plugins, so extensions need not be undone in the order they were made).
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
# SpeculativeConfig.moe_backend: the draft model's --moe-backend (its own or inherited from the target's).
MOE_BACKEND = ("vllm.config.kernel", "MoEBackend",
               ("vllm.config.kernel:KernelConfig", "vllm.engine.arg_utils:EngineArgs",
                "vllm.config.speculative:SpeculativeConfig"))


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


@dataclass
class _Extended:
    """One alias's state: the ``Literal`` vLLM defined, the names each live extension added, the undo log of the
    ``Literal`` now installed (built from all of them)."""

    original: Any
    added: dict[object, tuple[str, ...]] = field(default_factory=dict)
    undo: _Undo = field(default_factory=_Undo)
    made: list[Any] = field(default_factory=list)  # every Literal installed so far (a module may still hold one)


_APPLIED: dict[tuple[str, str], _Extended] = {}  # (module, alias) -> its state


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


def _install(spec: tuple[str, str, Sequence[str]], state: _Extended) -> None:
    """Put back vLLM's ``Literal``, then install one with every name the live extensions add (if any)."""
    module_name, alias, owners = spec
    state.undo.run()
    state.undo = _Undo()
    names = tuple(dict.fromkeys(n for added in state.added.values() for n in added))
    if names:
        old = state.original
        new = Literal[literal_names(old) + names]  # type: ignore[valid-type]
        undo = state.undo
        # Owners go last in the undo log's reverse order: their rebuild must see the restored aliases.
        for owner in owners:
            _retype_class(_resolve(owner), old, new, undo)
        # Modules imported since an earlier extension hold that one: they go back to vLLM's too.
        ours = (old, *state.made)
        for mod_name, mod in list(sys.modules.items()):
            held = getattr(mod, "__dict__", {}).get(alias)
            if mod_name.split(".")[0] == "vllm" and any(held is t for t in ours):
                setattr(mod, alias, new)
                undo.steps.append(functools.partial(setattr, mod, alias, old))
        state.made.append(new)
        undo.steps.insert(0, _clear_arg_caches)
    _clear_arg_caches()


def extend_literal(spec: tuple[str, str, Sequence[str]], names: Sequence[str]) -> Callable[[], None] | None:
    """Append ``names`` to the vLLM ``Literal`` described by ``spec`` (:data:`LINEAR_BACKEND`, :data:`MOE_BACKEND`).

    Returns the undo of this extension alone (other extensions of the same ``Literal`` stay, in any undo order),
    or None (and changes nothing) when every name is already accepted.
    """
    module_name, alias, _ = spec
    __import__(module_name)
    current = getattr(sys.modules[module_name], alias)
    missing = tuple(n for n in names if n not in literal_names(current))
    if not missing:
        return None
    key = (module_name, alias)
    state = _APPLIED.setdefault(key, _Extended(original=current))
    token = object()
    state.added[token] = missing
    try:
        _install(spec, state)
    except BaseException:
        _remove(spec, token)
        raise
    return functools.partial(_remove, spec, token)


def _remove(spec: tuple[str, str, Sequence[str]], token: object) -> None:
    key = spec[:2]
    state = _APPLIED.get(key)
    if state is None or state.added.pop(token, None) is None:
        return  # already undone (restore)
    _install(spec, state)
    if not state.added:
        del _APPLIED[key]


def restore(spec: tuple[str, str, Sequence[str]]) -> None:
    """Undo every :func:`extend_literal` on ``spec``: vLLM's own ``Literal`` again (tests)."""
    state = _APPLIED.pop(spec[:2], None)
    if state is not None:
        state.added.clear()
        _install(spec, state)


def accepted_names(spec: tuple[str, str, Sequence[str]]) -> tuple[str, ...]:
    module_name, alias, _ = spec
    __import__(module_name)
    return literal_names(getattr(sys.modules[module_name], alias))
