"""The bad-input table: every case exits with code 2 and ONE line naming the file, line and field (or the key, or
the folder), before any training starts, leaving no output folder behind (or an existing one untouched).

The cases run `rlhfkit.cli.main` in-process, exactly what the `rlhfkit` entry point calls (one import of torch
for the whole table keeps it fast); three of them also run through a real `python -m rlhfkit` subprocess.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from rlhfkit.cli import main as cli_main
from rlhfkit.config import DataConfig
from rlhfkit.errors import DataError
from rlhfkit.data.loader import load_stage_data
from rlhfkit.models import load_tokenizer

from conftest import NAMES, run_cli, sft_rows, write_jsonl


@pytest.fixture(scope="module")
def world(tiny_model_dir, tmp_path_factory) -> dict:
    """Model folders with one defect each, next to the good tiny model."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from rlhfkit.demo.tiny import build_tiny_llama, build_tokenizer, save_model_folder

    root = tmp_path_factory.mktemp("bad-models")
    tok = load_tokenizer(str(tiny_model_dir))
    no_tok = root / "no-tokenizer"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, no_tok / name)
    for folder, cleared in (("no-pad", ("pad_token",)), ("no-pad-no-eos", ("pad_token", "eos_token"))):
        shutil.copytree(tiny_model_dir, root / folder)
        bare = load_tokenizer(str(tiny_model_dir))
        for attribute in cleared:
            setattr(bare, attribute, None)
        bare.save_pretrained(root / folder)
    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=2)
    two = AutoModelForSequenceClassification.from_config(config)
    save_model_folder(two, tok, root / "two-label-rm")
    one = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(tiny_model_dir, num_labels=1))
    one.config.update({"rlhfkit_reward_mean": 0.25, "rlhfkit_reward_std": 0.0})  # scores that did not vary
    save_model_folder(one, tok, root / "flat-rm")
    other = build_tokenizer([f"Human: tell {n}\nBot: {n}" for n in NAMES] * 3, vocab_size=300)
    save_model_folder(build_tiny_llama(len(other)), other, root / "other-vocab")
    damaged = root / "damaged-weights"  # a copy cut short (a disk that filled up, an interrupted transfer)
    shutil.copytree(tiny_model_dir, damaged)
    weights = (damaged / "model.safetensors").read_bytes()
    (damaged / "model.safetensors").write_bytes(weights[:len(weights) // 2])
    reward = root / "reward.py"
    reward.write_text("def score(prompts, responses):\n    return [0.0] * len(prompts)\n")
    return {"model": tiny_model_dir, "root": root, "reward": f"{reward}:score"}


def pairs(n: int = 8) -> list[dict]:
    return [{"prompt": f"say {name}", "chosen": f"{name} {name}", "rejected": "no"} for name in NAMES[:n]]


# A case: (tmp_path, world) -> (verb, command-line arguments, the expected error after "rlhfkit VERB: error: ").
# Common arguments (model, output_dir, a one-step plan, the cache folder) are added unless the case sets them.


def malformed_json(tmp, w):
    path = tmp / "train.jsonl"
    path.write_text(json.dumps(sft_rows()[0]) + '\n\n{"prompt": "say apple", "response": }\n')
    return "sft", [f"data.train={path}"], f"{path}:3: invalid JSON: Expecting value (column 37)"


def missing_field(tmp, w):
    path = write_jsonl(tmp / "train.jsonl", [sft_rows()[0], {"prompt": "say river"}])
    return "sft", [f"data.train={path}"], f"{path}:2: field 'response': missing (row has keys: prompt)"


def whitespace_response(tmp, w):
    # by default such a row is skipped and counted (see test_unusable_rows_are_skipped_and_counted_unless_strict)
    path = write_jsonl(tmp / "train.jsonl", [sft_rows()[0], {"prompt": "say river", "response": " \n\t "}])
    return "sft", [f"data.train={path}", "data.strict_rows=true"], f"{path}:2: field 'response': empty"


def all_pairs_identical(tmp, w):
    path = write_jsonl(tmp / "pairs.jsonl", [{"prompt": f"say {n}", "chosen": n, "rejected": n} for n in NAMES[:6]])
    return "rm", [f"data.train={path}"], (f"data '{path}': no training rows left after filtering: 6 rows read; "
                                           f"6 skipped: chosen identical to rejected")


def long_prompt_error(tmp, w):
    path = write_jsonl(tmp / "train.jsonl", sft_rows())
    return "sft", [f"data.train={path}", "data.max_length=5", "data.on_long_prompt=error"], (
        f"{path}:1: the prompt is 10 tokens once rendered, not shorter than data.max_length=5 "
        f"(data.on_long_prompt=error: raise data.max_length, or set data.on_long_prompt=drop to skip and count "
        f"such rows)")


def every_prompt_too_long(tmp, w):
    path = write_jsonl(tmp / "train.jsonl", sft_rows())
    return "sft", [f"data.train={path}", "data.max_length=5"], (
        f"data '{path}': no training rows left after filtering: 80 rows read (4 held out for evaluation); 76 "
        f"dropped by data.max_length=5 (prompt too long)")


def text_rows_for_rm(tmp, w):
    path = write_jsonl(tmp / "text.jsonl", [{"text": "Once upon a time"}] * 4)
    return "rm", [f"data.train={path}"], (
        f"{path}:1: cannot detect a preference format from keys (text); known formats: webgpt, shp, chat_pairs, "
        f"prompt_chosen_rejected, hh_dialogue, sharegpt_pairs; plain {{text}} rows are pretraining text, not "
        f"prompt/response data; map columns with data.fields, e.g. 'data.fields={{prompt: question, chosen: "
        f"better, rejected: worse}}'")


def sft_rows_for_rm(tmp, w):
    path = write_jsonl(tmp / "sft.jsonl", sft_rows())
    return "rm", [f"data.train={path}"], (
        f"{path}:1: cannot detect a preference format from keys (prompt, response); known formats: webgpt, shp, "
        f"chat_pairs, prompt_chosen_rejected, hh_dialogue, sharegpt_pairs; map columns with data.fields, e.g. "
        f"'data.fields={{prompt: question, chosen: better, rejected: worse}}'")


def empty_file(tmp, w):
    path = tmp / "train.jsonl"
    path.write_text("\n  \n")
    return "sft", [f"data.train={path}"], f"{path}: no rows"


def non_utf8_file(tmp, w):
    path = tmp / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "say apple", "response": "ok"}\n{"prompt": "caf\xe9", "response": "ok"}\n')
    return "sft", [f"data.train={path}"], f"{path}:2: not UTF-8 text (byte b'\\xe9'); re-save the file as UTF-8"


def preset_without_local_copy(tmp, w):
    empty = tmp / "datasets"
    return "sft", ["data.train=Dahoas/rm-static", f"data.local_dir={empty}"], (
        f"dataset 'Dahoas/rm-static' is not available offline and has no local copy in {empty}: put it at "
        f"{empty}/Dahoas/rm-static/ (a save_to_disk folder, or its split files: train.jsonl, test.jsonl, or the "
        f"hub's data/*.parquet) or at {empty}/Dahoas/rm-static.jsonl (one file: the train split)")


def split_index_out_of_range(tmp, w):
    path = write_jsonl(tmp / "pairs.jsonl", pairs())
    return "rm", [f"data.train={path}", "data.split_fractions=[2,4,4]", "data.split_index=3"], (
        "config key 'data.split_index': 3 is not a share of data.split_fractions [2, 4, 4] (0 to 2)")


def model_folder_missing(tmp, w):
    path = write_jsonl(tmp / "train.jsonl", sft_rows())
    return "sft", [f"data.train={path}", f"model={tmp / 'nope'}"], f"model folder '{tmp / 'nope'}' does not exist"


def folder_without_tokenizer(tmp, w):
    path, folder = write_jsonl(tmp / "train.jsonl", sft_rows()), w["root"] / "no-tokenizer"
    return "sft", [f"data.train={path}", f"model={folder}"], (
        f"model folder '{folder}' has no tokenizer (none of tokenizer.json, tokenizer_config.json, tokenizer.model, "
        f"vocab.json, spiece.model, vocab.txt): copy the tokenizer files of its base model there, or set "
        f"load.tokenizer to a folder that has them")


def tokenizer_without_pad_or_eos(tmp, w):
    path, folder = write_jsonl(tmp / "train.jsonl", sft_rows()), w["root"] / "no-pad-no-eos"
    return "sft", [f"data.train={path}", f"model={folder}"], (
        f"tokenizer in '{folder}' has no EOS token and no pad token: responses could never end; set eos_token in "
        f"its tokenizer_config.json")


def damaged_weights(tmp, w):
    path, folder = write_jsonl(tmp / "train.jsonl", sft_rows()), w["root"] / "damaged-weights"
    return "sft", [f"data.train={path}", f"model={folder}"], (
        f"cannot load a causal LM from '{folder}': its safetensors weights are damaged or incomplete (Error while "
        f"deserializing header: incomplete metadata, file not fully covered); copy or save the folder again")


def two_label_head_for_rm(tmp, w):
    path, folder = write_jsonl(tmp / "pairs.jsonl", pairs()), w["root"] / "two-label-rm"
    return "rm", [f"data.train={path}", f"model={folder}"], (
        f"'{folder}' has a 2-output score head (num_labels=2 in its config.json); a reward model or critic needs "
        f"exactly 1: train one with `rlhfkit rm`")


def ppo_args(tmp, w, **keys) -> list[str]:
    prompts = write_jsonl(tmp / "prompts.jsonl", [{"prompt": f"say {n}"} for n in NAMES])
    keys = {"actor": w["model"], "reward": w["reward"], "data.prompts": prompts, **keys}
    return [f"{k}={v}" for k, v in keys.items()]


def two_label_head_as_ppo_reward(tmp, w):
    folder = w["root"] / "two-label-rm"
    return "ppo", ppo_args(tmp, w, reward=folder), (
        f"'{folder}' has a 2-output score head (num_labels=2 in its config.json); a reward model or critic needs "
        f"exactly 1: train one with `rlhfkit rm`")


def reward_model_whose_scores_did_not_vary(tmp, w):
    folder = w["root"] / "flat-rm"
    return "ppo", ppo_args(tmp, w, reward=folder, **{"ppo.normalize_reward": "true"}), (
        f"ppo.normalize_reward is true but '{folder}/config.json' has rlhfkit_reward_std 0.0 (its scores did not "
        f"vary when measured): dividing by it would blow every score up; set ppo.normalize_reward=false")


def one_sample_for_the_reward_std(tmp, w):
    path = write_jsonl(tmp / "pairs.jsonl", pairs())
    return "rm", [f"data.train={path}", "rm.norm_samples=1"], (
        "config key 'rm.norm_samples': must be 0 (skip) or >= 2 (a standard deviation needs two scores), got 1")


def not_a_causal_lm(folder) -> str:
    return (f"'{folder}' is a reward model or critic (a scalar head: LlamaForSequenceClassification), not a causal "
            f"LM: train or chat from an sft / dpo / ppo final/ folder or a base model")


def reward_model_as_sft_model(tmp, w):
    path, folder = write_jsonl(tmp / "train.jsonl", sft_rows()), w["root"] / "two-label-rm"
    return "sft", [f"data.train={path}", f"model={folder}"], not_a_causal_lm(folder)


def reward_model_as_ppo_actor(tmp, w):
    folder = w["root"] / "two-label-rm"
    return "ppo", ppo_args(tmp, w, actor=folder), not_a_causal_lm(folder)


def reward_function_without_its_column(tmp, w):
    reward = tmp / "checks.py"
    reward.write_text("def exact(prompts, responses, answer):\n    return [0.0] * len(prompts)\n")
    return "ppo", ppo_args(tmp, w, reward=f"{reward}:exact"), (
        f"reward function 'exact' ({reward}:1) takes a parameter 'answer' that the prompt rows do not have (they "
        f"have: prompt): rename it to one of those, or give it a default")


def critic_with_another_vocabulary(tmp, w):
    folder = w["root"] / "other-vocab"
    return "ppo", ppo_args(tmp, w, critic=folder), (
        f"critic '{folder}' has a different tokenizer from the actor's; the critic reads the actor's token ids, so "
        f"it must share its vocabulary")


def finished_run_folder(tmp) -> None:
    """An earlier finished run in output_dir, which a --force run that fails on bad input must leave as it was."""
    (tmp / "out" / "final").mkdir(parents=True)
    (tmp / "out" / "final" / "model.safetensors").write_bytes(b"weights of a finished run")
    (tmp / "out" / "config.yaml").write_text("model: earlier\n")


def dpo_reference_with_another_vocabulary_under_force(tmp, w):
    finished_run_folder(tmp)
    folder = w["root"] / "other-vocab"
    data = write_jsonl(tmp / "pairs.jsonl", pairs())
    return "dpo", [f"data.train={data}", f"reference={folder}", "--force"], (
        f"reference '{folder}' has a different tokenizer from the policy's; it reads the policy's token ids, so it "
        f"must share its vocabulary")


def wandb_missing_under_force(tmp, w):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    finished_run_folder(tmp)
    return "sft", [f"data.train={write_jsonl(tmp / 'train.jsonl', sft_rows())}", "log.wandb=true", "--force"], (
        "config key 'log.wandb': true, but wandb is not installed (pip install wandb)")


def chat_template_the_tokenizer_lacks(tmp, w):
    return "sft", [f"data.train={write_jsonl(tmp / 'train.jsonl', sft_rows())}", "data.template=chat"], (
        "config key 'data.template': 'chat' needs a chat template and the tokenizer has none; use 'plain' or "
        "'auto'")


def lora_target_matching_no_layer(tmp, w):
    return "sft", [f"data.train={write_jsonl(tmp / 'train.jsonl', sft_rows())}", "lora.rank=2",
                   "lora.target_modules=[qproj]"], (
        "config key 'lora.target_modules': ['qproj'] matches no layer of this llama model; its linear layers are "
        "named down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj")


def prompts_of_the_wrong_kind(tmp, w):
    return "ppo", [f"actor={w['model']}", f"reward={w['reward']}", "data.prompts=5"], (
        "config key 'data.prompts': expected a path or a list of {path, weight}, got 5")


def yaml_unknown_key(tmp, w):
    path = tmp / "sft.yaml"
    path.write_text(f"model: {w['model']}\ndata: {{train: x.jsonl}}\ntrain: {{lr: 1.0e-4, lrr: 1}}\n")
    return "sft", ["--config", str(path), "model=", "data.train="], (
        "unknown config key 'train.lrr': did you mean 'train.lr'?")


def yaml_wrong_type(tmp, w):
    path = tmp / "sft.yaml"
    path.write_text(f"model: {w['model']}\ndata: {{train: x.jsonl, max_length: long}}\n")
    return "sft", ["--config", str(path), "model=", "data.train="], (
        "config key 'data.max_length': expected int, got 'long'")


def finished_run(tmp, w):
    path = write_jsonl(tmp / "train.jsonl", sft_rows())
    (tmp / "out" / "final").mkdir(parents=True)
    (tmp / "out" / "final" / "model.safetensors").write_bytes(b"weights of a finished run")
    (tmp / "out" / "metrics.jsonl").write_text('{"step": 1, "stage": "sft", "loss": 1.0}\n')
    return "sft", [f"data.train={path}"], (
        f"output_dir '{tmp / 'out'}' already holds a finished run (final/ exists): pass --force to overwrite it, "
        f"--resume to continue from its checkpoints, or choose another output_dir")


def unfinished_run(tmp, w):
    path = write_jsonl(tmp / "train.jsonl", sft_rows())
    (tmp / "out" / "checkpoints" / "step-00000002").mkdir(parents=True)
    (tmp / "out" / "checkpoints" / "latest").write_text("step-00000002")
    (tmp / "out" / "metrics.jsonl").write_text('{"step": 1, "stage": "sft", "loss": 1.0}\n')
    return "sft", [f"data.train={path}"], (
        f"output_dir '{tmp / 'out'}' holds an unfinished run (checkpoint step-00000002): pass --resume to continue "
        f"it, --force to start over, or choose another output_dir")


def resume_without_checkpoint(tmp, w):
    path = write_jsonl(tmp / "train.jsonl", sft_rows())
    return "sft", [f"data.train={path}", "--resume"], (
        f"--resume: no checkpoint in '{tmp / 'out' / 'checkpoints'}' to resume from")


def resume_and_force_together(tmp, w):
    finished_run_folder(tmp)
    return "sft", [f"data.train={write_jsonl(tmp / 'train.jsonl', sft_rows())}", "--resume", "--force"], (
        "--resume continues a run and --force starts it over: pass one of them")


CASES = {fn.__name__: fn for fn in (
    malformed_json, missing_field, whitespace_response, all_pairs_identical, long_prompt_error,
    every_prompt_too_long, text_rows_for_rm, sft_rows_for_rm, empty_file, non_utf8_file, preset_without_local_copy,
    split_index_out_of_range, model_folder_missing, folder_without_tokenizer, damaged_weights,
    tokenizer_without_pad_or_eos,
    two_label_head_for_rm, two_label_head_as_ppo_reward, reward_model_whose_scores_did_not_vary,
    one_sample_for_the_reward_std, reward_model_as_sft_model, reward_model_as_ppo_actor,
    reward_function_without_its_column, critic_with_another_vocabulary,
    dpo_reference_with_another_vocabulary_under_force, wandb_missing_under_force,
    chat_template_the_tokenizer_lacks, lora_target_matching_no_layer, prompts_of_the_wrong_kind, yaml_unknown_key,
    yaml_wrong_type, finished_run, unfinished_run, resume_without_checkpoint, resume_and_force_together)}


def command(tmp: Path, w: dict, case) -> tuple[str, list[str], str]:
    verb, args, expected = case(tmp, w)
    common = {"model": w["model"], "output_dir": tmp / "out", "train.batch_size": 4, "train.micro_batch_size": 4,
              "train.max_steps": 1, "log.tensorboard": "false", "data.cache_dir": tmp / "cache"}
    if verb == "ppo":  # ppo has no `model` (actor instead) and reads prompts without the data cache options
        common = {k: v for k, v in common.items() if k not in ("model", "data.cache_dir")}
    given = {a.split("=", 1)[0] for a in args if "=" in a}
    extra = [f"{k}={v}" for k, v in common.items() if k not in given]
    args = [a for a in args if not a.endswith("=")]  # "key=" only marks a common key the case leaves out
    return verb, extra + args, expected


def tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()} \
        if folder.exists() else {}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_fails_early_with_one_clear_line(tmp_path, world, capsys, name):
    verb, args, expected = command(tmp_path, world, CASES[name])
    before = tree(tmp_path / "out")
    code = cli_main([verb, *args])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines()[-1] == f"rlhfkit {verb}: error: {expected}"
    assert f"{verb}: " not in err.replace(f"rlhfkit {verb}: error: ", "")  # no stage log line: training never began
    assert tree(tmp_path / "out") == before  # absent, or the finished run untouched
    assert (tmp_path / "out").exists() == bool(before)


