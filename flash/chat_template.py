"""Chat templates rendered within a budget of time and size, whatever their source.

A chat template is data: it comes from a model folder (``tokenizer_config.json`` or
``chat_template.jinja``), a recipe's ``model.chat_template`` or a GGUF file's metadata, and Jinja's
sandbox (the one transformers renders with) keeps it from reaching Python objects but not from
looping for hours or building a string of gigabytes. ``render`` renders with the environment
transformers uses (the same options, globals and filters, so the text is ``apply_chat_template``'s
own) and these bounds, each ending the render with ``TemplateBudget`` (a ``ConfigError``: one line
naming the template's source and the bound, so ``flash validate`` and a run stop with it):

- the template's text: at most ``MAX_TEMPLATE_CHARS``; parsed and compiled without hitting Python's
  recursion limit;
- time: ``MAX_RENDER_SECONDS`` of wall clock, checked at every loop step, call, filter, operator and
  output;
- loop steps: ``MAX_LOOP_STEPS`` iterations of all its ``for`` loops together (``range`` is capped
  by Jinja's sandbox already);
- size: the rendered text and every value the template makes (a string, or a list counted with its
  items, shared ones at each place they appear) at most ``MAX_RENDER_CHARS`` characters, and all
  the values it makes in one render at most ``MAX_MADE_CHARS``. Operations that multiply their
  input (``*``, ``**``, ``%`` and ``format`` widths, ``replace``, ``join``, ``indent``, ``wordwrap``,
  ``expandtabs``, ``lipsum``, and any width or count argument) are checked before they run, so no
  step allocates past the bound.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from flash.errors import ConfigError

MAX_TEMPLATE_CHARS = 256 << 10  # a chat template's text (real ones are a few KB)
MAX_RENDER_SECONDS = 5.0  # one render (real ones take milliseconds)
MAX_LOOP_STEPS = 1_000_000  # iterations of all loops of one render
MAX_RENDER_CHARS = 32 << 20  # the rendered text, and any one value (twice data rows' 16 MiB bound)
MAX_MADE_CHARS = 128 << 20  # every value one render makes, together
_DIGITS = re.compile(r"\d+")


class TemplateBudget(ConfigError):
    """A chat template that went past one of the module's bounds (the message names which)."""

    reason = "template_budget"


@dataclass
class _Budget:
    source: Any  # the template's source, or a function giving it (asked only when a bound is hit)
    deadline: float
    steps: int = 0
    made: int = 0
    sizes: dict = field(default_factory=dict)  # id -> (value, size): containers, kept alive

    def over(self, what: str) -> TemplateBudget:
        source = self.source() if callable(self.source) else self.source
        return TemplateBudget(
            f"{source}: the chat template {what}; fix the template, or set model.chat_template "
            "to one that renders within the bounds (flash.chat_template)"
        )

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise self.over(f"ran past its time bound of {MAX_RENDER_SECONDS:g} s")

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_LOOP_STEPS:
            raise self.over(f"ran past its bound of {MAX_LOOP_STEPS:,} loop steps")
        self.tick()

    def size(self, value: Any) -> int:
        """Characters of ``value`` (a container: its items', at each place they appear), up to just
        past ``MAX_RENDER_CHARS``."""
        if isinstance(value, (str, bytes, range)):
            return len(value)
        if isinstance(value, (int, float, type(None))):
            return 1
        items = _items(value)
        if items is None:
            return 1
        known = self.sizes.get(id(value))
        if known is not None:
            return known[1]
        total = 1
        for item in items:
            total += self.size(item)
            if total > MAX_RENDER_CHARS:
                break
        self.sizes[id(value)] = (value, total)
        return total

    def check(self, value: Any, what: str) -> int:
        n = self.size(value)
        if n > MAX_RENDER_CHARS:
            raise self.over(f"makes {what} of over {MAX_RENDER_CHARS:,} characters (its bound)")
        return n

    def made_value(self, value: Any, inputs: tuple) -> Any:
        """``value``, counted in the render's total unless it is one of ``inputs``."""
        self.tick()
        n = self.check(value, "a value")
        if n > 1 and not any(value is x for x in inputs):
            self.made += n
            if self.made > MAX_MADE_CHARS:
                raise self.over(f"makes values of over {MAX_MADE_CHARS:,} characters in all (its bound)")
        return value


