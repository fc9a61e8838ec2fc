"""Tools beside the recipes (not imported by them): the memory planner, `python -m tools.plan`."""
