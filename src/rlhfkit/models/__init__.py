"""Load actor / critic / reward / reference models from HF folders; LoRA; HF export."""

from rlhfkit.errors import ModelError
from rlhfkit.models.loading import disable_dropout, load_causal_lm, load_scalar_model, load_tokenizer

__all__ = ["ModelError", "disable_dropout", "load_causal_lm", "load_scalar_model", "load_tokenizer"]
