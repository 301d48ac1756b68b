"""The one registry type of every pluggable concept: losses, advantage estimators, rewards, tasks
and environments are each a ``Registry`` of named entries with typed knobs.

An entry is a function ``fn(inputs, *, knob=default, ...)`` -- its keyword-only parameters are its
**knobs**, defaults and annotations read from the signature -- or a class whose ``Options``
dataclass's fields are its knobs (tasks, environments). Listing, validating and calling all come
from one place, so a knob cannot be accepted by the config yet ignored by the code (docs/design.md
invariant 6), and every unknown name gets the same closest-name error (``closest_error``).

- Unknown names and knobs raise ``ValueError`` naming the closest valid key(s) (``difflib``) and
  listing every valid one.
- Knob values are checked against their annotation (``float``, ``int``, ``bool``, ``str``,
  ``Optional[...]``, ``Literal[...]``); anything else is accepted as is. An entry may add a
  ``check(knobs)`` callable for range checks; it receives every knob, defaults filled in.
- Plugins: ``load_plugins(["my.module"])`` imports modules whose decorators register entries; the
  registry's entry-point group (``flash.losses`` / ``flash.advantages``) and its ``builtins``
  (module names, imported by name so that the registry never imports its content) are loaded
  lazily on the first lookup. An entry point may name a module (its decorators register) or a plain function
  (registered under the entry point's name).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import sys
import importlib.metadata
import inspect
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal

_MISSING = object()


def closest_names(given: str, valid: Iterable[str], n: int = 3) -> list[str]:
    """The valid names nearest ``given`` (at most ``n``, nearest first): the one matcher behind
    every "did you mean" in flash."""
    return difflib.get_close_matches(str(given), sorted(valid), n=n, cutoff=0.5)


def did_you_mean(given: str, valid: Iterable[str], n: int = 3) -> str:
    """``"; did you mean 'x'?"`` (up to ``n`` names, nearest first), or '' when nothing is near."""
    close = closest_names(given, valid, n)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


def closest_error(kind: str, given: str, valid: Iterable[str], where: str = "") -> ValueError:
    """``ValueError`` for an unknown ``given`` of ``kind`` (``where``: e.g. " for loss 'ppo'"): the
    closest valid ones, then all. The one wording of every "unknown name" error in flash."""
    valid = sorted(valid)
    return ValueError(
        f"unknown {kind} {given!r}{where}{did_you_mean(given, valid)} (valid: {', '.join(valid) or 'none'})"
    )


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
    meta: dict[str, Any] = field(default_factory=dict)


def _knobs_of(fn: Callable) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword-only parameters of ``fn``: {name: default} and {name: resolved annotation}; for a
    class, the fields of its ``Options`` dataclass (their types are the dataclass's to check)."""
    if inspect.isclass(fn):
        return _option_knobs(fn), {}
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


def _option_knobs(cls: type) -> dict[str, Any]:
    """{field: default} of ``cls.Options`` (``_MISSING`` for a field without one); {} without it."""
    options = getattr(cls, "Options", None)
    if not dataclasses.is_dataclass(options):
        return {}
    return {
        f.name: (
            f.default
            if f.default is not dataclasses.MISSING
            else f.default_factory()
            if f.default_factory is not dataclasses.MISSING
            else _MISSING
        )
        for f in dataclasses.fields(options)
    }


