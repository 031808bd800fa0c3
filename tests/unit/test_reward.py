"""Reward-model pieces: padding-safe scores, every preference format, loss normalisation, resume, config."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from rlhfkit.config import ConfigError, RMConfig, load_config
from rlhfkit.data.loader import load_stage_data
from rlhfkit.data.templates import Template, encode_prompt, encode_response
from rlhfkit.data.tokenize import pad_sequences
from rlhfkit.models import load_scalar_model, load_tokenizer
from rlhfkit.models.forward import sequence_scores
from rlhfkit.models.plan import REFERENCE, ModelPlan
from rlhfkit.models.reward_fn import ModelReward
from rlhfkit.errors import RunError
from rlhfkit.stages.reward import END_IDS_KEY, MEAN_KEY, STD_KEY, run_rm

from conftest import NAMES, ROOT, read_metrics, sharpened, write_jsonl

FIXTURES = ROOT / "tests" / "fixtures" / "formats"
TEXTS = [("say apple", "apple apple apple"), ("say ocean", "ocean"), ("say tiger", "tiger tiger tiger tiger tiger")]


@pytest.fixture(scope="module")
def scalar_model(tiny_model_dir):
    torch.manual_seed(0)
    return load_scalar_model(str(tiny_model_dir), tokenizer=load_tokenizer(str(tiny_model_dir))).eval()


def encode(tok, prompt: str, response: str) -> list[int]:
    tpl = Template.for_tokenizer(tok)
    messages = [{"role": "user", "content": prompt}]
    return encode_prompt(tok, tpl.prompt(messages)) + encode_response(tok, tpl.response(messages, response))


def scores(model, seqs: list[list[int]], pad_id: int, side: str) -> torch.Tensor:
    ids = pad_sequences(seqs, pad_id, side)  # (B, T)
    mask = pad_sequences([[1] * len(s) for s in seqs], 0, side)
    with torch.no_grad():
        return sequence_scores(model, ids, mask, REFERENCE)


@pytest.mark.parametrize("pad_is_eos", [False, True], ids=["pad!=eos", "pad==eos"])
def test_score_is_the_same_alone_left_and_right_padded(tiny_model_dir, scalar_model, pad_is_eos):
    tok = load_tokenizer(str(tiny_model_dir))
    if pad_is_eos:
        tok.pad_token = tok.eos_token  # every response ends with EOS: a pad-id search would stop too early
    seqs = [encode(tok, p, r) for p, r in TEXTS]
    assert len({len(s) for s in seqs}) == 3 and all(s[-1] == tok.eos_token_id for s in seqs)
    alone = torch.cat([scores(scalar_model, [s], tok.pad_token_id, "right") for s in seqs])
    for side in ("left", "right"):
        batched = scores(scalar_model, seqs, tok.pad_token_id, side)
        torch.testing.assert_close(batched, alone, atol=1e-5, rtol=0)
    # the score is really read at the last token: reading one token earlier gives other values
    earlier = torch.cat([scores(scalar_model, [s[:-1]], tok.pad_token_id, "right") for s in seqs])
    assert (earlier - alone).abs().min() > 1e-4


def word_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt": f"say {rng.choice(NAMES)}", "chosen": f"{rng.choice(NAMES)} honey",
             "rejected": " ".join(rng.sample(NAMES, 3))} for _ in range(n)]


def rm_config(model_dir, tmp_path, name: str, **overrides) -> RMConfig:
    train = write_jsonl(tmp_path / "train.jsonl", word_rows(24, 0))
    evals = write_jsonl(tmp_path / "eval.jsonl", word_rows(8, 1))
    items = [f"model={model_dir}", f"output_dir={tmp_path / name}", f"data.train={train}", f"data.eval={evals}",
             "train.lr=1e-3", "train.eval_every=0", "train.save_every=0", "log.tensorboard=false",
             "log.progress=false", "rm.norm_samples=16"] + [f"{k}={v}" for k, v in overrides.items()]
    return load_config(RMConfig, None, items)


def test_micro_batch_times_accumulation_is_invariant(tiny_model_dir, tmp_path):
    # micro 1 x accumulation 8 must give the loss and gradient of micro 8 x accumulation 1 (TRL invariance)
    runs = {}
    for micro in (8, 1):
        cfg = rm_config(tiny_model_dir, tmp_path, f"micro{micro}", **{"train.batch_size": 8,
                        "train.micro_batch_size": micro, "train.max_steps": 1, "rm.margin": 0.5})
        run_rm(cfg)
        runs[micro] = read_metrics(tmp_path / f"micro{micro}" / "metrics.jsonl")[1]
    assert runs[8]["step"] == runs[1]["step"] == 1
    for key in ("loss", "grad_norm", "accuracy", "margin", "chosen", "rejected"):
        assert runs[1][key] == pytest.approx(runs[8][key], rel=1e-5, abs=1e-6), key
    # the margin is in the loss: the mean of -log sigmoid(r_c - r_r - 0.5) over pairs whose mean r_c - r_r is
    # the logged margin; near a linear function over small score gaps, so within Jensen's gap of the value at the
    # mean (measured 0.99344 against 0.99317; without the margin the loss would be ~0.71)
    assert runs[8]["loss"] == pytest.approx(math.log1p(math.exp(0.5 - runs[8]["margin"])), abs=0.01)


def test_resume_continues_to_the_same_model(tiny_model_dir, tmp_path):
    common = {"train.batch_size": 4, "train.micro_batch_size": 2, "train.max_steps": 4}
    straight = run_rm(rm_config(tiny_model_dir, tmp_path, "straight", **common))
    cfg = rm_config(tiny_model_dir, tmp_path, "resumed", **common, **{"train.save_every": 2})
    run_rm(cfg)
    with pytest.raises(RunError, match="already holds a finished run"):
        run_rm(cfg)
    resumed = run_rm(cfg, resume=True)  # continues from checkpoints/step-2 and exports final/ again
    a = load_file(str(tmp_path / "straight" / "final" / "model.safetensors"))
    b = load_file(str(tmp_path / "resumed" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and "score.weight" in a
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-6, rtol=0)
    assert resumed["eval/accuracy"] == straight["eval/accuracy"]
    config = json.loads((tmp_path / "resumed" / "final" / "config.json").read_text())
    assert config[MEAN_KEY] == pytest.approx(straight[MEAN_KEY]) and config[STD_KEY] > 0


def test_config_errors_name_the_key(tiny_model_dir):
    with pytest.raises(ConfigError, match="'rm.margin'"):
        load_config(RMConfig, None, [f"model={tiny_model_dir}", "data.train=x.jsonl", "rm.margin=-1"])
    with pytest.raises(ConfigError, match="unknown config key 'rm.marginn'"):
        load_config(RMConfig, None, [f"model={tiny_model_dir}", "data.train=x.jsonl", "rm.marginn=1"])
    with pytest.raises(ConfigError, match="'model'"):
        load_config(RMConfig, None, ["data.train=x.jsonl"])


PREFERENCE_FIXTURES = ["rm_static.jsonl", "synthetic_gptj.jsonl", "yitingxie.jsonl", "hh_rlhf.jsonl",
                       "chat_pairs.jsonl", "ultrafeedback.jsonl", "shp.jsonl", "webgpt.jsonl"]


@pytest.mark.parametrize("name", PREFERENCE_FIXTURES)
def test_every_preference_format_becomes_pairs_sharing_their_prompt(tiny_model_dir, name):
    # each fixture is written in that dataset's real field layout; the RM sees prompt + side, side ending in EOS
    tok = load_tokenizer(str(tiny_model_dir))
    path = FIXTURES / name
    cfg = load_config(RMConfig, None, [f"model={tiny_model_dir}", f"data.train={path}", "data.eval_fraction=0"]).data
    data = load_stage_data("rm", cfg, tok, seed=0)
    assert data.train and not data.eval
    for row in data.train:
        n = row["prompt_len"]
        assert row["chosen_ids"][:n] == row["rejected_ids"][:n] and row["chosen_ids"] != row["rejected_ids"]
        assert row["chosen_ids"][-1] == row["rejected_ids"][-1] == tok.eos_token_id


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model as a chat model whose turns end with <|im_end|>, which is not its tokenizer's EOS but is in
    its generation_config's eos_token_id (as Llama 3's <|eot_id|>)."""
    folder = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(tiny_model_dir, folder)
    tok = load_tokenizer(str(folder))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id, im_end]}))
    return folder


