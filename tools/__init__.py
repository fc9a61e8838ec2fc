"""Tools beside the recipes (not imported by them): the memory planner, `python -m tools.plan`, and
the view of what train.py trains on, `python -m tools.show_data`."""
