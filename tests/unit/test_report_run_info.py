"""The report says what ran: each stage's verb and algorithm (estimator, loss), its models, data, key settings and
duration, read from the config.yaml and the files a run writes (synthetic run folders; the real runs are in
tests/integration/test_report_says_what_ran.py)."""

import json
import os
import re
from html import unescape
from datetime import datetime

import yaml

from rlhfkit.config import DPOConfig, RMConfig, SFTConfig
from rlhfkit.config.fields import dump_yaml, load_config
from rlhfkit.config.ppo_schema import PPOConfig
from rlhfkit.report import write_report

GRPO = ["actor=sft/final", "reward=rewards.py:four_words", "data.prompts=prompts.jsonl", "data.eval_prompts=eval.jsonl",
        "ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=4", "ppo.kl_coef=0", "ppo.kl_loss_coef=0.05",
        "train.max_steps=2", "train.batch_size=8", "train.lr=5e-4", "gen.max_new_tokens=12"]
T0 = datetime(2026, 1, 2, 3, 4, 5).timestamp()


def _run_folder(folder, cls, overrides, stage, steps=2, time_key="time/step", step_seconds=1.5, final=True):
    """A finished run's files as a stage writes them: config.yaml, metrics.jsonl, final/ (times set by hand)."""
    folder.mkdir(parents=True, exist_ok=True)
    dump_yaml(load_config(cls, None, overrides), folder / "config.yaml")
    rows = [{"step": s, "stage": stage, "loss": 1.0 / s, time_key: step_seconds} for s in range(1, steps + 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if final:
        (folder / "final").mkdir()
        (folder / "final" / "model.safetensors").write_bytes(b"0")
    return folder


def _set_times(folder, start, end):
    """config.yaml written at `start` (once the models loaded), every other file by `end`."""
    for path in folder.rglob("*"):
        os.utime(path, (end, end))
    os.utime(folder / "config.yaml", (start, start))


def _ran_table(html, heading):
    """{row name: cell text} of the "what ran" table under the <h2> that contains `heading`."""
    section = html[html.index(heading):]
    table = re.search(r'<table class="ran">(.*?)</table>', section, re.S).group(1)
    cells = re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td></tr>", table)
    return {k: unescape(re.sub(r"<[^>]+>", "", v)) for k, v in cells}


def test_a_grpo_run_is_named_grpo_with_its_models_settings_and_duration(tmp_path):
    run = _run_folder(tmp_path / "run", PPOConfig, GRPO, "ppo", time_key="time/iteration")
    _set_times(run, T0, T0 + 42.5)
    html = write_report(run).read_text()

    assert "<h2>GRPO — rlhfkit ppo</h2>" in html and "PPO — ppo" not in html
    assert "Stages: GRPO (ppo)" in html
    ran = _ran_table(html, "<h2>GRPO")
    assert ran["estimator"].startswith("ppo.advantage_estimator=grpo — GRPO (Shao et al. 2024)")
    assert ran["actor"] == "sft/final"
    assert ran["reward"] == "rewards.py:four_words (a Python function)"
    assert ran["critic"] == "none (grpo needs no critic)"
    assert ran["reference"] == "the actor (default)"
    assert ran["data"] == "prompts: prompts.jsonl · eval: eval.jsonl"
    assert ran["training"] == ("train.lr=0.0005 · train.batch_size=8 · ppo.n_samples_per_prompt=4 · "
                               "train.micro_batch_size=4 · train.max_steps=2")
    assert ran["generation"] == "gen.max_new_tokens=12 · gen.temperature=1"
    assert ran["KL"] == "ppo.kl_loss_coef=0.05 (a k3 term in the loss)"
    assert ran["LoRA"] == "off (lora.rank=0: full fine-tuning)"
    assert ran["engine"] == "engine.backend=local · engine.precision=fp32"
    start = datetime.fromtimestamp(T0).astimezone().strftime("%Y-%m-%d %H:%M:%S")
    assert ran["duration"].startswith(f"42.5 s: {start} → ") and "3.0 s in the 2 iterations" in ran["duration"]
    assert ran["duration"].count("→") == 1  # one span: no pipeline result.json here


def _tokenizer_folder(folder, extra_text=""):
    """A model folder's tokenizer files (a BPE trained on a few words; `extra_text` changes its vocabulary)."""
    from rlhfkit.demo.tiny import build_tokenizer

    build_tokenizer(["say alpha beta gamma", "say delta " + extra_text] * 3, vocab_size=300).save_pretrained(folder)
    return folder


def test_a_ppo_run_with_a_critic_and_a_reward_model(tmp_path):
    """GAE with a reward-model folder: the critic starts from it when it reads the actor's tokens (the run compares
    the two tokenizers, and so does the report), from the actor otherwise; the table says which this run did."""
    actor, rm = _tokenizer_folder(tmp_path / "sft"), _tokenizer_folder(tmp_path / "rm")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "say alpha"}\n')
    run = _run_folder(tmp_path / "run", PPOConfig,
                      [f"actor={actor}", f"reward={rm}", f"data.prompts={tmp_path / 'prompts.jsonl'}",
                       "ppo.kl_coef=0.05", "train.max_steps=3", "lora.rank=8", "engine.precision=bf16"], "ppo",
                      steps=3, time_key="time/iteration")
    html = write_report(run).read_text()
    assert "<h2>PPO — rlhfkit ppo</h2>" in html
    ran = _ran_table(html, "<h2>PPO")
    assert ran["estimator"].startswith("ppo.advantage_estimator=gae — GAE (Schulman et al. 2016)")
    assert ran["reward"] == f"{rm} (a reward model)"
    assert ran["critic"] == (f"{rm} (the reward model reads the actor's tokens: its score head starts the value "
                             "head; default)")
    assert ran["KL"] == "ppo.kl_coef=0.05 · ppo.kl_estimator=k1 (in the reward)"
    assert ran["LoRA"] == "lora.rank=8 · lora.alpha=16"
    assert ran["engine"] == "engine.backend=local · engine.precision=bf16"
    assert ran["rollout"] == "rollout.engine=native (rlhfkit's decoder on the actor)"
    # a plain file has no eval split of its own: the run held out data.eval_fraction of it
    assert ran["data"] == f"prompts: {tmp_path / 'prompts.jsonl'} · eval: data.eval_fraction=0.05 of it, held out"

    _tokenizer_folder(rm, extra_text="epsilon zeta eta theta")  # another vocabulary: the actor's fresh head
    ran = _ran_table(write_report(run).read_text(), "<h2>PPO")
    assert ran["critic"] == f"the actor with a fresh value head (default; {rm} tokenizes differently)"


def test_a_prompt_folder_with_a_test_split_is_evaluated_on_it(tmp_path):
    (tmp_path / "prompts").mkdir()
    for split in ("train", "test"):
        (tmp_path / "prompts" / f"{split}.jsonl").write_text('{"prompt": "say alpha"}\n')
    run = _run_folder(tmp_path / "run", PPOConfig, ["actor=sft/final", "reward=rewards.py:four_words",
                                                    f"data.prompts={tmp_path / 'prompts'}", "train.max_steps=2"],
                      "ppo", time_key="time/iteration")
    assert _ran_table(write_report(run).read_text(), "<h2>PPO")["data"].endswith("eval: its own test split")


def test_a_dpo_run_names_its_loss_and_the_settings_the_loss_reads(tmp_path):
    run = _run_folder(tmp_path / "run", DPOConfig,
                      ["model=sft/final", "data.train=pairs.jsonl", "data.eval=pairs_eval.jsonl", "dpo.loss=ipo",
                       "dpo.beta=0.2", "train.epochs=3"], "dpo")
    html = write_report(run).read_text()
    assert "<h2>IPO — rlhfkit dpo</h2>" in html
    ran = _ran_table(html, "<h2>IPO")
    assert ran["loss"].startswith("dpo.loss=ipo — IPO: ") and ran["loss"].endswith("· dpo.beta=0.2")
    assert ran["model"] == "sft/final" and ran["reference"] == "the model (default)"
    assert ran["data"] == "train: pairs.jsonl · eval: pairs_eval.jsonl"
    assert ran["training"] == "train.lr=1e-05 · train.batch_size=16 · train.micro_batch_size=4 · train.epochs=3"


def test_simpo_has_no_reference(tmp_path):
    run = _run_folder(tmp_path / "run", DPOConfig, ["model=m", "data.train=p.jsonl", "dpo.loss=simpo"], "dpo")
    html = write_report(run).read_text()
    ran = _ran_table(html, "<h2>SimPO — rlhfkit dpo</h2>")
    assert ran["reference"] == "none (simpo needs no reference)"
    assert "dpo.beta=" in ran["loss"] and "dpo.simpo_gamma=0.5" in ran["loss"]


def test_a_pipeline_folder_says_what_ran_per_step(tmp_path):
    _run_folder(tmp_path / "sft", SFTConfig, ["model=HuggingFaceTB/SmolLM2-135M-Instruct", "data.train=qa.jsonl",
                                              "lora.rank=8", "train.lr=2e-4"], "sft")
    _run_folder(tmp_path / "rm", RMConfig, ["model=out/sft/final", "data.train=pairs.jsonl"], "rm")
    _run_folder(tmp_path / "ppo", PPOConfig, GRPO, "ppo", time_key="time/iteration")
    (tmp_path / "ppo" / "result.json").write_text(json.dumps({"seconds": 61.0}))
    html = write_report(tmp_path).read_text()
    assert html.index("<h2>SFT — rlhfkit sft</h2>") < html.index("<h2>RM — rlhfkit rm</h2>") < html.index(
        "<h2>GRPO — rlhfkit ppo</h2>")
    assert _ran_table(html, "<h2>SFT")["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert _ran_table(html, "<h2>SFT")["LoRA"] == "lora.rank=8 · lora.alpha=16"
    assert _ran_table(html, "<h2>RM")["model"] == "out/sft/final"
    assert _ran_table(html, "<h2>GRPO")["duration"].startswith("1 min 1 s in all (loading included)")


def test_a_copied_folder_gives_no_wrong_clock_times(tmp_path):
    """A copy without its times (cp -r) has every file written at once: the clock says 0 s while the steps
    took 3 s, so only the steps' own time is shown."""
    run = _run_folder(tmp_path / "run", SFTConfig, ["model=m", "data.train=d.jsonl"], "sft")
    _set_times(run, T0, T0)
    duration = _ran_table(write_report(run).read_text(), "<h2>SFT")["duration"]
    assert duration == "3.0 s in the 2 steps"


def test_a_run_without_final_says_it_did_not_finish(tmp_path):
    run = _run_folder(tmp_path / "run", SFTConfig, ["model=m", "data.train=d.jsonl"], "sft", final=False)
    _set_times(run, T0, T0 + 10)
    duration = _ran_table(write_report(run).read_text(), "<h2>SFT")["duration"]
    assert duration.startswith("10.0 s: ") and "no final/" in duration


def test_a_folder_without_config_yaml_keeps_the_stage_name(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "stage": "ppo", "kl": 0.1}) + "\n")
    html = write_report(tmp_path).read_text()
    assert "<h2>PPO — ppo</h2>" in html and 'class="ran"' not in html


