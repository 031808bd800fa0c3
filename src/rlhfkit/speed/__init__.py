"""The speed plan: which optional fast paths each model's forwards take, and why the others are off.

`models/plan.py` holds `ModelPlan`, the record one model's forwards, rollouts and losses are passed (it imports
nothing of rlhfkit, so `models/`, `rollout/` and `accel/` may read it); `speed/registry.py` holds every path as one
entry (its switch, where it applies, its exactness check) and decides the plans at load; `speed/checks.py` holds
the exactness checks the entries run. This file imports nothing, so importing the record loads no decisions.
"""
