"""Off-policy losses and advantage estimators, each a registry entry looked up by name.

Losses (``resolve_loss`` once, or ``policy_loss``): vanilla, ppo, decoupled_ppo, tis, cispo, topr, gspo; every loss also
takes the ``kl_coef`` / ``kl_estimator`` / ``entropy_coef`` add-ons. Aggregations: token-mean,
seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm (``max_len``).
Estimators (``compute_advantages``): grpo, dr_grpo, rloo, reinforce_pp (alias reinforce++), gae;
every estimator also takes ``whiten`` and ``clip``.
Corrections (``flash.algos.corrections``, passed as ``corrections=[...]``): token_is, seq_is, geo_is,
icepop, m2po; they weight and mask tokens by pi_prox/pi_behav before any loss aggregates.
Each loss declares the policy ratios it uses (``flash.algos.offpolicy``); ``ratio_problem`` is the rule
that refuses a ratio a setting makes identically 1, ``mismatch_metrics`` the one measure of how
far prox is from behav. Metrics are tagged with how they combine over micro-batches and ranks
(``flash.algos.metrics``: mean, max, min, sum) and read on the host once per optimizer step.

Plugins: ``@register_loss`` / ``@register_advantage`` / ``@register_correction`` in a user module
named to ``load_plugins``, or a ``flash.losses`` / ``flash.advantages`` / ``flash.corrections``
entry point (loaded on first lookup). ``registry``
holds the one ``Registry`` type that rewards, tasks and environments use too.

A leaf: imports nothing of the project; every layer above may import it.
"""

from .aggregate import AGGREGATIONS, aggregate, masked_mean
from .corrections import CORRECTIONS, apply_corrections, describe_corrections, register_correction, validate_corrections
from .metrics import Metric, StepMetrics
from .offpolicy import POLICIES, Ratio, mismatch_metrics, ratio_problem, reads, same_policies
from .policy import (
    ADDON_KNOBS,
    LOSSES,
    LossFn,
    LossInputs,
    describe_aggregations,
    describe_losses,
    kl_coef,
    kl_penalty,
    loss_ratios,
    policy_loss,
    register_loss,
    resolve_loss,
    validate_loss,
)
from . import losses as _builtin_losses  # noqa: F401  (registers the built-in losses)
from .advantages import (
    ADV_ADDON_KNOBS,
    ADVANTAGES,
    AdvantageInputs,
    compute_advantages,
    describe_advantages,
    gae_advantages_and_returns,
    gae_returns,
    register_advantage,
    validate_advantage,
)
from .value import value_loss
from .registry import Registry, load_plugins

__all__ = [
    "gae_returns",
    "CORRECTIONS",
    "LossFn",
    "Metric",
    "POLICIES",
    "Ratio",
    "StepMetrics",
    "mismatch_metrics",
    "resolve_loss",
    "apply_corrections",
    "describe_corrections",
    "loss_ratios",
    "ratio_problem",
    "reads",
    "register_correction",
    "same_policies",
    "validate_corrections",
    "AGGREGATIONS",
    "ADDON_KNOBS",
    "ADV_ADDON_KNOBS",
    "ADVANTAGES",
    "AdvantageInputs",
    "LOSSES",
    "LossInputs",
    "Registry",
    "aggregate",
    "compute_advantages",
    "describe_advantages",
    "describe_aggregations",
    "describe_losses",
    "gae_advantages_and_returns",
    "kl_coef",
    "kl_penalty",
    "load_plugins",
    "masked_mean",
    "policy_loss",
    "register_advantage",
    "register_loss",
    "validate_advantage",
    "validate_loss",
    "value_loss",
]
