"""Bounds and a deadline for math-verify, whose parser (lark + sympy) has no bound of its own.

Its cost grows with the text and steeply with nested parentheses (measured under load: 7 s at
depth 10, 76 s at depth 40; 114 s for a 1 MB sum), and an answer such as a power tower can make
sympy compute for ever. So:

- ``check_math_text``: a text over ``MAX_MATH_CHARS`` (``too_large``) or with ``(``/``[`` nested
  deeper than ``MAX_PAREN_DEPTH`` (``too_deep``) is refused before the parser sees it
  (``MathTooComplex``, a ``ValueError`` with a ``reason``).
- ``MathChecker``: the checks the driver makes itself (a dataset row's reference parses; the
  reward of a ``math`` row scored in the driver's threads) run in one child process
  (``python -m flash.rewards._math_child``), each call under ``timeout_s``; a call past it kills
  the child (a fresh one serves the next call) and is the outcome ``timeout``, never a hang. The
  reward pool's workers need no child: the pool's deadline bounds their calls.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

from flash.guards import nesting_depth

MAX_MATH_CHARS = 32_768  # about 8k tokens of text
MAX_PAREN_DEPTH = 6
TIMEOUT_S = 10.0  # one call in the child
STARTUP_S = 120.0  # the child imports math-verify and sympy before its first call


class MathTooComplex(ValueError):
    """A text math-verify is not given (``reason``: ``too_large``, ``too_deep`` or ``timeout``)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def paren_depth(text: str) -> int:
    """The deepest nesting of ``(`` and ``[`` in ``text``."""
    return nesting_depth(text.encode("utf-8", "replace"), b"([", b")]")


def check_math_text(text: str, what: str = "reference") -> None:
    """MathTooComplex when ``text`` is over the bounds (see the module docstring)."""
    if len(text) > MAX_MATH_CHARS:
        raise MathTooComplex(
            "too_large",
            f"{what} answer of {len(text)} characters is over {MAX_MATH_CHARS}; "
            f"keep only the final answer (e.g. after '####')",
        )
    depth = paren_depth(text)
    if depth > MAX_PAREN_DEPTH:
        raise MathTooComplex("too_deep", f"{what} answer nests parentheses {depth} deep, over {MAX_PAREN_DEPTH}")


class MathChecker:
    """math-verify in one child process, each call under a deadline (see the module docstring)."""

    def __init__(self, timeout_s: float = TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self.timeouts = 0
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        atexit.register(self.close)

    def call(self, op: str, *args: str):
        """The child's answer to ``op`` (``parse``: None when the reference parses; ``score``: the
        math reward of ``(answer, response)``); the child's ValueError (or MathTooComplex) is
        raised here, and MathTooComplex('timeout') past the deadline."""
        with self._lock:
            proc = self._child()
            proc.stdin.write(json.dumps([op, *args]) + "\n")
            proc.stdin.flush()
            line = _read_line(proc, self.timeout_s)
            if line is None:
                self.timeouts += 1
                self._stop()
                raise MathTooComplex("timeout", f"math-verify took over {self.timeout_s:g}s on {args[-1][:60]!r}")
        reply = json.loads(line)
        if "error" in reply:
            reason, detail = reply["error"]
            raise MathTooComplex(reason, detail) if reason else ValueError(detail)
        return reply["value"]

    def _child(self) -> subprocess.Popen:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        root = str(Path(__file__).resolve().parents[2])  # the flash checkout the driver runs
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "flash.rewards._math_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        if _read_line(self._proc, STARTUP_S) is None:
            self._stop()
            raise RuntimeError("the math-verify child process did not start")
        return self._proc

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def _read_line(proc: subprocess.Popen, timeout_s: float) -> str | None:
    """The child's next line within ``timeout_s``; None past it (or when the child died)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline() if ready else ""
    return line or None


_CHECKER: MathChecker | None = None
_CHECKER_LOCK = threading.Lock()


def checker() -> MathChecker:
    """This process's one ``MathChecker``."""
    global _CHECKER
    with _CHECKER_LOCK:
        if _CHECKER is None:
            _CHECKER = MathChecker()
        return _CHECKER
