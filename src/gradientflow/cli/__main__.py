"""``python -m gradientflow.cli``: the ``gradientflow`` command."""

import sys

from gradientflow.cli import main

sys.exit(main())