@pytest.mark.parametrize("name", ["malformed_json", "finished_run", "yaml_unknown_key"])
def test_the_real_entry_point_agrees(tmp_path, world, name):
    verb, args, expected = command(tmp_path, world, CASES[name])
    before = tree(tmp_path / "out")
    res = run_cli(verb, *args)
    assert res.returncode == 2 and res.stderr.strip().splitlines()[-1] == f"rlhfkit {verb}: error: {expected}"
    assert tree(tmp_path / "out") == before


@pytest.mark.parametrize("body,expected", [
    ("    return {}['answer']", "raised KeyError: 'answer' (at {file}:2 in score)"),
    ("    return [float('nan')] * len(responses)", "returned nan for response 0 ("),
    ("    return ['1'] * len(responses)", "returned a string ('1') for response 0: return a number, or None"),
])
def test_a_reward_that_fails_on_the_first_responses_leaves_no_run_behind(tmp_path, world, body, expected):
    """Bad input that shows only when PPO first calls the reward: one clear line, exit 2, and no output folder."""
    reward = tmp_path / "bad_reward.py"
    reward.write_text(f"def score(prompts, responses):\n{body}\n")
    verb, args, _ = command(tmp_path, world, lambda tmp, w: ("ppo", ppo_args(tmp, w, reward=f"{reward}:score"), ""))
    res = run_cli(verb, *args, "data.eval_fraction=0", "gen.max_new_tokens=4", "log.tensorboard=true")
    assert res.returncode == 2, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rlhfkit ppo: error: reward '{reward}:score' ")
    assert expected.format(file=reward) in last
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- what is NOT an error, documented in README


