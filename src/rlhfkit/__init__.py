"""rlhfkit: the RLHF pipeline (SFT -> reward model -> PPO) for Hugging Face causal language models."""

__version__ = "0.1.0"
