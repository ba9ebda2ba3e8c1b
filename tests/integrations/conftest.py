"""The integration tests share ``tests/_dist.py`` (spawned Gloo ranks with timeouts)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