class Registry:
    """Named entries of one kind (``"loss"``, ``"task"``, ``"reward"``, ...), with their knobs.

    ``reserved`` are knob names the caller adds to every entry (e.g. the KL and entropy add-ons);
    an entry may not declare one of them itself. ``builtins`` are modules (by name) whose
    decorators register the built-in entries, imported on the first lookup.
    """

    def __init__(
        self,
        kind: str,
        entry_point_group: str | None = None,
        reserved: Iterable[str] = (),
        builtins: Iterable[str] = (),
    ):
        self.kind = kind
        self.group = entry_point_group
        self.reserved = frozenset(reserved)
        self.builtins = tuple(builtins)
        self._entries: dict[str, Entry] = {}
        self._aliases: dict[str, str] = {}
        self._entry_points_loaded = False

    # -- registration -----------------------------------------------------------------------
    def register(
        self,
        name: str,
        description: str | None = None,
        *,
        check: Callable[[dict], None] | None = None,
        aliases: Iterable[str] = (),
        knobs: dict[str, Any] | None = None,
        meta: dict[str, Any] | None = None,
    ):
        """Decorator: register ``fn`` (a function or a class) under ``name`` (and ``aliases``);
        returns it unchanged. ``knobs`` ({name: default}) replaces reading them from ``fn``;
        ``meta`` is kept on the entry for its registry's own use (e.g. a reward's ``builder``)."""

        def deco(fn: Callable) -> Callable:
            own, hints = ({**knobs}, {}) if knobs is not None else _knobs_of(fn)
            clash = self.reserved & own.keys()
            if clash:
                raise ValueError(
                    f"{self.kind} {name!r}: knob(s) {sorted(clash)} are reserved for "
                    f"the add-ons every {self.kind} takes; rename them"
                )
            for key in (name, *aliases):
                old = self._entries.get(self._aliases.get(key, key))
                if old is not None and not _same_function(old.fn, fn):
                    raise ValueError(
                        f"{self.kind} {key!r} is already registered by {old.fn.__module__}.{old.fn.__qualname__}"
                    )
            doc = (inspect.getdoc(fn) or "").strip().splitlines()
            desc = description or (doc[0] if doc else "")
            self._entries[name] = Entry(name, fn, desc, own, hints, check, tuple(aliases), dict(meta or {}))
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

    def __contains__(self, name: str) -> bool:
        self._load_entry_points()
        return self._aliases.get(name, name) in self._entries

    def check_knobs(self, name: str, given: Iterable[str], what: str = "knob") -> Entry:
        """The entry of ``name``; an unknown key of ``given`` raises the closest-name error."""
        entry = self.get(name)
        for key in given:
            if key not in entry.knobs:
                raise closest_error(what, key, entry.knobs, where=f" for {self.kind} {entry.name!r}")
        return entry

    def resolve(
        self,
        name: str,
        knobs: dict[str, Any],
        extra: dict[str, Any] | None = None,
        extra_hints: dict[str, Any] | None = None,
    ) -> tuple[Entry, dict[str, Any]]:
        """Check ``knobs`` against ``name``'s knobs plus ``extra`` ({knob: default}) and return
        the entry and every knob with defaults filled in. Raises ``ValueError`` on any mismatch."""
        entry = self.get(name)
        defaults = {**entry.knobs, **(extra or {})}
        hints = {**entry.hints, **(extra_hints or {})}
        for key, value in knobs.items():
            if key not in defaults:
                raise closest_error("knob", key, defaults, where=f" for {self.kind} {entry.name!r}")
            ok, choices = _type_ok(value, hints.get(key, inspect.Parameter.empty))
            if not ok:
                if choices and isinstance(value, str):
                    raise closest_error(f"value of {self.kind} knob {key!r}:", value, [str(c) for c in choices])
                raise ValueError(
                    f"{self.kind} {entry.name!r}: knob {key!r}={value!r} is not a {_hint_name(hints[key])}"
                )
        full = {**defaults, **knobs}
        if entry.check is not None:
            entry.check({k: full[k] for k in entry.knobs})
        return entry, full

    def describe(self) -> list[dict[str, Any]]:
        """``[{name, description, knobs: {knob: default}, aliases}]``, sorted by name."""
        return [
            {"name": e.name, "description": e.description, "knobs": dict(e.knobs), "aliases": list(e.aliases)}
            for e in (self.get(n) for n in self.names())
        ]

    # -- plugins ----------------------------------------------------------------------------
    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True  # set first: a plugin's import may look names up
        for module in self.builtins:
            importlib.import_module(module)
        for ep in importlib.metadata.entry_points(group=self.group) if self.group else ():
            try:
                obj = ep.load()
            except Exception as exc:
                raise RuntimeError(
                    f"{self.kind} plugin entry point {ep.name!r} = {ep.value!r} "
                    f"(group {self.group!r}) failed to load: {exc}"
                ) from exc
            if (
                callable(obj)
                and not isinstance(obj, types.ModuleType)
                and not any(_same_function(e.fn, obj) for e in self._entries.values())
            ):
                self.register(ep.name)(obj)


def _same_function(a: Callable, b: Callable) -> bool:
    """Same object, or the same module-level function re-imported (a reloaded plugin module)."""
    return a is b or (
        getattr(a, "__module__", None) == getattr(b, "__module__", 0)
        and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", 0)
    )


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def searched_paths() -> str:
    """The first entries of the import search path, for an error that says where it looked."""
    return ", ".join(p for p in sys.path[:8] if p) + (", ..." if len(sys.path) > 8 else "")


def import_path(path: str, what: str) -> Any:
    """The function ``package.module:function`` names (a user's reward, agent, ...); ValueError
    naming ``what`` it is for, the module, the paths searched, or the closest function there."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{what} {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"{what} {path!r}: cannot import module {module_name!r}: {exc} (searched: "
            f"{searched_paths()}); put it beside the recipe or add its folder to PYTHONPATH"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ValueError(
            f"{what} {path!r}: module {module_name!r} has no function {attr!r}{did_you_mean(attr, public, n=1)}"
        )
    return fn


def load_plugins(modules: Iterable[str]) -> list[str]:
    """Import each named module so that its ``@register_loss`` / ``@register_advantage``
    decorators run. Returns the module names imported. An import error propagates, naming the
    module (a plugin named in a recipe that cannot load is an error, never skipped).

    A name may be a module (``my_pkg.losses``) or the path of a ``.py`` file (its directory is
    searched, then its stem imported). The working directory is searched too (as ``python -m``
    would), so a plugin beside the recipe is found without setting PYTHONPATH, in the driver and in
    Ray's workers (``flash.cluster`` hands them this process's search path)."""
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    done = []
    for name in modules:
        module = name
        if name.endswith(".py"):
            folder, module = os.path.split(os.path.abspath(name[:-3]))
            if folder not in sys.path:
                sys.path.append(folder)
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(
                f"flash plugin module {name!r} could not be imported: {exc} (searched: {searched_paths()}); "
                f"put it beside the recipe, give its .py path, or add its folder to PYTHONPATH"
            ) from exc
        done.append(name)
    return done
