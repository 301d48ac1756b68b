"""``python -m tests.golden bless RECIPE [...]`` (tests.golden.bless)."""

import sys

from tests.golden.bless import main

sys.exit(main(sys.argv[1:]))
