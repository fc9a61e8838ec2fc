"""`python -m common.plan`: the memory planner's command line (common/plan/cli.py)."""

import sys

from common.plan.cli import main

sys.exit(main())