def test_rm_data_ends_where_the_actor_stops_and_the_rm_records_it(chat_model_dir, tmp_path):
    tok = load_tokenizer(str(chat_model_dir))
    eos, im_end = tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")
    result = run_rm(rm_config(chat_model_dir, tmp_path, "rm", **{"train.batch_size": 4,
                                                                 "train.micro_batch_size": 4, "train.max_steps": 1}))
    assert result["template"] == "chat" and result[END_IDS_KEY] == sorted([eos, im_end])
    final = tmp_path / "rm" / "final"
    assert json.loads((final / "config.json").read_text())[END_IDS_KEY] == sorted([eos, im_end])
    # each side ends with the template's one <|im_end|>: no "\n" after it, no EOS appended
    cfg = rm_config(chat_model_dir, tmp_path, "unused").data
    rows = load_stage_data("rm", cfg, tok, seed=0, end_ids=result[END_IDS_KEY]).train
    for side in ("chosen_ids", "rejected_ids"):
        assert all(row[side][-1] == im_end and im_end not in row[side][row["prompt_len"]:-1] for row in rows)
    # PPO: the RM shares the actor's tokenizer, template and end ids, so it scores rollout ids as they are
    rm = load_scalar_model(str(final), tokenizer=load_tokenizer(str(final)))
    actor = Template.for_tokenizer(tok, "auto", [eos, im_end])
    assert not ModelReward(rm, load_tokenizer(str(final)), actor, "auto", 4, torch.device("cpu")).retokenize
    # an actor stopping at EOS only would write responses this RM never saw: they are re-rendered for it
    assert ModelReward(rm, load_tokenizer(str(final)), Template.for_tokenizer(tok), "auto", 4,
                       torch.device("cpu")).retokenize


