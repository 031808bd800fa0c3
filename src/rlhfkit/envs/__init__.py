"""Multi-turn environments for agentic RL (`env=module:Class` in a PPO config; docs/agents.md)."""

from rlhfkit.envs.base import Environment, Step
from rlhfkit.envs.tool_env import ToolEnvironment

__all__ = ["Environment", "Step", "ToolEnvironment"]
