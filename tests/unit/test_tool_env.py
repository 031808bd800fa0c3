"""ToolEnvironment (envs/tool_env.py): the model's tool calls run and come back as tool turns, malformed calls as
error lines, the first turn without a call is judged; the sandboxed code tool answers through it; a user's
function becomes a tool; an environment's tools are loaded (and mistakes named) before any model loads."""

from __future__ import annotations

import pytest

from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.envs import ToolEnvironment
from rlhfkit.errors import ConfigError, ModelError
from rlhfkit.tools import format_tool_call, resolve_tools


class Multiply(ToolEnvironment):
    tools = ["calculator"]

    def reset(self, row):
        self.answer = int(row["answer"])

    def score(self, answer):
        return float(answer == str(self.answer))


def env_with(tools, cls=Multiply):
    env = cls()
    env.tools = resolve_tools(tools)
    env.reset({"answer": 287663})
    return env


def test_a_call_gets_the_tools_result_and_the_answer_is_judged():
    env = env_with(["calculator"])
    step = env.step("Let me compute. " + format_tool_call("calculator", {"expression": "347 * 829"}))
    assert not step.done
    assert step.messages == [{"role": "tool", "name": "calculator", "content": "287663"}]
    final = env.step("287663")
    assert final.done and env.reward() == 1.0 and env.tool_calls == 1


def test_a_wrong_answer_scores_zero_and_an_unanswered_episode_is_unjudged():
    env = env_with(["calculator"])
    assert env.step("287000").done and env.reward() == 0.0
    assert env_with(["calculator"]).reward() is None  # no final answer yet: nothing to judge


def test_malformed_and_unknown_calls_come_back_as_error_lines():
    env = env_with(["calculator"])
    step = env.step('<tool_call>{"name": "calculator", "arguments": </tool_call>'
                    + format_tool_call("abacus", {"x": 1})
                    + format_tool_call("calculator", {"expr": "1+1"}))
    contents = [m["content"] for m in step.messages]
    assert len(contents) == 3 and all(c.startswith("error: ") for c in contents), contents
    assert "invalid JSON" in contents[0]
    assert "no tool named 'abacus' (tools: calculator)" in contents[1]
    assert "expression" in contents[2]  # the missing required argument is named
    assert env.tool_calls == 3 and not step.done


def test_several_calls_in_one_turn_each_get_a_result():
    env = env_with(["calculator"])
    step = env.step(format_tool_call("calculator", {"expression": "2**10"})
                    + format_tool_call("calculator", {"expression": "7 // 2"}))
    assert [m["content"] for m in step.messages] == ["1024", "3"]


def test_the_code_tool_runs_model_code_in_the_sandbox_only_when_listed():
    env = env_with(["calculator", "python"])
    step = env.step(format_tool_call("python", {"code": "print(sum(range(10)))"}))
    assert step.messages[0]["content"].strip() == "45"
    escape = env.step(format_tool_call("python", {"code": "print(open('/etc/passwd').read())"}))
    assert "PermissionError" in escape.messages[0]["content"] and "root:" not in escape.messages[0]["content"]
    unlisted = env_with(["calculator"]).step(format_tool_call("python", {"code": "print(1)"}))
    assert unlisted.messages[0]["content"].startswith("error: no tool named 'python'")


def test_a_users_function_is_a_tool(tmp_path):
    (tmp_path / "lookup.py").write_text(
        "def capital(country: str) -> str:\n"
        "    \"\"\"The capital of a country.\n\n"
        "    Args:\n"
        "        country: the country's English name\n"
        "    \"\"\"\n"
        "    return {'France': 'Paris'}.get(country, 'unknown')\n")
    env = env_with([f"{tmp_path / 'lookup.py'}:capital"])
    step = env.step(format_tool_call("capital", {"country": "France"}))
    assert step.messages == [{"role": "tool", "name": "capital", "content": "Paris"}]


def config(tmp_path, *overrides):
    from rlhfkit.config.fields import load_config

    (tmp_path / "envs.py").write_text("from rlhfkit.envs import Environment, ToolEnvironment\n"
                                      "class Plain(Environment):\n    def step(self, text):\n        return None\n"
                                      "class Tools(ToolEnvironment):\n    tools = ['calculator']\n"
                                      "    def __init__(self, level=1):\n        self.level = level\n")
    return load_config(PPOConfig, None, ["actor=x", f"env={tmp_path / 'envs.py'}:Tools", "data.prompts=p.jsonl", "train.max_steps=1",
                                         *overrides])