def _items(value: Any):
    """The items a container's text shows (a mapping: keys and values), or None for a scalar."""
    from jinja2.runtime import Namespace

    if isinstance(value, Namespace):
        value = object.__getattribute__(value, "_Namespace__attrs")
    if isinstance(value, dict):
        return [x for kv in value.items() for x in kv]
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    from collections.abc import MappingView

    return list(value) if isinstance(value, MappingView) else None


_local = threading.local()


def _budget() -> _Budget:
    """The render in progress on this thread (a fresh one while Jinja folds constants at compile)."""
    budget = getattr(_local, "budget", None)
    return budget if budget is not None else _Budget("a chat template", time.monotonic() + MAX_RENDER_SECONDS)


def _estimate(name: str, value: Any, args: tuple, kwargs: dict, budget: _Budget) -> int:
    """Characters the operation ``name`` on ``value`` may make, known before it runs (0: no more
    than its inputs and its width arguments, which are checked on their own)."""
    text = value if isinstance(value, str) else ""
    arg = list(args) + list(kwargs.values()) + [None, None]
    if name == "replace" and isinstance(arg[0], str) and isinstance(arg[1], str):
        n = text.count(arg[0]) if arg[0] else len(text) + 1
        if isinstance(arg[2], int) and arg[2] >= 0:
            n = min(n, arg[2])
        return len(text) + n * max(0, len(arg[1]) - len(arg[0]))
    if name == "indent":
        width = len(arg[0]) if isinstance(arg[0], str) else arg[0] if isinstance(arg[0], int) else 4
        return len(text) + (text.count("\n") + 1) * width
    if name == "expandtabs":
        return len(text) + text.count("\t") * (arg[0] if isinstance(arg[0], int) else 8)
    if name == "generate_lorem_ipsum":  # the lipsum global: n paragraphs of up to ``max`` words
        n, most = (arg[0] if isinstance(arg[0], int) else 5), kwargs.get("max", args[3] if len(args) > 3 else 100)
        return max(n, 0) * (most if isinstance(most, int) else 100) * 12
    if name == "wordwrap":
        wrap = kwargs.get("wrapstring") or (args[2] if len(args) > 2 else None)
        return len(text) * (1 + len(wrap)) if isinstance(wrap, str) else 0
    if name in ("format", "format_map", "%"):
        return max((int(d) for d in _DIGITS.findall(text) if len(d) < 12), default=0) * (1 + len(args))
    return 0


def _join_estimate(sep: Any, items: Any, budget: _Budget) -> tuple[int, Any]:
    """(characters ``sep.join(items)`` makes, the items as a list when they came as an iterator)."""
    if not hasattr(items, "__len__"):
        listed = []
        for item in items:
            budget.step()
            listed.append(item)
        items = listed
    sep_len = len(sep) if isinstance(sep, str) else 0
    return budget.size(items) + len(items) * sep_len, items


def checked_call(name: str, fn, value: Any, args: tuple, kwargs: dict, own: bool = False):
    """``fn(*args, **kwargs)`` after the bounds' checks of the arguments and the estimate of what
    ``name`` makes from ``value`` (``args[0]`` when ``own``: a filter's); its result checked and
    counted."""
    budget = _budget()
    budget.tick()
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_RENDER_CHARS:
            raise budget.over(f"asks for a width or count of {str(a)[:20]}, over {MAX_RENDER_CHARS:,}")
        budget.check(a, "an argument")
    if name == "join" and args:
        items = args[0]
        sep = (args[1] if len(args) > 1 else kwargs.get("d", "")) if own else value
        n, listed = _join_estimate(sep, items, budget)
        args = (listed, *args[1:])
    else:
        n = _estimate(name, value, args[1:] if own else args, kwargs, budget)
    if n > MAX_RENDER_CHARS:
        raise budget.over(
            f"would make a value of about {n:,} characters with {name}, over its bound of {MAX_RENDER_CHARS:,}"
        )
    return budget.made_value(fn(*args, **kwargs), (value, *args))


