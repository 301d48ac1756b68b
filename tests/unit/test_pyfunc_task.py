"""The code recipe's task: specs, hidden tests, the precedence slip of the demonstrations, and the
sandboxed pass/fail reward (real sandbox processes: ~0.1 s each)."""

import pytest

from flash.models import DEFAULT_ALPHABET
from flash.recipes.tasks import make_task
from flash.recipes.tasks.pyfunc import (
    HEADER,
    apply_chain,
    expression,
    needs_parens,
    spec_split,
)


def chain_of(item):
    return [tuple(step) for step in item.meta["chain"]]


def test_reference_semantics_and_the_precedence_bug():
    chain = [("add", 2), ("mul", 3), ("mod", 5)]
    assert expression(chain) == "(x+2)*3%5" and expression(chain, parens=False) == "x+2*3%5"
    assert apply_chain(chain, 4) == (4 + 2) * 3 % 5 == 3
    assert needs_parens(chain) and not needs_parens([("mul", 3), ("add", 1), ("sub", 2)])
    assert expression([("mul", 2), ("add", 1), ("mod", 4)]) == "(x*2+1)%4"
    assert expression([("add", 1), ("mul", 2), ("add", 3), ("mul", 4)]) == "((x+1)*2+3)*4"


def test_hidden_tests_match_the_solution_for_every_item():
    """The expected outputs come from applying the chain step by step; the solution string, as
    Python, must agree on every input (our own generated code, evaluated here on purpose)."""
    task = make_task("pyfunc")
    for i in range(300):
        item = task.item(i)
        f = eval("lambda x: " + item.answer[len(HEADER) :])
        assert all(f(*t["input"]) == t["output"] for t in item.meta["tests"])
        assert len({t["input"][0] for t in item.meta["tests"]}) == 6
        assert set(item.prompt + item.answer) <= set(DEFAULT_ALPHABET)
        assert len(item.answer) + 1 <= task.max_response_tokens()
        assert item.meta["family"] == f"ops{len(item.meta['chain'])}"


def test_items_are_deterministic_and_held_out_specs_are_never_trained_on():
    task = make_task("pyfunc")
    assert task.item(5) == task.item(5) and task.item(5) != task.item(5, "eval")
    train = {task.item(i).prompt for i in range(2000)}
    evals = {task.item(i, "eval").prompt for i in range(500)}
    assert not train & evals and len(evals) > 250
    assert all(spec_split(chain_of(task.item(i, "eval"))) == "eval" for i in range(100))


def test_demonstrations_drop_needed_parentheses_at_the_slip_rate():
    task = make_task("pyfunc")
    n = 2000
    items = [task.item(i) for i in range(n)]
    share = sum(it.meta["needs_parens"] for it in items) / n
    assert share == pytest.approx(0.9 + 0.1 * 0.375 * 0.5, abs=0.02)  # forced + natural (2-3 ops)
    slips = []
    for i, it in enumerate(items):
        prompt, response = task.sft_pair(i)
        assert prompt == it.prompt
        bug = HEADER + expression(chain_of(it), parens=False)
        if not it.meta["needs_parens"]:
            assert response == it.answer == bug
        else:
            assert response in (it.answer, bug) and it.answer != bug
            slips.append(response == bug)
    assert sum(slips) / len(slips) == pytest.approx(0.75, abs=0.03)
    clean = make_task("pyfunc", paren_slip=0.0)
    assert all(clean.sft_pair(i)[1] == clean.item(i).answer for i in range(50))


def test_reward_runs_hidden_tests_in_the_sandbox():
    task = make_task("pyfunc")
    item = next(task.item(i) for i in range(50) if task.item(i).meta["needs_parens"])
    bug = HEADER + expression(chain_of(item), parens=False)
    assert task.reward(item, item.answer) == 1.0
    assert task.reward(item, bug) == 0.0
    assert task.reward(item, "def f(x) return x") == 0.0  # syntax error
    assert task.reward(item, "def g(x): return x") == 0.0  # wrong entry point
    looks_right = "import sys\nsys.stdout.write('0\\t1\\n1\\t1\\n')\ndef f(x): return 1"
    assert task.reward(item, looks_right) == 0.0 or all(t["output"] == 1 for t in item.meta["tests"])


def test_options_are_checked():
    with pytest.raises(ValueError, match="paren_slip"):
        make_task("pyfunc", paren_slp=0.5)
    with pytest.raises(ValueError, match="max_ops"):
        make_task("pyfunc", min_ops=3, max_ops=2)
    with pytest.raises(ValueError, match="num_tests"):
        make_task("pyfunc", num_tests=0)


def test_code_recipe_scores_with_the_adaptive_sandbox_timeout_by_default():
    """The reward scheduler: the adaptive timeout is on in the code recipe, and it is the
    default of the ``code`` reward itself (a recipe that names only ``{name: code}`` gets it)."""
    from flash.app.config import load_config
    from flash.rewards import build_reward

    cfg = load_config("recipes/code.yaml")
    scorer = build_reward(dict(cfg.reward.fn))
    assert scorer.adaptive and scorer.all_or_nothing
    assert build_reward({"name": "code"}).adaptive
    task = make_task(cfg.task["name"], **{k: v for k, v in cfg.task.items() if k != "name"})
    assert cfg.rollout.max_new_tokens >= task.max_response_tokens()
    item = task.item(0)
    assert scorer(item, item.answer) == 1.0
    fam = item.meta["family"]
    assert scorer.timeouts.timeout(fam) == max(1.0, 3.0 * scorer.timeouts.anchor(fam)) < 10.0