# what an agent run was given: `rlhfkit ppo env=my_env.py:MyEnv episode.tools=[calculator, python] ...`
AGENT = ["actor=sft/final", "env=my_env.py:MyEnv", "episode.tools=[calculator, python]", "episode.max_turns=3",
         "episode.max_tokens=96", "episode.env_args={level: 2}", "data.prompts=prompts.jsonl",
         "data.eval_prompts=eval.jsonl", "ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=4", "ppo.kl_coef=0",
         "train.max_steps=2"]
# a conditional rule where a value belongs ("the reward model if it reads the actor's tokens, else ...")
RULE = re.compile(r"\b(if|else|unless|otherwise|when|whether|either)\b|\bnull\b", re.I)


def test_an_env_runs_table_names_its_environment_tools_and_turns(tmp_path):
    run = _run_folder(tmp_path / "run", PPOConfig, AGENT, "ppo", time_key="time/iteration")
    ran = _ran_table(write_report(run).read_text(), "<h2>GRPO")
    assert ran["reward"] == "the episode's return, from the environment (below)"  # was "null"
    assert ran["environment"] == 'env=my_env.py:MyEnv · episode.env_args={"level": 2}'
    assert ran["tools"] == 'episode.tools=["calculator", "python"] · episode.code_sandbox=kernel'
    assert ran["turns"] == "episode.max_turns=3 · episode.max_tokens=96"
    assert list(ran).index("reward") < list(ran).index("environment") < list(ran).index("critic")
    assert not [text for text in ran.values() if RULE.search(text)]

    calculator_only = _run_folder(tmp_path / "calc", PPOConfig, AGENT + ["episode.tools=[calculator]"], "ppo")
    assert _ran_table(write_report(calculator_only).read_text(), "<h2>GRPO")["tools"] == \
        'episode.tools=["calculator"]'  # no python tool: no sandbox ran model-written code


