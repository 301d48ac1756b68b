"""A small registry of named functions with typed knobs, shared by losses and advantage estimators.

An entry is a pure function ``fn(inputs, *, knob=default, ...)``. Its keyword-only parameters are
its **knobs**: their defaults and annotations are read from the signature, so listing, validating
and calling all come from one place and a knob cannot be accepted by the config yet ignored by the
code (DESIGN.md invariant 6).

- Unknown names and knobs raise ``ValueError`` naming the closest valid key(s) (``difflib``) and
  listing every valid one.
- Knob values are checked against their annotation (``float``, ``int``, ``bool``, ``str``,
  ``Optional[...]``, ``Literal[...]``); anything else is accepted as is. An entry may add a
  ``check(knobs)`` callable for range checks; it receives every knob, defaults filled in.
- Plugins: ``load_plugins(["my.module"])`` imports modules whose decorators register entries; the
  registry's entry-point group (``flash.losses`` / ``flash.advantages``) is loaded lazily on the
  first lookup. An entry point may name a module (its decorators register) or a plain function
  (registered under the entry point's name).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

_MISSING = object()


def closest_error(kind: str, given: str, valid: Iterable[str]) -> ValueError:
    """``ValueError`` for an unknown ``given`` of ``kind``: the closest valid ones, then all."""
    valid = sorted(valid)
    close = difflib.get_close_matches(str(given), valid, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return ValueError(f"unknown {kind} {given!r}{hint} (valid: {', '.join(valid) or 'none'})")


def _type_ok(value: Any, hint: Any) -> tuple[bool, tuple]:
    """Whether ``value`` fits ``hint``; also the Literal choices met on the way (for the error)."""
    origin = typing.get_origin(hint)
    if hint is Any or hint is inspect.Parameter.empty:
        return True, ()
    if origin is Literal:
        choices = typing.get_args(hint)
        return value in choices, choices
    if origin in (typing.Union, types.UnionType):
        found: tuple = ()
        for arm in typing.get_args(hint):
            ok, choices = _type_ok(value, arm)
            if ok:
                return True, ()
            found += choices
        return False, found
    if hint is type(None):
        return value is None, ()
    if hint is bool:
        return isinstance(value, bool), ()
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), ()
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool), ()
    if hint is str:
        return isinstance(value, str), ()
    return True, ()  # an annotation we do not check


@dataclass
class Entry:
    """One registered function: its name, description, knobs ({name: default}) and their types."""

    name: str
    fn: Callable
    description: str
    knobs: dict[str, Any]
    hints: dict[str, Any] = field(default_factory=dict)
    check: Callable[[dict], None] | None = None
    aliases: tuple[str, ...] = ()


def _knobs_of(fn: Callable) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword-only parameters of ``fn``: {name: default} and {name: resolved annotation}."""
    params = inspect.signature(fn).parameters.values()
    knobs, raw_hints = {}, {}
    for p in params:
        if p.kind is not inspect.Parameter.KEYWORD_ONLY:
            continue
        if p.default is inspect.Parameter.empty:
            raise TypeError(f"{fn.__qualname__}: knob {p.name!r} needs a default")
        knobs[p.name] = p.default
        raw_hints[p.name] = p.annotation
    try:
        resolved = typing.get_type_hints(fn)
    except Exception:  # unresolvable annotations in a plugin: skip type checks, keep the knobs
        resolved = {}
    return knobs, {k: resolved.get(k, inspect.Parameter.empty) for k in knobs}


