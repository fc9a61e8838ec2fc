"""A mutation check of our own, run on demand (not in CI): plant each deliberate bug of mutants.py in a
scratch copy of the checkout, run the tests that must catch it, and report which bugs they caught.

    python -m scripts.mutation --list                     # the mutants, and whether each still applies
    python -m scripts.mutation --only warmup-off-by-one   # one (or a few) of them
    python -m scripts.mutation --baseline                 # all of them, their tests first run unmutated

The logic is scripts/mutation/run.py; its own unit tests are tests/test_mutation_tool.py.
"""
