"""The unit tier's budget (tests/helpers/tiers.py): a test over it is named, imports are not charged."""

import importlib
import sys
import time

from tests.helpers.tiers import import_clock, over_budget


def test_a_test_over_the_budget_is_named_with_its_cpu_time_and_where_it_belongs():
    assert over_budget("tests/unit/test_x.py::test_y", 1.99, budget_s=2.0) is None
    message = over_budget("tests/unit/test_x.py::test_y", 2.5, budget_s=2.0)
    assert message == ("tests/unit/test_x.py::test_y: 2.50 s of CPU, over the unit tier's 2 s budget: "
                       "make it smaller or move it to tests/integration")


PROBE = "flash_tier_probe_mod"  # a module the test writes itself, not a package to declare


def test_a_first_import_is_charged_to_the_import_clock_and_a_cached_one_is_not(tmp_path, monkeypatch):
    (tmp_path / f"{PROBE}.py").write_text(
        "import time\nend = time.process_time() + 0.2\nwhile time.process_time() < end:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with import_clock() as first:
        importlib.import_module(PROBE)  # 0.2 s of CPU while it loads
    assert 0.19 <= first[0] < 1.0
    with import_clock() as again:
        importlib.import_module(PROBE)  # already in sys.modules: a lookup, nothing loaded
    assert again[0] < 0.01
    start = time.process_time()
    with import_clock() as none:
        end = time.process_time() + 0.05
        while time.process_time() < end:
            pass
    assert none[0] == 0.0 and time.process_time() - start >= 0.05
    sys.modules.pop(PROBE, None)
