"""flash.usage.process_tree_cpu_s: the CPU a role's processes used, children included (a vLLM
engine computes in child processes), which the planner's CPU bound reads."""

import subprocess
import sys
import time

import pytest

from flash.usage import process_tree_cpu_s

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\nprint('done', flush=True)\n"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_a_busy_child_counts_and_the_parent_alone_does_not():
    before_tree, before_own = process_tree_cpu_s(), time.process_time()
    child = subprocess.Popen(
        [sys.executable, "-c", BURN.format(s=0.6) + "import time; time.sleep(30)"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "done"  # it burnt 0.6 CPU-s and is still alive
        grown = process_tree_cpu_s() - before_tree
        own = time.process_time() - before_own
        assert grown >= 0.6 + own - 0.05, (grown, own)  # the child's 0.6 s (tick resolution: 10 ms)
        assert own < 0.5  # waiting for the child's line costs the parent (almost) nothing
        assert process_tree_cpu_s(child.pid) >= 0.55  # the child's own tree
    finally:
        child.kill()
        child.wait()
    assert process_tree_cpu_s(child.pid) == 0.0  # a process that is gone: nothing