class Registry:
    """Named functions of one kind (``"loss"``, ``"advantage estimator"``), with their knobs.

    ``reserved`` are knob names the caller adds to every entry (e.g. the KL and entropy add-ons);
    an entry may not declare one of them itself.
    """

    def __init__(self, kind: str, entry_point_group: str, reserved: Iterable[str] = ()):
        self.kind = kind
        self.group = entry_point_group
        self.reserved = frozenset(reserved)
        self._entries: dict[str, Entry] = {}
        self._aliases: dict[str, str] = {}
        self._entry_points_loaded = False

    # -- registration -----------------------------------------------------------------------
    def register(self, name: str, description: str | None = None, *,
                 check: Callable[[dict], None] | None = None, aliases: Iterable[str] = ()):
        """Decorator: register ``fn`` under ``name`` (and ``aliases``); returns ``fn`` unchanged."""

        def deco(fn: Callable) -> Callable:
            knobs, hints = _knobs_of(fn)
            clash = self.reserved & knobs.keys()
            if clash:
                raise ValueError(f"{self.kind} {name!r}: knob(s) {sorted(clash)} are reserved for "
                                 f"the add-ons every {self.kind} takes; rename them")
            for key in (name, *aliases):
                old = self._entries.get(self._aliases.get(key, key))
                if old is not None and not _same_function(old.fn, fn):
                    raise ValueError(f"{self.kind} {key!r} is already registered by "
                                     f"{old.fn.__module__}.{old.fn.__qualname__}")
            doc = (inspect.getdoc(fn) or "").strip().splitlines()
            desc = description or (doc[0] if doc else "")
            self._entries[name] = Entry(name, fn, desc, knobs, hints, check, tuple(aliases))
            for alias in aliases:
                self._aliases[alias] = name
            return fn

        return deco

    def unregister(self, name: str) -> None:
        """Remove ``name`` and its aliases (for tests and interactive use)."""
        entry = self._entries.pop(name)
        for alias in entry.aliases:
            self._aliases.pop(alias, None)

    # -- lookup -----------------------------------------------------------------------------
    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._entries)

    def get(self, name: str) -> Entry:
        self._load_entry_points()
        entry = self._entries.get(self._aliases.get(name, name))
        if entry is None:
            raise closest_error(self.kind, name, [*self._entries, *self._aliases])
        return entry

    def resolve(self, name: str, knobs: dict[str, Any], extra: dict[str, Any] | None = None,
                extra_hints: dict[str, Any] | None = None) -> tuple[Entry, dict[str, Any]]:
        """Check ``knobs`` against ``name``'s knobs plus ``extra`` ({knob: default}) and return
        the entry and every knob with defaults filled in. Raises ``ValueError`` on any mismatch."""
        entry = self.get(name)
        defaults = {**entry.knobs, **(extra or {})}
        hints = {**entry.hints, **(extra_hints or {})}
        for key, value in knobs.items():
            if key not in defaults:
                raise closest_error(f"knob for {self.kind} {entry.name!r}:", key, defaults)
            ok, choices = _type_ok(value, hints.get(key, inspect.Parameter.empty))
            if not ok:
                if choices and isinstance(value, str):
                    raise closest_error(f"value of {self.kind} knob {key!r}:", value,
                                        [str(c) for c in choices])
                raise ValueError(f"{self.kind} {entry.name!r}: knob {key!r}={value!r} is not a "
                                 f"{_hint_name(hints[key])}")
        full = {**defaults, **knobs}
        if entry.check is not None:
            entry.check({k: full[k] for k in entry.knobs})
        return entry, full

    def describe(self) -> list[dict[str, Any]]:
        """``[{name, description, knobs: {knob: default}, aliases}]``, sorted by name."""
        return [{"name": e.name, "description": e.description, "knobs": dict(e.knobs),
                 "aliases": list(e.aliases)} for e in (self.get(n) for n in self.names())]

    # -- plugins ----------------------------------------------------------------------------
    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True  # set first: a plugin's import may look names up
        for ep in importlib.metadata.entry_points(group=self.group):
            try:
                obj = ep.load()
            except Exception as exc:
                raise RuntimeError(f"{self.kind} plugin entry point {ep.name!r} = {ep.value!r} "
                                   f"(group {self.group!r}) failed to load: {exc}") from exc
            if callable(obj) and not isinstance(obj, types.ModuleType) and not any(
                    _same_function(e.fn, obj) for e in self._entries.values()):
                self.register(ep.name)(obj)


def _same_function(a: Callable, b: Callable) -> bool:
    """Same object, or the same module-level function re-imported (a reloaded plugin module)."""
    return a is b or (getattr(a, "__module__", None) == getattr(b, "__module__", 0)
                      and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", 0))


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def load_plugins(modules: Iterable[str]) -> list[str]:
    """Import each named module so that its ``@register_loss`` / ``@register_advantage``
    decorators run. Returns the module names imported. An import error propagates, naming the
    module (a plugin named in a recipe that cannot load is an error, never skipped)."""
    done = []
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ImportError(f"flash plugin module {name!r} could not be imported: {exc}") from exc
        done.append(name)
    return done
