"""Gymnasium adapter: a text-representable Gymnasium environment as a flash text game.

``GymTextEnv`` wraps any Gymnasium environment with a discrete action space: a subclass says how
to build it from a seed (``make``), how to draw its state as text (``render_text``) and which
character stands for each discrete action (``action_chars``). ``FrozenLake`` is the one shipped:

    observation   *fhf|ffff|ffff|fffg:     rows split by '|', the agent '*' on the start cell
    actions       l d r u                  Gymnasium's 0 left, 1 down, 2 right, 3 up

The map is lowercase (the tiny tokenizer's first, stable ids): ``s`` start, ``f`` frozen,
``h`` hole, ``g`` goal, ``*`` the agent. Maps are random per seed (Gymnasium's
``generate_random_map``, which guarantees a path), so held-out seeds are unseen maps, and the
lake is not slippery by default so a transcript replays exactly. Outcomes: ``success`` (reward 1),
``hole``, ``truncated`` (Gymnasium's time limit), ``invalid_action``.

Needs the optional extra ``envs`` (``pip install 'flash-rl[envs]'``); importing this module does
not, building an environment does, and says so.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from flash.envs.base import StepResult, invalid_action, register_env

INSTALL_HINT = "Gymnasium environments need the 'envs' extra: pip install 'flash-rl[envs]' (gymnasium)"


def require_gymnasium():
    try:
        import gymnasium
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return gymnasium


class GymTextEnv:
    """Base of adapted environments; subclasses set ``action_chars`` and implement ``make`` and
    ``render_text``."""

    action_chars: tuple[str, ...] = ()

    def __init__(self, options):
        require_gymnasium()
        self.options = options
        self.env = None
        self.state = None
        self.done = True
        self.actions = self.action_chars
        self.action_tokens = max(len(a) for a in self.action_chars)

    def make(self, seed: int):
        raise NotImplementedError

    def render_text(self) -> str:
        raise NotImplementedError

    def reset(self, seed: int) -> str:
        if self.env is not None:
            self.env.close()
        self.env = self.make(seed)
        self.state, _ = self.env.reset(seed=seed)
        self.done = False
        return self.render_text()

    def step(self, action: str) -> StepResult:
        if self.done:
            raise RuntimeError("step() on a finished episode; call reset(seed) first")
        if action not in self.action_chars:
            self.done = True
            return invalid_action(self.render_text(), action, self.action_chars)
        self.state, reward, terminated, truncated, _ = self.env.step(self.action_chars.index(action))
        self.done = bool(terminated or truncated)
        info = {}
        if self.done:
            info["outcome"] = self.outcome(float(reward), bool(terminated))
        return StepResult(self.render_text(), float(reward), self.done, info)

    def outcome(self, reward: float, terminated: bool) -> str:
        return "success" if reward > 0 else ("failure" if terminated else "truncated")


@dataclass(frozen=True)
class FrozenLakeOptions:
    size: int = 4  # the map is size x size
    frozen_prob: float = 0.8  # probability a generated cell is frozen (else a hole)
    slippery: bool = False  # Gymnasium's is_slippery: moves go sideways 2/3 of the time
    max_episode_steps: int = 100  # Gymnasium's time limit

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"size must be >= 2, got {self.size}")
        if not 0.0 < self.frozen_prob <= 1.0:
            raise ValueError(f"frozen_prob must be in (0, 1], got {self.frozen_prob}")


@register_env("frozenlake")
class FrozenLake(GymTextEnv):
    Options = FrozenLakeOptions
    action_chars = ("l", "d", "r", "u")
    actions = action_chars
    action_tokens = 1

    def __init__(self, options: FrozenLakeOptions = FrozenLakeOptions()):
        super().__init__(options)
        self.desc: list[str] = []

    def make(self, seed: int):
        gym = require_gymnasium()
        from gymnasium.envs.toy_text.frozen_lake import generate_random_map

        o = self.options
        self.desc = generate_random_map(size=o.size, p=o.frozen_prob, seed=seed)
        return gym.make("FrozenLake-v1", desc=self.desc, is_slippery=o.slippery, max_episode_steps=o.max_episode_steps)

    def render_text(self) -> str:
        return lake_text(self.desc, int(self.state))

    def outcome(self, reward: float, terminated: bool) -> str:
        return "success" if reward > 0 else ("hole" if terminated else "truncated")

    def expert_action(self) -> str:
        """First move of a shortest path to the goal around the holes (as if not slippery)."""
        return shortest_path_action(self.desc, int(self.state))


def lake_text(desc: list[str], state: int) -> str:
    """Rows of the map in lowercase joined by '|', the agent's cell drawn as '*', then ':'."""
    n = len(desc[0])
    rows = [list(r.lower()) for r in desc]
    rows[state // n][state % n] = "*"
    return "|".join("".join(r) for r in rows) + ":"


MOVES = {"l": (0, -1), "d": (1, 0), "r": (0, 1), "u": (-1, 0)}


def shortest_path_action(desc: list[str], state: int) -> str:
    """Breadth-first search from ``state`` to 'G' avoiding 'H'; the first action of a shortest
    path ('r' when no path exists, which generated maps rule out)."""
    rows, cols = len(desc), len(desc[0])
    start = divmod(state, cols)
    first: dict[tuple[int, int], str | None] = {start: None}
    queue = deque([start])
    while queue:
        r, c = queue.popleft()
        if desc[r][c] == "G":
            return first[(r, c)] or "r"
        for a, (dr, dc) in MOVES.items():
            nxt = (r + dr, c + dc)
            if 0 <= nxt[0] < rows and 0 <= nxt[1] < cols and nxt not in first and desc[nxt[0]][nxt[1]] != "H":
                first[nxt] = first[(r, c)] or a
                queue.append(nxt)
    return "r"