def _bounded_filter(name: str, fn):
    """A Jinja filter under ``checked_call`` (its pass-context arguments left out of the checks)."""
    from jinja2.utils import _PassArg

    skip = 1 if _PassArg.from_obj(fn) is not None else 0

    @functools.wraps(fn)
    def bounded(*args, **kwargs):
        lead, rest = args[:skip], args[skip:]
        value = rest[0] if rest else None
        return checked_call(name, lambda *a, **k: fn(*lead, *a, **k), value, rest, kwargs, own=True)

    return bounded


def _loop(iterable):
    budget = _budget()
    for item in iterable:
        budget.step()
        yield item


def _sized(value):
    _budget().check(value, "a value")
    return value


def _made(value):
    return _budget().made_value(value, ())


def _finalize(value):
    budget = _budget()
    budget.tick()
    budget.check(value, "an output")
    return value


def _binop_estimate(operator: str, left: Any, right: Any, budget: _Budget) -> int:
    if operator == "*":
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(n, int) and isinstance(seq, (str, list, tuple)):
            return budget.size(seq) * max(0, n)
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        return left.bit_length() * right // 8  # bytes of the power
    if operator == "+" and isinstance(left, (str, list, tuple)):
        return budget.size(left) + budget.size(right)
    if operator == "%" and isinstance(left, str):
        return _estimate("%", left, right if isinstance(right, tuple) else (right,), {}, budget)
    return 0


def _bounds_class():
    """The pass over a parsed template that wraps its loops, ``~`` and comparisons in the module's
    filters (built on first use: Jinja is imported only when a template renders)."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def wrap(node, name: str):
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    class Bounds(NodeTransformer):
        """Loops step the budget; a ``~`` checks its operands and counts its result; a comparison
        checks its operands (comparing nested lists is as slow as their size)."""

        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = wrap(node.iter, "flash_loop")
            return node

        def visit_Concat(self, node):
            self.generic_visit(node)
            node.nodes = [wrap(n, "flash_sized") for n in node.nodes]
            return wrap(node, "flash_made")

        def visit_Compare(self, node):
            self.generic_visit(node)
            node.expr = wrap(node.expr, "flash_sized")
            for op in node.ops:
                op.expr = wrap(op.expr, "flash_sized")
            return node

    return Bounds


def _environment_class():
    """The sandbox of transformers' chat templates with the module's bounds (built on first use:
    Jinja is imported only when a template renders)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    Bounds = _bounds_class()

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call(self, context, obj, *args, **kwargs):  # type: ignore[override]
            owner = getattr(getattr(obj, "__wrapped__", obj), "__self__", None)  # str.format: a wrapper
            name = getattr(obj, "__name__", "")
            parent = super()
            return checked_call(
                name,
                lambda *a, **k: parent.call(context, obj, *a, **k),
                owner if isinstance(owner, str) else None,
                args,
                kwargs,
            )

        def call_binop(self, context, operator, left, right):
            budget = _budget()
            budget.tick()
            budget.check(left, "an operand")
            budget.check(right, "an operand")
            n = _binop_estimate(operator, left, right, budget)
            if n > MAX_RENDER_CHARS:
                raise budget.over(
                    f"would make a value of about {n:,} characters with {operator!r}, over its "
                    f"bound of {MAX_RENDER_CHARS:,}"
                )
            return budget.made_value(super().call_binop(context, operator, left, right), (left, right))

        def _parse(self, source, name, filename):
            return Bounds().visit(super()._parse(source, name, filename))

    return BoundedEnvironment


