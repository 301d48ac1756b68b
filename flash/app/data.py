"""A recipe's data: the task it names, or the ``dataset`` task over its ``data.train`` files.

``task_section(cfg)`` is the one place that decides which task a run trains: a non-empty
``data.train`` makes it ``dataset`` with the ``data:`` keys as options; otherwise the recipe's
``task:`` block (a recipe built on another with ``base:`` keeps its base's ``task:``, unused once
``data.train`` is set). ``check_data`` runs at ``flash validate``: the files exist and parse, every named
column is there (a missing one names the closest that is), the template uses plain column names,
and the tiny model has demonstrations to warm start from. ``check_prompt_format`` runs once the
tokenizer is loaded: text prompts need a template (``data.template`` or a chat template) unless
the tokenizer is flash's character one.
"""

from __future__ import annotations

from flash.algos.registry import did_you_mean
from flash.errors import ConfigError

DATA_OPTIONS = (
    "train",
    "eval",
    "holdout",
    "prompt_key",
    "answer_key",
    "system_prompt",
    "template",
    "reward_key",
    "reward",
    "rewards",
    "sft_key",
    "shuffle",
)


def uses_dataset(cfg) -> bool:
    return bool(cfg.data.train)


def task_section(cfg) -> dict:
    """The task a run trains, as ``{"name": ..., **options}``. With ``reward.fn`` set, that reward
    owns the rows (the reward workers score them): it is the rows' reward, so a reference is
    checked as a math answer only when it is ``math``."""
    if not uses_dataset(cfg):
        return dict(cfg.task)
    options = {key: getattr(cfg.data, key) for key in DATA_OPTIONS}
    if cfg.reward.fn:
        options["reward"] = str(cfg.reward.fn.get("name"))
    options["rewards"] = dict(cfg.data.rewards)
    options["train"], options["eval"] = tuple(cfg.data.train), tuple(cfg.data.eval)
    return {"name": "dataset", "seed": cfg.seed, **options}


def reward_name(cfg) -> str:
    """How a run's reward is named where it fails: ``reward 'code'`` (``reward.fn``), a dataset's
    ``reward 'math'`` (``data.reward``; a ``data.reward_key`` row's own reward is named by the row),
    else ``the wordproblems task's reward``."""
    if cfg.reward.fn:
        return f"reward {str(cfg.reward.fn.get('name'))!r}"
    if uses_dataset(cfg):
        return f"reward {cfg.data.reward!r}"
    return f"the {cfg.task.get('name')} task's reward"


def build_task(cfg):
    """The run's task object (``flash.recipes.tasks.make_task`` on ``task_section``)."""
    from flash.recipes.tasks import make_task

    section = task_section(cfg)
    try:
        return make_task(section.pop("name"), **section)
    except ValueError as exc:
        raise ConfigError(f"{'data' if uses_dataset(cfg) else 'task'}: {exc}") from None


def check_data(cfg) -> None:
    """ConfigError for a ``data:`` block that cannot run (see the module docstring)."""
    d = cfg.data
    if not uses_dataset(cfg):
        return
    if d.epochs < 0 or d.holdout < 0:
        raise ConfigError(f"data.epochs and data.holdout must be >= 0, got {d.epochs} and {d.holdout}")
    if d.template is not None:
        from flash.data.rows import template_fields

        try:
            template_fields(d.template)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if not (cfg.model.path or cfg.model.gguf) and cfg.sft.steps > 0 and not d.sft_key:
        raise ConfigError(
            "the tiny model warm-starts from demonstrations: set data.sft_key to a column "
            "holding them, or start from a model with model.path (or sft.steps=0)"
        )
    _check_data_rewards(d)
    task = build_task(cfg)
    _check_columns(cfg, task.columns("train"), d.train[0])
    if d.eval:
        _check_columns(cfg, task.columns("eval"), d.eval[0], needs_sft=False)


