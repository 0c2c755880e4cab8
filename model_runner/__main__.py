"""`python -m model_runner ...`: the same as the `model-runner` command."""

import sys

from model_runner.cli import main

sys.exit(main())