@functools.lru_cache(maxsize=1)
def _environment():
    """One environment as transformers builds it (trim_blocks, lstrip_blocks, loop controls, its
    ``tojson``, ``raise_exception``, ``strftime_now``, the ``{% generation %}`` tag), bounded."""
    from transformers.utils.chat_template_utils import _cached_compile_jinja_template

    theirs = _cached_compile_jinja_template("").environment
    env = _environment_class()(
        trim_blocks=True,
        lstrip_blocks=True,
        finalize=_finalize,
        extensions=[type(e) for e in theirs.extensions.values()],
    )
    env.globals.update({k: v for k, v in theirs.globals.items() if k in ("raise_exception", "strftime_now")})
    filters = {**env.filters, "tojson": theirs.filters["tojson"]}
    env.filters = {name: _bounded_filter(name, fn) for name, fn in filters.items()}
    env.filters.update(flash_loop=_loop, flash_sized=_sized, flash_made=_made)
    return env


@functools.lru_cache(maxsize=32)
def _compiled(template: str):
    return _environment().from_string(template)


def render(template: str, source: Any, **context: Any) -> str:
    """``template`` rendered with ``context`` within the module's bounds; ``TemplateBudget``
    naming ``source`` (e.g. "model.chat_template", or a function giving it) past any of them."""
    budget = _Budget(source, time.monotonic() + MAX_RENDER_SECONDS)
    if len(template) > MAX_TEMPLATE_CHARS:
        raise budget.over(f"is {len(template):,} characters, over its bound of {MAX_TEMPLATE_CHARS:,}")
    previous = getattr(_local, "budget", None)
    try:
        compiled = _compiled(template)
        budget.deadline = time.monotonic() + MAX_RENDER_SECONDS  # compiling is bounded by the text's size
        _local.budget = budget
        out, n = [], 0
        for chunk in compiled.generate(**context):
            n += len(chunk)
            if n > MAX_RENDER_CHARS:
                raise budget.over(f"renders over {MAX_RENDER_CHARS:,} characters (its bound)")
            budget.tick()
            out.append(chunk)
        return "".join(out)
    except RecursionError:
        raise budget.over("nests or recurses deeper than Python's recursion limit") from None
    except MemoryError:
        raise budget.over("ran out of memory") from None
    finally:
        _local.budget = previous


def mark_source(tokenizer: Any, source: str) -> None:
    """Name where ``tokenizer``'s current chat template came from (for ``TemplateBudget``)."""
    tokenizer.flash_template_source = (tokenizer.chat_template, source)


def template_source(tokenizer: Any) -> str:
    """Where the tokenizer's chat template came from: as ``mark_source`` named it, else its model
    folder's file (a GGUF file's, for a folder ``flash.gguf`` converted)."""
    marked = getattr(tokenizer, "flash_template_source", None)
    if marked is not None and marked[0] == tokenizer.chat_template:
        return marked[1]
    import json
    from pathlib import Path

    name = getattr(tokenizer, "name_or_path", "") or ""
    folder = Path(name)
    if not name or not folder.is_dir():
        return "the tokenizer's chat template"
    try:
        gguf = json.loads((folder / "flash_gguf.json").read_text())["source"]
        return f"the GGUF file {gguf}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    jinja = folder / "chat_template.jinja"
    return str(jinja if jinja.is_file() else folder / "tokenizer_config.json")


def render_chat(tokenizer: Any, messages: list, tools: list | None = None, generation: bool = True) -> str:
    """``tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation,
    tokenize=False)``, rendered within the module's bounds."""
    template = tokenizer.get_chat_template(None, tools)
    return render(
        template,
        lambda: template_source(tokenizer),
        messages=messages,
        tools=tools,
        documents=None,
        add_generation_prompt=generation,
        **tokenizer.special_tokens_map,
    )