def _check_data_rewards(d) -> None:
    """``data.reward`` and each ``data.rewards`` target name a reward that exists (the recipe names
    them, so an import path is imported here); ``data.rewards`` needs a column to choose among them."""
    from flash.rewards.registry import validate_reward

    if d.rewards and d.reward_key is None and d.reward not in d.rewards:
        raise ConfigError(
            "data.rewards lists the rewards a data.reward_key column may name: set data.reward_key "
            "to that column, or drop data.rewards"
        )
    named = {f"data.rewards.{name}": target for name, target in d.rewards.items()}
    if d.reward not in d.rewards:
        named["data.reward"] = d.reward
    for key, target in named.items():
        try:
            validate_reward({"name": target})
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None


def _check_columns(cfg, columns: list[str], where: str, needs_sft: bool = True) -> None:
    from flash.data.rows import template_fields

    d = cfg.data
    named = {
        "data.answer_key": d.answer_key,
        "data.reward_key": d.reward_key,
        "data.sft_key": d.sft_key if needs_sft else None,
    }
    if d.template:
        named.update({f"data.template field {{{f}}}": f for f in template_fields(d.template)})
    else:
        named["data.prompt_key"] = d.prompt_key
    for key, column in named.items():
        if column is not None and column not in columns:
            raise ConfigError(
                f"{key}: {where} has no column {column!r}{did_you_mean(column, columns, n=1)} "
                f"(columns: {', '.join(columns)})"
            )


def check_prompt_format(cfg, task, tokenizer) -> None:
    """A dataset of text prompts on a tokenizer with neither a chat template nor ``data.template``
    would feed the model bare text it was never tuned on, and chat prompts need a chat template:
    refuse either with the fix, before any row is skipped for it."""
    from flash.data.rows import BadRow
    from flash.chat_encoding import SpecialTokenInText
    from flash.models import encode_prompt, is_tiny_tokenizer

    if not uses_dataset(cfg):
        return
    if not (tokenizer.chat_template or is_tiny_tokenizer(tokenizer) or cfg.data.template):
        raise ConfigError(
            "the tokenizer has no chat template and data.template is unset: set "
            "data.template (e.g. 'Question: {question}\\nAnswer:') or model.chat_template"
        )
    for index in range(min(task.rows_per_epoch, 16)):  # the first good row shows the format works
        try:
            item = task.item(index)
        except BadRow:
            continue
        try:
            encode_prompt(tokenizer, item.prompt)
        except SpecialTokenInText:  # the row's own fault: the input guard skips it
            continue
        except ValueError as exc:
            raise ConfigError(f"data: the first prompts cannot be tokenized: {exc}") from None
        return


def load_tokenizer(cfg, model_path: str):
    """The policy's tokenizer, with ``model.chat_template`` in place of its own when set."""
    from transformers import AutoTokenizer

    return with_chat_template(cfg, AutoTokenizer.from_pretrained(model_path))


def with_chat_template(cfg, tokenizer):
    """``tokenizer`` with ``model.chat_template`` (a template, or a file holding one) set, if any."""
    from flash.models import set_chat_template

    try:
        set_chat_template(tokenizer, cfg.model.chat_template)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    return tokenizer


def data_steps(cfg, task) -> int:
    """``train.steps``, or fewer when ``data.epochs`` passes over the rows end the run first."""
    if not (uses_dataset(cfg) and cfg.data.epochs):
        return cfg.train.steps
    rows = cfg.data.epochs * task.rows_per_epoch
    return max(1, min(cfg.train.steps, rows // cfg.train.prompts_per_step))


def build_source(task, tokenizer, guard=None, reward=None):
    """The task's prompt stream as the scheduler takes it (``PromptSource``). ``guard``: the input
    guard prompts are taken through; ``reward``: a RewardPool's ``reward_fn()``; unset: the task's
    own reward."""
    from flash.controllers.scheduler import PromptSource
    from flash.models import decode_response, encode_prompt

    return PromptSource(
        item=lambda i: task.item(i, split="train"),
        encode=lambda text: encode_prompt(tokenizer, text),
        decode=lambda ids: decode_response(tokenizer, ids),
        reward=reward or task.reward,
        guard=guard,
    )


def max_prompt_tokens(cfg, model_path: str) -> int:
    """``data.max_prompt_tokens``, or the model's context minus the response budget."""
    if cfg.data.max_prompt_tokens:
        return cfg.data.max_prompt_tokens
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_path).get_text_config(decoder=True)
    return max(1, text.max_position_embeddings - cfg.rollout.max_new_tokens)
