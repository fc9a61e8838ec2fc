"""`python -m tools.plan`: the memory planner's command line (tools/plan/cli.py)."""

import sys

from tools.plan.cli import main

sys.exit(main())