def test_a_tokenizer_without_pad_token_pads_with_eos_and_trains(tmp_path, world):
    folder = world["root"] / "no-pad"
    tok = load_tokenizer(str(folder))
    assert tok.pad_token == tok.eos_token == "</s>"
    path = write_jsonl(tmp_path / "train.jsonl", sft_rows())
    code = cli_main(["sft", f"model={folder}", f"data.train={path}", f"output_dir={tmp_path / 'out'}",
                     "train.batch_size=4", "train.micro_batch_size=4", "train.max_steps=1", "train.eval_every=0",
                     "log.tensorboard=false", f"data.cache_dir={tmp_path / 'cache'}"])
    assert code == 0 and (tmp_path / "out" / "final" / "model.safetensors").is_file()


def test_some_identical_pairs_and_long_prompts_are_skipped_and_counted(tmp_path, world):
    tok = load_tokenizer(str(world["model"]))
    rows = pairs(6) + [{"prompt": "say apple", "chosen": "same", "rejected": "same"},
                       {"prompt": "say " + "apple " * 40, "chosen": "a", "rejected": "b"}]
    cfg = DataConfig(train=str(write_jsonl(tmp_path / "pairs.jsonl", rows)), eval_fraction=0.0, max_length=32,
                     cache=False)
    info = load_stage_data("rm", cfg, tok, seed=0).info
    assert (info["train_rows"], info["identical"], info["dropped"], info["rows_read"]) == (6, 1, 1, 8)
    with pytest.raises(DataError, match=re.escape(f"{cfg.train}:8: the prompt is")):
        load_stage_data("rm", dataclasses.replace(cfg, on_long_prompt="error"), tok, seed=0)


