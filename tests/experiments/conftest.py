"""The experiments' tests import the scripts of ``experiments/`` by name, as the scripts import their
sibling ``_study`` when run from the repository root, and share ``tests/_dist.py`` and ``tests/test_csc.py``'s
helpers.  Spawned ranks inherit this ``sys.path``."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))
sys.path.insert(0, str(TESTS.parent / "experiments"))
