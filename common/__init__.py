"""The core a recipe needs, copied with it into a project: options, model, data, export, the
start-up guard. It imports nothing above itself (tests/test_layout.py checks it)."""
