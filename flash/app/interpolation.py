"""Interpolations in a config's layers (OmegaConf's grammar: ``${key}``, ``${.sibling}``,
``${oc.env:VAR}``, ...): which a file may use, and their resolution, bounded.

A recipe file (and a run dir's ``config.yaml``) is data, wherever it came from. It may refer to
the config's own keys (``${train.steps}``, ``${..name}``, ``${oc.select:key,default}``,
``${oc.dict.keys:key}``, ``${oc.dict.values:key}``) and read an environment variable only when
the command line allows that variable (``allow_env=[VAR,...]``); it may use no other resolver
(``oc.decode`` turns text into interpolations, ``oc.create`` text into config, ``oc.coerce``
imports a module by name, and a resolver another package registered may read anything). The
command line's own overrides are the user's: they may read any variable and use ``oc.decode``.

Every interpolation is resolved here, once each, over the merged layers (plain mappings), before
OmegaConf builds the typed config, so the config built (and the run's ``config.yaml``) holds no
interpolation. A value that interpolations build is at most ``MAX_CHARS`` characters, the whole
config at most ``MAX_TOTAL_CHARS``, a chain of references at most ``MAX_DEPTH`` long and a layer
at most ``MAX_INTERPOLATIONS`` interpolations; past a bound, one line names the key.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, Iterator

from omegaconf.errors import GrammarParseError
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser as Grammar
from omegaconf.grammar_parser import parse
from omegaconf.grammar_visitor import GrammarVisitor

from flash.errors import ConfigError

MAX_CHARS = 1 << 20  # one value built by interpolations
MAX_TOTAL_CHARS = 4 << 20  # the whole config, copies included
MAX_DEPTH = 32  # references followed from one value
MAX_INTERPOLATIONS = 1000  # in one layer (a recipe file, the command line)
FILE_RESOLVERS = ("oc.env", "oc.select", "oc.dict.keys", "oc.dict.values")
USER_RESOLVERS = (*FILE_RESOLVERS, "oc.decode")
ALLOW_ENV = "allow_env"  # the command line's key naming the variables a file may read
TRUST = "trust_checkpoint"  # the command line's alone too (flash.checkpoint_trust)


ENV_NAME = r"[A-Za-z_][A-Za-z0-9_]*"


def split_allow_env(overrides: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """(the variables ``allow_env=VAR,...`` / ``allow_env=[VAR,...]`` names, the other overrides):
    the command line's allow-list, not a setting of the run (``config.yaml`` never records it)."""
    names, rest = [], []
    for item in overrides:
        key, eq, value = item.partition("=")
        if not (eq and key.strip() == ALLOW_ENV):
            rest.append(item)
            continue
        names += [n.strip().strip("'\"") for n in value.strip().strip("[]").split(",") if n.strip()]
    bad = [n for n in names if not re.fullmatch(ENV_NAME, n)]
    if bad:
        raise ConfigError(f"{ALLOW_ENV}: {bad[0]!r} is not an environment variable's name (allow_env=[VAR,...])")
    return tuple(dict.fromkeys(names)), rest


def check_file(layer: dict, where: str, allow_env: tuple[str, ...] = ()) -> None:
    """One line naming the key when the file ``where`` uses a resolver it may not (module
    docstring), reads a variable not in ``allow_env``, or holds more interpolations than a config
    needs; ``allow_env`` itself is the command line's to give, never a file's, and so is trusting a
    checkpoint (``trust_checkpoint``: a recipe or run dir may not vouch for its own checkpoints)."""
    if ALLOW_ENV in layer:
        raise ConfigError(
            f"{where}: {ALLOW_ENV} is the command line's to give, not a file's: remove it and "
            f"pass {ALLOW_ENV}=[VAR,...] after the recipe"
        )
    if layer.get(TRUST) not in (None, False):
        raise ConfigError(
            f"{where}: {TRUST} is the command line's to give, not a file's: remove it and "
            f"pass {TRUST}=true after the recipe if you trust the checkpoint"
        )
    texts = [(key, text) for key, text in strings(layer) if "${" in text]
    count = sum(text.count("${") for _, text in texts)
    if count > MAX_INTERPOLATIONS:
        raise ConfigError(
            f"{where}: {count} interpolations, more than a config holds ({MAX_INTERPOLATIONS}); write the values out"
        )
    for key, text in texts:
        for name, arg in resolver_uses(_parsed(text, f"{where}: {key}")):
            _check_use(name, arg, f"{where}: {key}", allow_env)


