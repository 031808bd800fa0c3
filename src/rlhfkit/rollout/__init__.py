"""Generation and experience making for PPO: the RolloutBatch dataclass and the functions that fill it."""

from rlhfkit.rollout.batch import RolloutBatch, cat_rollouts
from rlhfkit.rollout.evaluate import evaluate_held_out, generate_all
from rlhfkit.rollout.experience import add_advantages, add_model_outputs, adjust_scores, ended_with_eos
from rlhfkit.rollout.generate import eos_token_ids, generate_rollout, response_mask

__all__ = ["RolloutBatch", "add_advantages", "add_model_outputs", "adjust_scores", "cat_rollouts",
           "ended_with_eos", "eos_token_ids", "evaluate_held_out", "generate_all", "generate_rollout", "response_mask"]
