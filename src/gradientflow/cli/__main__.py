"""``python -m gradientflow.cli``: the ``gradientflow`` command."""

import sys

from gradientflow.cli import main

# The bench's reports record "gradientflow ARGS" as their command when argv[0] is the command's
# (bench/report.py, bench/quality_report.py); run this way, it is the same command.
sys.argv[0] = "gradientflow"
sys.exit(main())
