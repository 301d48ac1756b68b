"""What counts as a reward: one check for everything that produces or receives one.

A reward is a finite real number: ``int``, ``float``, ``fractions.Fraction`` and NumPy's integer
and floating scalars (``np.float32``, ``np.int64``, ...): every ``numbers.Real``. It is refused
(``BadReward``) when it is

- not a real number: ``bool`` (a verdict, not a score: write ``float(ok)``), ``str``, ``None``,
  ``decimal.Decimal`` (not a ``numbers.Real``), containers, and arrays and tensors even of 0 dims
  (``.item()`` makes one a number);
- NaN or infinite, or too large for a float: one such reward makes its group's advantages, and so
  the step's loss, NaN.

Every producer runs ``reward_value`` and meets a refusal as ``BadReward`` (its message says what
was returned); each then goes on in its own way (docs/design.md): a reward function's call scores
0.0 and is counted (``reward_errors`` in the driver, ``reward/failures/error:BadReward`` in the
reward pool), an environment step ends its episode (``env_error``), an agent run fails
(``bad_return``), and a sample received from outside is refused (``bad_value`` on the wire, an
error naming the file for a schedule).

``error_text`` is how a reward's failure is named in one line (its type and message, bounded), in
the reward workers' results and in the line that stops a run whose reward keeps failing;
``RewardRaised`` carries a failure met elsewhere (a reward worker) to the scheduler that counts it.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


ERROR_CHARS = 300  # the most of a reward's error text kept (a traceback's message can be long)


class BadReward(ValueError):
    """A value that is not a finite real number, met where a reward was expected."""


class RewardRaised(Exception):
    """A reward call that failed where it ran (a reward worker); its message is ``error_text``'s."""


def error_text(exc: BaseException) -> str:
    """``NameError: name 'x' is not defined``: a reward's failure on one line, at most
    ``ERROR_CHARS`` characters (a ``RewardRaised`` is the text it carries)."""
    text = str(exc) if isinstance(exc, RewardRaised) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    return text if len(text) <= ERROR_CHARS else text[: ERROR_CHARS - 3] + "..."


def reward_value(value: Any) -> float:
    """``value`` as a reward (a float); ``BadReward`` when it is not one (module docstring)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise BadReward(f"a reward is a real number, not a {type(value).__name__} ({str(value)[:80]})")
    try:
        reward = float(value)
    except OverflowError:  # an int or Fraction beyond a float's range
        reward = math.inf
    if not math.isfinite(reward):
        raise BadReward(f"a reward is a finite number, not {str(value)[:80]}")
    return reward
