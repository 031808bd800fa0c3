"""The algorithms a config can name, one registered entry each: advantage estimators (`ppo.advantage_estimator`,
registry/estimators.py) and preference losses (`dpo.loss`, registry/preference.py).

An entry is the one place that says what its algorithm needs; the config's choices, `--help`, validation and the
run's notes are derived from it. Adding an algorithm is one entry plus its test.

Nothing here imports torch at module level: the config reads the entries, and `rlhfkit --help` must not import
torch. The functions import the math they call (`rlhfkit.algos`) when they run.
"""
