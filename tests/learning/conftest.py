"""The learning tier: whole learning runs, each held to its bar (``.ci/learning`` runs them all).

Every test here is marked ``margin`` (left out of the default run; the root conftest gives margin
tests their longer time limit). Warm starts go to ``FLASH_TEST_CACHE`` when it is set, so recipes
that share a model share its warm start across runs of this tier.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.margin)
