"""The `env` of a PPO config: its class imported and its tools resolved, before any model loads."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from rlhfkit.envs.tool_env import ToolEnvironment
from rlhfkit.errors import ConfigError, ModelError


@dataclass
class LoadedEnvironment:
    spec: str  # env= as written
    env_class: type
    tools: list  # rlhfkit.tools.Tool objects: the class's own `tools`, then episode.tools
    env_args: dict
    code_sandbox: str = "kernel"  # episode.code_sandbox: where the python tool runs

    def code_notice(self) -> str | None:
        """One line for the log when model-written code will run (the python tool is on), saying where."""
        if not any(tool.name == "python" for tool in self.tools):
            return None
        if self.code_sandbox == "kernel":
            return ("code tool on: the python tool runs model-written code, each call in its own namespaces behind "
                    "seccomp and kernel limits (docs/agents.md#the-code-tool)")
        return ("code tool on, WITHOUT a kernel boundary (episode.code_sandbox=hook): model-written code runs as "
                "this user behind an in-process audit hook only, which is not a security boundary "
                "(docs/agents.md#the-code-tool)")


def load_environment(cfg) -> LoadedEnvironment:
    """The class of `cfg.env`, checked against `cfg.episode.env_args`, and its tools (ModelError / ConfigError
    naming the key)."""
    from rlhfkit.user_code import load_user_object

    env_class = load_user_object(cfg.env, what="env")
    if not inspect.isclass(env_class) or not callable(getattr(env_class, "step", None)):
        raise ModelError(f"env '{cfg.env}': expected a class with reset() and step() (a subclass of "
                         f"rlhfkit.envs.Environment), got {type(env_class).__name__} {env_class!r:.60}")
    args = dict(cfg.episode.env_args)
    try:
        inspect.signature(env_class).bind(**args)
    except TypeError as exc:
        raise ConfigError(f"config key 'episode.env_args': {env_class.__name__}({', '.join(args)}) cannot be called: "
                          f"{exc}") from None
    check = getattr(env_class, "check_args", None)  # the class's own checks of its arguments (Environment.check_args)
    if callable(check):
        try:
            check(**args)
        except (ConfigError, ModelError):
            raise
        except ValueError as exc:
            raise ConfigError(f"config key 'episode.env_args': {env_class.__name__}: {exc}") from None
    specs = list(getattr(env_class, "tools", None) or []) + list(cfg.episode.tools)
    tools = []
    try:
        if specs:
            from rlhfkit.tools import resolve_tools

            tools = resolve_tools(specs, code_sandbox=cfg.episode.code_sandbox)
    except (ValueError, ImportError, AttributeError, OSError) as exc:
        raise ConfigError(f"config key 'episode.tools': {exc}") from None
    if tools and not issubclass(env_class, ToolEnvironment) and not getattr(env_class, "tools", None):
        # tools described to the model that nothing would run: a ToolEnvironment runs them (or a class of the
        # user's that lists its own tools, and so reads self.tools itself)
        raise ModelError(f"env '{cfg.env}': tools need an environment that runs them (subclass "
                         f"rlhfkit.envs.ToolEnvironment); {env_class.__name__} does not")
    return LoadedEnvironment(cfg.env, env_class, tools, args, cfg.episode.code_sandbox)
