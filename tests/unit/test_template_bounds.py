"""Chat templates render within bounds of time, loop steps and size, whatever their source (a model
folder's file, ``model.chat_template``, a converted GGUF file's folder): a template that loops for
minutes or builds a string of gigabytes ends in one line (``TemplateBudget``, a ``ConfigError``)
naming its source and the bound, and stops a run instead of being skipped row after row. A template
within the bounds renders exactly what transformers' ``apply_chat_template`` renders."""

from __future__ import annotations

import json
import time

import pytest
from transformers import AutoTokenizer

from flash import chat_template as ct
from flash.chat_template import TemplateBudget, render, render_chat, template_source
from flash.guards import InputGuard
from flash.models import build_tokenizer, encode_prompt, set_chat_template
from flash.tasks import TaskItem

LOOPS = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
CHAT = [{"role": "user", "content": "what is 2 plus 2?"}]


def budget_line(fn, *args) -> str:
    with pytest.raises(TemplateBudget) as err:
        fn(*args)
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text and len(text) < 400
    return text


def folder_tokenizer(tmp_path, template: str, gguf: str | None = None):
    """A model folder's tokenizer holding ``template`` (a converted GGUF's when ``gguf`` names one)."""
    tok = build_tokenizer()
    tok.chat_template = template
    tok.save_pretrained(tmp_path)
    if gguf:
        (tmp_path / "flash_gguf.json").write_text(json.dumps({"source": gguf, "parameters": 1}))
    return AutoTokenizer.from_pretrained(tmp_path)


def test_an_endless_loop_ends_at_the_step_bound_naming_each_source(tmp_path, monkeypatch):
    monkeypatch.setattr(ct, "MAX_LOOP_STEPS", 50_000)
    recipe = build_tokenizer()
    set_chat_template(recipe, LOOPS)
    (tmp_path / "t.jinja").write_text(LOOPS)
    recipe_file = build_tokenizer()
    set_chat_template(recipe_file, str(tmp_path / "t.jinja"))
    folder = folder_tokenizer(tmp_path / "m", LOOPS)
    gguf = folder_tokenizer(tmp_path / "g", LOOPS, gguf="/models/evil.gguf")
    for tok, source in (
        (recipe, "model.chat_template: "),
        (recipe_file, f"model.chat_template ({tmp_path}/t.jinja): "),
        (folder, f"{tmp_path}/m/chat_template.jinja: "),
        (gguf, "the GGUF file /models/evil.gguf: "),
    ):
        start = time.monotonic()
        line = budget_line(encode_prompt, tok, CHAT)
        assert line.startswith(source) and "its bound of 50,000 loop steps" in line, line
        assert time.monotonic() - start < 1.5


def test_a_slow_template_ends_at_the_time_bound(monkeypatch):
    monkeypatch.setattr(ct, "MAX_RENDER_SECONDS", 0.2)
    monkeypatch.setattr(ct, "MAX_LOOP_STEPS", 10**12)
    start = time.monotonic()
    line = budget_line(render, LOOPS, "a test template")
    assert line.startswith("a test template: the chat template ran past its time bound of 0.2 s")
    assert 0.2 <= time.monotonic() - start < 1.0