def test_the_judge_rollout_and_engine_rows_say_this_runs_values(tmp_path):
    run = _run_folder(tmp_path / "run", PPOConfig,
                      GRPO + ["eval.judge=gold.py:score", "engine.backend=deepspeed", "engine.zero_stage=2",
                              "engine.offload_optimizer=true", "engine.precision=bf16"], "ppo")
    ran = _ran_table(write_report(run).read_text(), "<h2>GRPO")
    assert ran["judge"] == "eval.judge=gold.py:score (a Python function): scores the held-out responses as eval/gold"
    assert ran["rollout"] == "rollout.engine=native (rlhfkit's decoder on the actor)"
    assert ran["engine"] == ("engine.backend=deepspeed · engine.zero_stage=2 · engine.offload_optimizer=true · "
                             "engine.precision=bf16")
    assert not [text for text in ran.values() if RULE.search(text)]

    # a vLLM run's config.yaml (vLLM is not installed here, so the file is written as such a run writes it)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["rollout"].update(engine="vllm", server="http://gpu-node:8000")
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    ran = _ran_table(write_report(run).read_text(), "<h2>GRPO")
    assert ran["rollout"] == "rollout.engine=vllm · rollout.server=http://gpu-node:8000 · rollout.tis_cap=2"
    config["rollout"].update(server=None, tis_cap=None)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    ran = _ran_table(write_report(run).read_text(), "<h2>GRPO")
    assert ran["rollout"] == ("rollout.engine=vllm · colocated in the trainer's process · rollout.memory=0.3 · "
                              "rollout.tis_cap=null")


def test_no_row_states_a_rule_instead_of_this_runs_value(tmp_path):
    """Every row of every stage's table says what applied to this run, read from its files."""
    (tmp_path / "pairs.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "p"}\n')
    runs = {
        "sft": (SFTConfig, ["model=m", f"data.train={tmp_path / 'pairs.jsonl'}"]),
        "rm": (RMConfig, ["model=m", f"data.train={tmp_path / 'pairs.jsonl'}", "data.eval_max_rows=0"]),
        "dpo": (DPOConfig, ["model=m", f"data.train={tmp_path / 'pairs.jsonl'}", "lora.rank=4"]),
        "ppo": (PPOConfig, ["actor=sft/final", "reward=[{reward: a.py:f, weight: 2}, {reward: b.py:g}]",
                            f"data.prompts={tmp_path / 'prompts.jsonl'}", "train.max_steps=2"]),
        "grpo": (PPOConfig, AGENT),
    }
    for name, (cls, overrides) in runs.items():
        run = _run_folder(tmp_path / name, cls, overrides, "ppo" if cls is PPOConfig else name)
        html = write_report(run).read_text()
        ran = _ran_table(html, "<h2>")
        assert ran and not {row: text for row, text in ran.items() if RULE.search(text)}, name