def _check_use(name: str, arg: str, where: str, allow_env: tuple[str, ...]) -> None:
    if name not in FILE_RESOLVERS:
        raise ConfigError(
            f"{where} uses the resolver {name}, which a recipe file may not (it may read the "
            f"environment, files or code); set that key on the command line instead"
        )
    if name != "oc.env":
        return
    if not re.fullmatch(ENV_NAME, arg):
        raise ConfigError(
            f"{where}: oc.env names its variable by {arg!r}, not a plain name; a recipe file "
            f"names the variable it reads, so that allow_env=[VAR] can allow it"
        )
    if arg not in allow_env:
        raise ConfigError(
            f"{where} reads the environment variable {arg} (oc.env), which the command line does "
            f"not allow: pass {ALLOW_ENV}=[{arg}] to allow it, or set that key on the command line"
        )


def strings(node: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    """``(dotted key, text)`` of every string in a nested mapping / list."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from strings(v, f"{prefix}{k}.")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from strings(v, f"{prefix}{i}.")
    elif isinstance(node, str):
        yield prefix[:-1], node


def resolver_uses(tree: Any) -> Iterator[tuple[str, str]]:
    """``(resolver name, its first argument's text, unquoted)`` of every resolver in a parse tree."""
    if isinstance(tree, Grammar.InterpolationResolverContext):
        seq = tree.getChild(3)
        arg = seq.getChild(0).getText() if isinstance(seq, Grammar.SequenceContext) else ""
        if len(arg) >= 2 and arg[0] == arg[-1] and arg[0] in "'\"":
            arg = arg[1:-1]
        yield tree.getChild(1).getText(), arg
    for child in getattr(tree, "children", None) or []:
        yield from resolver_uses(child)


def _parsed(text: str, where: str, rule: str = "configValue", mode: str = "DEFAULT_MODE") -> Any:
    try:
        return parse(text, parser_rule=rule, lexer_mode=mode)
    except GrammarParseError as exc:
        raise ConfigError(f"{where}: cannot parse the interpolation: {str(exc).splitlines()[0][:200]}") from None
    except RecursionError:
        raise ConfigError(f"{where}: interpolations nest too deep to parse; write the value out") from None


def resolve(settings: dict, missing_ok: bool = False) -> dict:
    """``settings`` with every interpolation resolved (module docstring) and every ``${`` left in a
    value escaped, so OmegaConf reads it as text. ``missing_ok``: a reference to a key the mapping
    lacks stands for its own text (to bound one file whose keys the defaults complete)."""
    try:
        return escape(_Resolution(settings, missing_ok).node(()))
    except RecursionError:
        raise ConfigError("interpolations nest too deep to resolve; write the values out") from None


def escape(value: Any) -> Any:
    """``value`` with ``${`` in its strings escaped as OmegaConf reads it back as text."""
    if isinstance(value, dict):
        return {k: escape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [escape(v) for v in value]
    if isinstance(value, str) and "${" in value:
        return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", value)
    return value


def _key(path: tuple) -> str:
    return ".".join(str(p) for p in path) or "(the config)"


class _Resolution:
    """Each value resolved once (``done``), its size known (``sizes``, by object: resolved values
    share parts), the references being followed on ``active``."""

    def __init__(self, root: dict, missing_ok: bool):
        self.root, self.missing_ok = root, missing_ok
        self.done: dict[tuple, Any] = {}
        self.sizes: dict[int, tuple[int, Any]] = {}
        self.active: list[tuple] = []

    def node(self, path: tuple) -> Any:
        if path not in self.done:
            raw, resolved = self._raw(path)
            self.done[path] = raw if resolved else self._value(raw, path)
        return self.done[path]

    def _raw(self, path: tuple) -> tuple[Any, bool]:
        """The value at ``path`` as written, or (past an interpolation that stands for a mapping)
        as resolved; and whether it is the resolved one."""
        obj, resolved = self.root, False
        for i, part in enumerate(path):
            if not resolved and _interpolated(obj):
                obj, resolved = self.node(path[:i]), True
            obj = _child(obj, part, path[: i + 1])
        return obj, resolved

    def _value(self, raw: Any, path: tuple) -> Any:
        if isinstance(raw, dict):
            out: Any = {k: self.node((*path, k)) for k in raw}
        elif isinstance(raw, list):
            out = [self.node((*path, i)) for i in range(len(raw))]
        elif _interpolated(raw):
            out = self._text(raw, path)
        else:
            return raw
        if self.size(out) > (MAX_CHARS if isinstance(out, str) else MAX_TOTAL_CHARS):
            raise ConfigError(
                f"'{_key(path)}': interpolations there build a value of {self.size(out)} characters, "
                f"more than a config holds ({MAX_CHARS} a value, {MAX_TOTAL_CHARS} in all); refer to "
                f"fewer values"
            )
        return out

    def _text(self, raw: str, path: tuple) -> Any:
        if path in self.active:
            loop = " -> ".join(_key(p) for p in self.active[self.active.index(path) :])
            raise ConfigError(f"'{_key(path)}': interpolations go round ({loop} -> {_key(path)}); break the loop")
        if len(self.active) >= MAX_DEPTH:
            raise ConfigError(
                f"'{_key(self.active[0])}': interpolations refer through more than {MAX_DEPTH} "
                f"keys (to '{_key(path)}'); write the value out"
            )
        self.active.append(path)
        try:
            return self.visit(_parsed(raw, f"'{_key(path)}'"), path)
        finally:
            self.active.pop()

    def visit(self, tree: Any, path: tuple) -> Any:
        """The parse tree's value at ``path``; the values it takes in are counted as they come, so
        text joined from them stops at ``MAX_CHARS`` before it is built."""
        taken = [0]

        def counted(value: Any) -> Any:
            taken[0] += self.size(value)
            if taken[0] > MAX_CHARS:
                raise ConfigError(
                    f"'{_key(path)}': interpolations there take in over {MAX_CHARS} characters; refer to fewer values"
                )
            return value

        def on_node(key: Any, _memo: Any = None) -> Any:
            return counted(self.reference(path, key))

        def on_resolver(name: str, args: tuple, args_str: tuple) -> Any:
            return counted(self.call(path, name, args))

        return GrammarVisitor(
            node_interpolation_callback=on_node, resolver_interpolation_callback=on_resolver, memo=None
        ).visit(tree)

    def reference(self, here: tuple, key: Any, default: Any = None, has_default: bool = False) -> Any:
        """The resolved value that ``key`` (``a.b``, ``.sibling``, ``..uncle``) names from ``here``."""
        parts, dots = _key_parts(key)
        if dots > len(here):
            raise ConfigError(f"'{_key(here)}': interpolation {_raw_key(key)} goes above the config's top")
        target = (*here[: len(here) - dots], *parts) if dots else tuple(parts)
        try:
            return self.node(target)
        except KeyError:
            if has_default:
                return default
            if self.missing_ok:
                return "${" + _raw_key(key) + "}"
            raise ConfigError(
                f"'{_key(here)}': interpolation {_raw_key(key)}: no key {_key(target)} in the config"
            ) from None

    def call(self, here: tuple, name: str, args: tuple) -> Any:
        resolver = _RESOLVERS.get(name) if name in USER_RESOLVERS else None
        if resolver is None:
            raise ConfigError(
                f"'{_key(here)}': unknown or refused resolver {name} (flash configs take {', '.join(USER_RESOLVERS)})"
            )
        return resolver(self, here, args)

    def size(self, value: Any) -> int:
        """Characters of ``value`` written out (roughly: the text, the keys, a few per scalar)."""
        if isinstance(value, str):
            return len(value)
        if not isinstance(value, (dict, list)):
            return 8
        if id(value) not in self.sizes:  # the value is kept with its size: its id stays its own
            items = value.items() if isinstance(value, dict) else enumerate(value)
            self.sizes[id(value)] = (sum(len(str(k)) + 2 + self.size(v) for k, v in items), value)
        return self.sizes[id(value)][0]


def _interpolated(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _child(obj: Any, part: Any, path: tuple) -> Any:
    """``obj[part]`` (a list's index from its text), or KeyError."""
    if isinstance(obj, dict):
        if part in obj:
            return obj[part]
        if isinstance(part, str) and part.lstrip("-").isdigit() and int(part) in obj:
            return obj[int(part)]
    elif isinstance(obj, list) and str(part).isdigit() and int(part) < len(obj):
        return obj[int(part)]
    raise KeyError(_key(path))


def _key_parts(key: Any) -> tuple[tuple, int]:
    """(the key's parts, its leading dots) from the grammar's key (an object with ``parts`` and
    ``relative_dots``) or a dotted string (``oc.select``'s argument)."""
    if hasattr(key, "parts"):
        return tuple(key.parts), int(key.relative_dots)
    text = str(key)
    dots = len(text) - len(text.lstrip("."))
    rest = text[dots:]
    return (tuple(rest.split(".")) if rest else ()), dots


def _raw_key(key: Any) -> str:
    return str(getattr(key, "raw", key))


def _env(res: _Resolution, here: tuple, args: tuple) -> Any:
    if res.missing_ok:  # one file bounded alone: the variable is read when the config is built
        return "${oc.env:" + ",".join(map(str, args)) + "}"
    if not args or not isinstance(args[0], str):
        raise ConfigError(
            f"'{_key(here)}': oc.env takes a variable's name (${{oc.env:VAR}} or ${{oc.env:VAR,default}})"
        )
    if args[0] in os.environ:
        return os.environ[args[0]]
    if len(args) > 1:
        return None if args[1] is None else str(args[1])
    raise ConfigError(
        f"'{_key(here)}': the environment variable {args[0]} is not set (give a default: ${{oc.env:{args[0]},default}})"
    )


def _select(res: _Resolution, here: tuple, args: tuple) -> Any:
    if not args:
        raise ConfigError(f"'{_key(here)}': oc.select takes a key (${{oc.select:key,default}})")
    return res.reference(here, args[0], args[1] if len(args) > 1 else None, has_default=len(args) > 1)


def _mapping(res: _Resolution, here: tuple, args: tuple) -> dict:
    found = res.reference(here, args[0]) if args else None
    if not isinstance(found, dict) and res.missing_ok:
        return {}
    if not isinstance(found, dict):
        raise ConfigError(f"'{_key(here)}': oc.dict.keys / oc.dict.values take the key of a mapping")
    return found


def _decode(res: _Resolution, here: tuple, args: tuple) -> Any:
    if not args or args[0] is None:
        return None
    if not isinstance(args[0], str):
        raise ConfigError(f"'{_key(here)}': oc.decode takes a string")
    return res.visit(_parsed(args[0], f"'{_key(here)}'", "singleElement", "VALUE_MODE"), here)


_RESOLVERS: dict[str, Callable[[_Resolution, tuple, tuple], Any]] = {
    "oc.env": _env,
    "oc.select": _select,
    "oc.decode": _decode,
    "oc.dict.keys": lambda res, here, args: list(_mapping(res, here, args)),
    "oc.dict.values": lambda res, here, args: list(_mapping(res, here, args).values()),
}