def test_the_environment_and_its_tools_load_before_any_model(tmp_path):
    from rlhfkit.envs.load import load_environment

    loaded = load_environment(config(tmp_path, "episode.tools=[python]", "episode.env_args={level: 3}"))
    assert [t.name for t in loaded.tools] == ["calculator", "python"] and loaded.env_args == {"level": 3}
    assert loaded.code_notice().startswith("code tool on: the python tool runs model-written code, each call in its "
                                           "own namespaces")
    assert load_environment(config(tmp_path)).code_notice() is None  # the calculator alone runs no model code
    with pytest.raises(ConfigError, match="episode.env_args.*Tools\\(colour\\) cannot be called"):
        load_environment(config(tmp_path, "episode.env_args={colour: red}"))
    with pytest.raises(ConfigError, match="episode.tools.*'abacus'"):
        load_environment(config(tmp_path, "episode.tools=[abacus]"))
    with pytest.raises(ConfigError, match="episode.tools.*more than one tool named 'calculator'"):
        load_environment(config(tmp_path, "episode.tools=[calculator]"))
    with pytest.raises(ModelError, match="tools need an environment that runs them"):
        load_environment(config(tmp_path, f"env={tmp_path / 'envs.py'}:Plain", "episode.tools=[calculator]"))
    with pytest.raises(ModelError, match="has no class 'Missing'"):
        load_environment(config(tmp_path, f"env={tmp_path / 'envs.py'}:Missing"))


@pytest.mark.parametrize("overrides, message", [
    (["reward=r.py:f"], "config key 'reward': the environment (env="),
    (["env=notaspec"], "config key 'env': expected module:Class or path/file.py:Class"),
    (["episode.max_turns=0"], "config key 'episode.max_turns': must be >= 1"),
    (["episode.max_failed=2"], "config key 'episode.max_failed': a share in [0, 1]"),
    (["episode.timeout=0"], "config key 'episode.timeout': must be > 0"),
    (["episode.code_sandbox=none"], "config key 'episode.code_sandbox': expected one of kernel, hook, got 'none'"),
])
def test_episode_settings_that_cannot_work_are_config_errors(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as raised:
        config(tmp_path, *overrides)
    assert message in str(raised.value)


def test_without_namespaces_the_python_tool_is_a_config_error_naming_the_opt_out(tmp_path, monkeypatch):
    from rlhfkit.envs.load import load_environment
    from rlhfkit.tools import sandbox

    # as a kernel without unprivileged user namespaces answers the boundary's trial run
    monkeypatch.setattr(sandbox, "kernel_boundary_problem",
                        lambda: "unshare (the kernel refuses unprivileged namespaces here): [Errno 1] Operation not "
                                "permitted")
    with pytest.raises(ConfigError, match="episode.tools.*cannot build: unshare.*Set episode.code_sandbox=hook"):
        load_environment(config(tmp_path, "episode.tools=[python]"))
    loaded = load_environment(config(tmp_path, "episode.tools=[python]", "episode.code_sandbox=hook"))
    assert loaded.tools[1]({"code": "print(6 * 7)"}) == "42"
    assert "WITHOUT a kernel boundary (episode.code_sandbox=hook)" in loaded.code_notice()


def test_an_environment_is_played_by_hand_before_training(tmp_path):
    from rlhfkit.envs import BadValue, play

    call = format_tool_call("calculator", {"expression": "347 * 829"})
    episode = play(Multiply, {"answer": 287663, "prompt": "What is 347 * 829?"}, [call, "287663"])
    assert [m["role"] for m in episode.messages] == ["user", "assistant", "tool", "assistant"]
    assert episode.messages[2] == {"role": "tool", "name": "calculator", "content": "287663"}
    assert (episode.ended, episode.reward) == ("done", 1.0)
    assert episode.text().endswith("[assistant] 287663\n-- ended: done; return 1")
    # the scripted turns ran out: no answer, so nothing judged it (a run leaves it unjudged)
    short = play(Multiply, {"answer": 1}, [call])
    assert (short.ended, short.reward) == ("script_ended", None) and "return unjudged" in short.text()
    # the class by its spec, its arguments, and the error a run would report for a value it cannot use
    (tmp_path / "envs.py").write_text("from rlhfkit.envs import Environment, Step\n"
                                      "class Echo(Environment):\n    def __init__(self, bad=False):\n"
                                      "        self.bad = bad\n"
                                      "    def reset(self, row):\n        return 'say ' + row['word']\n"
                                      "    def step(self, text):\n        return 42 if self.bad else "
                                      "Step(reward=float(text == 'hi'), done=True)\n")
    assert play(f"{tmp_path / 'envs.py'}:Echo", {"word": "hi"}, ["hi"]).reward == 1.0
    with pytest.raises(BadValue, match="Echo.step returned int \\(42\\); expected a message string"):
        play(f"{tmp_path / 'envs.py'}:Echo", {"word": "hi"}, ["hi"], env_args={"bad": True})
