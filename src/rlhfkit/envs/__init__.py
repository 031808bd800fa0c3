"""Multi-turn environments for agentic RL (`env=module:Class` in a PPO config; docs/agents.md)."""

from rlhfkit.envs.base import BadValue, Environment, Step
from rlhfkit.envs.play import Transcript, play
from rlhfkit.envs.tool_env import ToolEnvironment

__all__ = ["BadValue", "Environment", "Step", "ToolEnvironment", "Transcript", "play"]