def test_unusable_rows_are_skipped_and_counted_unless_strict(tmp_path, world):
    tok = load_tokenizer(str(world["model"]))
    rows = sft_rows()[:6] + [{"prompt": "say river", "response": " \n\t "},
                             {"prompt": [{"role": "assistant", "content": "hi"}], "response": "x"}]
    cfg = DataConfig(train=str(write_jsonl(tmp_path / "train.jsonl", rows)), eval_fraction=0.0, cache=False)
    info = load_stage_data("sft", cfg, tok, seed=0).info
    assert (info["train_rows"], info["empty_response"], info["no_user_turn"], info["rows_read"]) == (6, 1, 1, 8)
    with pytest.raises(DataError, match=re.escape(f"{cfg.train}:7: field 'response': empty")):
        load_stage_data("sft", dataclasses.replace(cfg, strict_rows=True), tok, seed=0)
    empty = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": "say river", "response": " "}] * 3)
    with pytest.raises(DataError) as error:  # nothing usable left: the error says why
        load_stage_data("sft", dataclasses.replace(cfg, train=str(empty)), tok, seed=0)
    assert str(error.value) == (f"data '{empty}': no training rows left after filtering: 3 rows read; 3 skipped: "
                                f"the response (or chosen reply) is empty")


def test_score_names_its_own_flag_for_renaming_columns(tmp_path, world, capsys):
    """The format error's hint is `--field` for `rlhfkit score` (its stages' `data.fields` is no flag of it), and
    it comes before the reward model is loaded."""
    rows = write_jsonl(tmp_path / "q.jsonl", [{"question": "q", "reply": "a"}])
    assert cli_main(["score", str(world["root"] / "no-tokenizer"), "--data", str(rows), "--output",
                     str(tmp_path / "o.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"rlhfkit score: error: {rows}:1: cannot detect a sft format from keys (question, reply); known formats: "
        f"webgpt, shp, chat_pairs, prompt_chosen_rejected, hh_dialogue, sharegpt_pairs, messages, sharegpt, alpaca, "
        f"prompt_response; map columns with --field, e.g. --field prompt=question --field response=answer")
    assert not (tmp_path / "o.jsonl").exists()
