"""rlhfkit: the RLHF pipeline (SFT -> reward model -> PPO) for Hugging Face causal language models."""

from rlhfkit.compat import shield_mismatched_extensions

__version__ = "0.1.0"

shield_mismatched_extensions()  # before transformers is imported: vision/audio builds for another torch (compat.py)