def test_a_folder_trained_plain_is_rendered_plain_downstream(chat_model_dir, tmp_path):
    """SFT with data.template=plain on a chat tokenizer records it in final/config.json; the RM step, PPO and
    `rlhfkit chat` then render plain by default (auto would give chat turns the model never saw)."""
    from rlhfkit.chat import ChatModel
    from rlhfkit.config import SFTConfig
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.stages.common import with_trained_template
    from rlhfkit.stages.reward import TEMPLATE_KEY
    from rlhfkit.stages.sft import run_sft

    from conftest import sft_rows

    sft = load_config(SFTConfig, None, [f"model={chat_model_dir}", f"output_dir={tmp_path / 'sft'}",
                                        f"data.train={write_jsonl(tmp_path / 'sft.jsonl', sft_rows())}",
                                        "data.template=plain", "data.eval_fraction=0", "train.max_steps=1",
                                        "train.batch_size=4", "train.micro_batch_size=4", "log.tensorboard=false",
                                        "log.progress=false"])
    assert run_sft(sft)["template"] == "plain"
    final = tmp_path / "sft" / "final"
    assert json.loads((final / "config.json").read_text())[TEMPLATE_KEY] == "plain"
    result = run_rm(rm_config(final, tmp_path, "rm", **{"train.batch_size": 4, "train.micro_batch_size": 4,
                                                        "train.max_steps": 1}))
    assert result["template"] == "plain"
    ppo = load_config(PPOConfig, None, [f"actor={final}", f"reward={tmp_path / 'rm' / 'final'}",
                                        "data.prompts=prompts.jsonl", "train.max_steps=1"])
    tok = load_tokenizer(str(final))
    assert with_trained_template(ppo, str(final), tok).data.template == "plain"
    assert ChatModel(str(final)).template.name == "plain"
    # an explicit setting still wins, and a folder rlhfkit did not train plain keeps auto's chat
    assert ChatModel(str(final), "chat").template.name == "chat"
    assert with_trained_template(ppo, str(chat_model_dir), tok).data.template == "auto"


def test_packed_pairs_score_and_train_as_padded_ones(tiny_model_dir):
    """Chosen and rejected sequences packed without padding (positions restarting per sequence, each score
    read at its sequence's last token) give the padded batch's scores and the same gradients."""
    from rlhfkit.models.stage_forward import pair_scores
    from rlhfkit.speed.checks import rm_packing_is_exact

    plan = ModelPlan(segment_attention=True, packing=True)

    tok = load_tokenizer(str(tiny_model_dir))
    model = sharpened(load_scalar_model(str(tiny_model_dir), tokenizer=tok))
    g = torch.Generator().manual_seed(0)
    rows = [{"chosen_ids": torch.randint(3, len(tok), (n,), generator=g).tolist(),
             "rejected_ids": torch.randint(3, len(tok), (m,), generator=g).tolist()} for n, m in ((7, 3), (5, 9), (2, 4))]

    def scores_and_grads(packed):
        model.zero_grad()
        chosen, rejected = pair_scores(model, rows, tok.pad_token_id, torch.device("cpu"), plan, packed)
        (chosen - 2 * rejected).sum().backward()
        return torch.cat([chosen, rejected]).detach(), [p.grad.clone() for p in model.parameters()]

    padded, padded_grads = scores_and_grads(False)
    packed, packed_grads = scores_and_grads(True)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    for a, b in zip(packed_grads, padded_grads):  # float rounding relative to each gradient's scale
        torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()) + 1e-6, rtol=1e-3)
    assert rm_packing_is_exact(model, plan, rows, tok.pad_token_id, torch.device("cpu"))


@pytest.mark.parametrize("forward_batch_size, rows", [(None, 4), (6, 6)])
def test_the_reward_models_scoring_takes_the_no_grad_forward_batch_size(tiny_model_dir, tmp_path, forward_batch_size,
                                                                         rows):
    """A reward-model folder's scores run `ppo.forward_batch_size` rows per forward (the other no-grad forwards of
    experience making take it too), the training micro-batch when it is null."""
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.engine.local import LocalEngine
    from rlhfkit.stages.ppo_setup import load_rollout_reward_model

    folder = tmp_path / "rm"
    load_scalar_model(str(tiny_model_dir), tokenizer=load_tokenizer(str(tiny_model_dir))).save_pretrained(folder)
    shutil.copy(tiny_model_dir / "tokenizer.json", folder / "tokenizer.json")
    shutil.copy(tiny_model_dir / "tokenizer_config.json", folder / "tokenizer_config.json")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "say hi"}])
    cfg = load_config(PPOConfig, None, [f"actor={tiny_model_dir}", f"reward={folder}", f"data.prompts={prompts}",
                                        "train.micro_batch_size=4", "train.batch_size=8", "train.max_steps=1",
                                        f"ppo.forward_batch_size={forward_batch_size or 'null'}"])
    reward, _ = load_rollout_reward_model(str(folder), cfg, load_tokenizer(str(tiny_model_dir)), LocalEngine())
    assert reward.micro == rows
