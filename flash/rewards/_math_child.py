"""The child process of ``flash.rewards.math_limits.MathChecker``: math-verify's checks, one JSON
request a line on stdin, one reply a line on stdout (the parent holds the deadline)."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

from flash.rewards.builtin import math_reward, parse_reference


def _serve() -> None:
    """The child: one JSON request a line on stdin, one ``{"value": ...}`` a line on stdout."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # the parser's own prints never reach the reply stream
    math_reward(SimpleNamespace(answer="$(1)$"), "$\\frac{1}{2}$")  # builds the parsers before the first deadline
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        op, *args = json.loads(line)
        try:
            if op == "parse":
                parse_reference(args[0])
                reply = {"value": None}
            else:
                reply = {"value": float(math_reward(SimpleNamespace(answer=args[0]), args[1]))}
        except Exception as exc:  # noqa: BLE001 - the parser's failure is the caller's answer
            text = str(exc)[:200] if isinstance(exc, ValueError) else f"{type(exc).__name__}: {str(exc)[:200]}"
            reply = {"error": [getattr(exc, "reason", ""), text]}
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve()
