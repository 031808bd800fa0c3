"""Run at the start of every Python process whose path begins with this folder (see __init__.py)."""

from rlhfkit.compat import shield_mismatched_extensions

shield_mismatched_extensions()
