"""A model-update push as the controller makes it: engines paused, pushed, resumed."""

from __future__ import annotations

import ray


def push(group, engines, version: int) -> dict:
    """``group.push(version)`` while every engine is paused (the engines' loading needs it)."""
    ray.get([e.pause.remote("continue") for e in engines])
    try:
        return group.push(version)
    finally:
        ray.get([e.resume.remote() for e in engines])
