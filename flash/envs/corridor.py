"""``corridor``: the native text game -- walk along a one-row corridor to the goal in few moves.

Example (``width = 8``)::

    observation   ..a....g:      the agent 'a' at cell 2, the goal 'g' at cell 7
    action        r              'l' or 'r': one cell left or right (a wall stops the agent)

The episode ends with reward 1.0 when the agent stands on the goal (outcome ``success``), or with
reward 0.0 once it has made ``distance + slack`` moves (``out_of_moves``), or at once on an action
that is not ``l``/``r`` (``invalid_action``). With ``slack = 1`` a single wrong move already loses
(it costs two moves to undo), so the game rewards a policy that never errs.

Why this game: a character-level tiny transformer learns it in a few hundred SFT steps (the
decision reads only the latest observation: is the goal right or left of the agent), while an
episode is genuinely multi-turn (``distance`` LLM turns, each followed by an environment step
whose observation the next turn must read). The demonstration policy (``expert_action``) is
perfect; the task makes its demonstrations noisy (``flash.envs.task``), so the warm-started policy
errs at the noise rate per move and RL has a clear, verifiable signal to remove it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from flash.envs.base import StepResult, invalid_action, register_env

AGENT, GOAL, FLOOR, END = "a", "g", ".", ":"


@dataclass(frozen=True)
class CorridorOptions:
    width: int = 8  # cells; observations are width + 1 characters
    slack: int = 1  # moves allowed beyond the distance to the goal

    def __post_init__(self) -> None:
        if self.width < 2:
            raise ValueError(f"width must be >= 2, got {self.width}")
        if self.slack < 0:
            raise ValueError(f"slack must be >= 0, got {self.slack}")


def render(width: int, agent: int, goal: int) -> str:
    """The observation: one character per cell, then ``:`` (where the policy's action follows)."""
    cells = [FLOOR] * width
    cells[goal], cells[agent] = GOAL, AGENT
    return "".join(cells) + END


def move(width: int, agent: int, action: str) -> int:
    """The agent's cell after ``action`` ('l' or 'r'); walls at both ends stop it."""
    return max(0, agent - 1) if action == "l" else min(width - 1, agent + 1)


@register_env("corridor")
class Corridor:
    Options = CorridorOptions
    actions = ("l", "r")
    action_tokens = 1

    def __init__(self, options: CorridorOptions = CorridorOptions()):
        self.options = options
        self.agent = self.goal = self.moves = self.budget = 0
        self.done = True

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        w = self.options.width
        self.agent = rng.randrange(w)
        self.goal = rng.choice([c for c in range(w) if c != self.agent])
        self.moves, self.done = 0, False
        self.budget = abs(self.goal - self.agent) + self.options.slack
        return render(w, self.agent, self.goal)

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("step() on a finished corridor episode; call reset(seed) first")
        obs = render(self.options.width, self.agent, self.goal)
        if action not in self.actions:
            self.done = True
            return invalid_action(obs, action, self.actions)
        self.agent = move(self.options.width, self.agent, action)
        self.moves += 1
        obs = render(self.options.width, self.agent, self.goal)
        if self.agent == self.goal:
            self.done = True
            return StepResult(obs, 1.0, True, {"outcome": "success", "moves": self.moves})
        if self.moves >= self.budget:
            self.done = True
            return StepResult(obs, 0.0, True, {"outcome": "out_of_moves", "moves": self.moves})
        return StepResult(obs, 0.0, False, {"moves": self.moves})

    def expert_action(self) -> str:
        """The shortest way to the goal."""
        return "r" if self.goal > self.agent else "l"