@pytest.mark.parametrize(
    "template, words",
    [
        ("{{ 'a' * 10**10 }}", "about 10,000,000,000 characters with '*'"),
        ("{{ 7 ** (10 ** 10) }}", "about 3,750,000,000 characters with '**'"),
        (
            "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "makes a value of over 1,048,576 characters",
        ),
        ("{{ 'x'|center(10**9) }}", "a width or count of 1000000000"),
        ("{{ 'x'.ljust(10**9) }}", "a width or count of 1000000000"),
        ("{{ '{:>999999999}'.format(1) }}", "with format"),
        ("{{ '%999999999d' % 1 }}", "with '%'"),
        ("{{ '%s'|format(1) ~ ('{:>99999999}'|format(2)) }}", "with format"),
        ("{{ ('a' * 100000)|replace('a', 'b' * 1000) }}", "about 100,000,000 characters with replace"),
        ("{{ ('\n' * 100000)|indent('x' * 1000) }}", "with indent"),
        ("{{ ('\n' * 100000)|indent(1000) }}", "with indent"),
        ("{{ ('\t' * 1000).expandtabs(1000000) }}", "about 1,000,001,000 characters with expandtabs"),
        ("{{ lipsum(1000000) }}", "with generate_lorem_ipsum"),
        ("{{ range(1000)|join('x' * 100000) }}", "with join"),
        ("{{ ('x' * 100000).join(range(1000)|list) }}", "with join"),
        ("{% set l = ['a' * 1000] * 1000 %}{% set m = [l] * 1000 %}{{ m|tojson }}", "with '*'"),
        ("{% set l = ['a' * 1000] * 1000 %}{% set m = [l, l] %}{{ m == m }}", "makes a value of over 1,048,576"),
        ("{% for i in range(10000) %}{{ 'a' * 1000 }}{% endfor %}", "renders over 1,048,576 characters"),
        (
            "{% for i in range(1000) %}{% set x = 'a' * 1000000 %}{% endfor %}",
            "values of over 8,388,608 characters in all",
        ),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recurses deeper than Python's recursion limit"),
        ("{{ x }}" * 20000, "is 140,000 characters, over its bound of 65,536"),
    ],
)
def test_a_template_that_builds_a_huge_value_stops_before_it_is_built(template, words, monkeypatch):
    monkeypatch.setattr(ct, "MAX_RENDER_CHARS", 1 << 20)
    monkeypatch.setattr(ct, "MAX_MADE_CHARS", 8 << 20)
    monkeypatch.setattr(ct, "MAX_TEMPLATE_CHARS", 64 << 10)
    ct._compiled.cache_clear()
    start = time.monotonic()
    line = budget_line(render, template, "model.chat_template")
    assert line.startswith("model.chat_template: the chat template ") and words in line, line
    assert time.monotonic() - start < 1.5


def test_a_run_stops_on_the_template_instead_of_skipping_rows(monkeypatch):
    """The input guard skips a row that cannot be encoded (a ValueError); a template over its bounds
    is the template's fault, so it ends the run (the scheduler stops on a FlashError)."""
    monkeypatch.setattr(ct, "MAX_LOOP_STEPS", 10_000)
    tok = build_tokenizer()
    set_chat_template(tok, LOOPS)
    guard = InputGuard(max_prompt_tokens=0)
    with pytest.raises(TemplateBudget, match="model.chat_template: .* 10,000 loop steps"):
        guard.take(0, lambda i: TaskItem(index=i, prompt=CHAT, answer="4"), lambda p: encode_prompt(tok, p))
    assert guard.counts == {}


TOOLS_TEMPLATE = (
    "{% if tools %}{% for t in tools %}{{ t|tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m.role == 'system' and not loop.first %}{{ raise_exception('system first') }}"
    "{% endif %}{% if loop.index > 5 %}{% break %}{% endif %}<|{{ m.role }}|>"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content|trim }}{% endgeneration %}{% else %}"
    "{{ m.content|replace('  ', ' ')|center(30) }}{% endif %}{{ eos_token }}{% endfor %}"
    "{{ '%-6s|' % 'x' }}{{ '{:>4}'.format(7) }}{{ (messages|map(attribute='role')|join(','))|upper }}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize("generation", [True, False])
def test_a_template_within_the_bounds_renders_as_transformers_does(generation):
    tok = build_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "be  brief"},
        {"role": "user", "content": "2  plus 2"},
        {"role": "assistant", "content": " 4 "},
        {"role": "user", "content": "and 3?"},
    ]
    ours = render_chat(tok, messages, tools, generation)
    assert ours == tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, tokenize=False)
    assert ours.endswith("SYSTEM,USER,ASSISTANT,USER" + ("<|assistant|>" if generation else ""))
    assert "x     |   7" in ours and "<|assistant|>4<eos>" in ours
    with pytest.raises(Exception, match="system first"):
        render_chat(tok, messages + [{"role": "system", "content": "late"}], None, generation)


def test_the_source_of_a_template_replaced_later_is_not_the_recipe(tmp_path):
    tok = folder_tokenizer(tmp_path, "{{ messages[0].content }}")
    assert template_source(tok) == f"{tmp_path}/chat_template.jinja"
    set_chat_template(tok, "{{ 'x' }}{{ messages[0].content }}")
    assert template_source(tok) == "model.chat_template"
    tok.chat_template = "{{ 'y' }}"  # set by code (a task's own template): named by the folder again
    assert template_source(tok) == f"{tmp_path}/chat_template.jinja"
    assert template_source(build_tokenizer()) == "the tokenizer's chat template"
