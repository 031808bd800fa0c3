"""Load actor / critic / reward / reference models from HF folders; LoRA; HF export."""

from rlhfkit.models.loading import ModelError, disable_dropout, load_causal_lm, load_scalar_model, load_tokenizer

__all__ = ["ModelError", "disable_dropout", "load_causal_lm", "load_scalar_model", "load_tokenizer"]
