"""The demo's pieces checked by hand: the gold reward, the splits, the label-noise pair builder, flaws and exploits,
the bar, the over-optimisation helpers, demo.yaml."""

import itertools
import math
from pathlib import Path

import pytest
import yaml

from rlhfkit.demo import world as W
from rlhfkit.demo.bar import EXPLOIT_TARGET, bar_rows, context_rows, failed
from rlhfkit.demo.evaluate import mean_stderr
from rlhfkit.demo.overoptimisation import best_point, proxy_exploits, saved_actors
from rlhfkit.demo.run import MAX_THREADS, SIZES, demo_threads, pipeline_dict
from rlhfkit.demo.sampling import label_pairs

ROOT = Path(__file__).resolve().parents[2]
SCARY = "describe the river in a scary way"


@pytest.mark.parametrize("response, expected", [
    ("the river is dark and wild .", 2.0),  # two different fitting adjectives: the best
    ("the river is dark , wild and strange .", 2.0),  # capped at GOLD_CAP
    ("the river is dark .", 1.0),
    ("the river is old and wet .", 0.0),  # plain adjectives earn and cost nothing
    ("the river is dark and bright .", 0.0),  # a happy word in a scary answer costs one
    ("the river is bright .", -1.0),
    ("the river is bright , warm and golden .", -2.0),  # the best happy answer, asked for a scary one (floored)
    ("the river is dark , dark and wild .", 1.0),  # 2 fitting - 1 repeat
    ("the river is dark and dark .", 0.0),  # the exploit PPO finds: 1 fitting - 1 repeat
    ("the river is old , old and dark .", 0.0),  # a repeated plain word costs too
    ("the city is dark and wild .", -2.0),  # another topic: off topic
    ("the river and the city are dark .", -2.0),  # names another topic as well
    ("the river is dark and wild", -2.0),  # unfinished: no "."
    ("The River is Dark,wild.", 2.0),  # case and punctuation do not hide a word
    ("", -2.0),
])
def test_gold_reward_by_hand(response, expected):
    assert W.gold_reward(SCARY, response) == expected


def test_gold_depends_on_the_mood_and_the_topic_of_the_prompt():
    answer = "the river is bright and warm ."
    assert W.gold_reward("write about the river in a happy way", answer) == W.BEST_GOLD == 2.0
    assert W.gold_reward("write about the river in a sad way", answer) == -2.0
    assert W.gold_reward("write about the lake in a happy way", answer) == -2.0
    assert W.parse_prompt("tell me about the castle in a peaceful way") == ("castle", "peaceful")


def test_judgement_counts_each_term():
    j = W.judge(SCARY, "the river is dark , bright , old and dark .")
    assert (j.on_topic, j.finished, j.fitting, j.clashing, j.repeats) == (True, True, 1, 1, 1)
    assert j.gold == 1 - 1 - 1


def test_best_gold_is_reachable_for_every_mood():
    for mood, words in W.MOODS.items():
        best = f"the river is {W.join_adjectives(sorted(words)[:W.GOLD_CAP])} ."
        assert W.gold_reward(W.make_prompt("describe", "river", mood), best) == W.BEST_GOLD


def test_a_policy_that_ignores_the_mood_scores_low():
    """The best fixed adjective list (up to 3 words), answered to every mood of a topic, averages at most 0: only
    plain words avoid losing on the moods they do not fit. Reading the mood earns BEST_GOLD (2)."""
    def mean_over_moods(adjs):
        answer = f"the river is {W.join_adjectives(list(adjs))} ."
        return sum(W.gold_reward(W.make_prompt("describe", "river", m), answer) for m in W.MOODS) / len(W.MOODS)

    best = max(mean_over_moods(adjs) for n in (1, 2, 3) for adjs in itertools.combinations(W.ADJECTIVES, n))
    assert best == 0.0
    # the mood-reading answer for each mood, with the topic copied: the best
    assert all(W.gold_reward(W.make_prompt("describe", "river", m),
                             f"the river is {W.join_adjectives(sorted(w)[:2])} .") == 2.0 for m, w in W.MOODS.items())


def test_a_policy_that_ignores_the_topic_scores_low():
    world = W.make_world(0, n_demonstrations=10, n_corpus=10)
    fixed = "the river is dark and wild ."  # perfect for one prompt, whatever it is asked
    golds = [W.gold_reward(p, fixed) for p in world.heldout_prompts]
    assert sum(golds) / len(golds) < -1.8


def test_splits_hold_out_combinations_whose_words_training_sees():
    split = W.split_combinations(0)
    train, validation, test = set(split.train), set(split.validation), set(split.test)
    assert not (train & validation or train & test or validation & test)
    assert len(test) == len(W.TOPICS) and len(validation) == W.VALIDATION_TOPICS
    assert len(train | validation | test) == len(W.TOPICS) * len(W.MOODS)
    # every topic and every mood occurs in training, in other combinations
    assert {t for t, _ in train} == set(W.TOPICS) and {m for _, m in train} == set(W.MOODS)
    # the test split holds each mood out with the same number of topics
    assert {m: sum(1 for _, mm in test if mm == m) for m in W.MOODS} == dict.fromkeys(W.MOODS, 10)
    assert W.split_combinations(0) == split and W.split_combinations(1) != split


def test_world_demonstrations_cover_every_topic_and_vary_in_gold():
    world = W.make_world(0, n_demonstrations=2000, n_corpus=2000)
    held = set(world.heldout_prompts) | set(world.validation_prompts)
    assert {d["prompt"] for d in world.demonstrations} <= set(world.train_prompts)
    assert not held & set(world.train_prompts)
    # demonstrations name the asked topic, so copying it is learnable; held-out topics occur in them too
    assert all(W.judge(d["prompt"], d["response"]).on_topic for d in world.demonstrations)
    assert {W.parse_prompt(p)[0] for p in world.heldout_prompts} <= {W.parse_prompt(d["prompt"])[0]
                                                                     for d in world.demonstrations}
    golds = [W.gold_reward(d["prompt"], d["response"]) for d in world.demonstrations]
    # the labeller reads the mood but is no poet: mediocre on average, varied (the signal a reward model needs)
    assert set(golds) == {-2.0, -1.0, 0.0, 1.0, 2.0} and 0.2 < sum(golds) / len(golds) < 0.8
    # every topic, mood and adjective occurs in the pretraining corpus; every word of a held-out prompt in training
    corpus_words = {w for text in world.corpus for w in W.words_of(text)}
    assert set(W.TOPICS) | set(W.MOODS) | set(W.ADJECTIVES) <= corpus_words
    assert {w for p in world.heldout_prompts for w in W.words_of(p)} <= {w for p in world.train_prompts
                                                                         for w in W.words_of(p)}
    assert W.make_world(0, 2000, 2000) == world  # seeded


def test_flaw_rates_and_exploits():
    prompts = [SCARY] * 4
    responses = ["the river is dark , dark and wild .", "the city is dark .", "the river is dark and bright .",
                 "the river is dark and wild"]
    rates = W.flaw_rates(prompts, responses)
    assert rates == {"repeated adjective": 0.25, "off topic": 0.25, "unfinished": 0.25,
                     "adjective of another mood": 0.25, "exploit": 0.75}
    before = dict.fromkeys(W.EXPLOITS, 0.05)
    assert proxy_exploits(before, {**before, "repeated adjective": 0.30}) == ["repeated adjective"]
    assert proxy_exploits(before, {**before, "off topic": 0.06}) == []  # within the margin


def test_label_pairs_choose_by_gold_and_drop_ties():
    prompts = [SCARY] * 3
    first = ["the river is dark .", "the river is old .", "the river is wet ."]
    second = ["the river is old .", "the river is dark and wild .", "the river is dry ."]
    rows, stats = label_pairs(prompts, first, second, W.gold_reward, noise=0.0, seed=0)
    assert stats == {"pairs": 2, "ties_dropped": 1, "flipped": 0}
    assert rows == [{"prompt": SCARY, "chosen": "the river is dark .", "rejected": "the river is old ."},
                    {"prompt": SCARY, "chosen": "the river is dark and wild .", "rejected": "the river is old ."}]
    flipped, stats = label_pairs(prompts, first, second, W.gold_reward, noise=1.0, seed=0)
    assert stats["flipped"] == 2
    assert [(r["chosen"], r["rejected"]) for r in flipped] == [(r["rejected"], r["chosen"]) for r in rows]


def test_label_noise_flips_the_configured_fraction_reproducibly():
    n = 2000
    good, bad = ["the river is dark ."] * n, ["the river is old ."] * n
    rows, stats = label_pairs([SCARY] * n, good, bad, W.gold_reward, noise=0.1, seed=3)
    wrong = sum(r["chosen"] == bad[0] for r in rows)
    assert wrong == stats["flipped"]
    assert abs(wrong / n - 0.1) < 4 * math.sqrt(0.1 * 0.9 / n)  # within 4 binomial standard deviations
    assert label_pairs([SCARY] * n, good, bad, W.gold_reward, noise=0.1, seed=3) == (rows, stats)


def test_mean_stderr_by_hand():
    stats = mean_stderr([1.0, 2.0, 3.0, 4.0])
    assert stats["mean"] == 2.5 and stats["n"] == 4
    # squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5; sample variance 5 / 3; stderr sqrt(5 / 3 / 4)
    assert stats["stderr"] == pytest.approx(math.sqrt(5 / 3 / 4))


def test_best_point_is_the_earliest_of_highest_gold(tmp_path):
    points = [{"step": 0, "gold": 0.3}, {"step": 10, "gold": 1.5}, {"step": 20, "gold": 1.5}, {"step": 30, "gold": 1.1}]
    assert best_point(points)["step"] == 10
    for step in (20, 10):  # found in step order; a half-written (.tmp) one is not a checkpoint
        (tmp_path / "checkpoints" / f"step-{step:08d}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step-{step:08d}" / "actor.safetensors").write_bytes(b"")
    (tmp_path / "checkpoints" / "step-00000030.tmp").mkdir()
    assert [s for s, _ in saved_actors(tmp_path)] == [10, 20]


def gold(sft, sft_se, ppo, ppo_se):
    return {"base": {"mean": -1.9, "stderr": 0.03}, "sft": {"mean": sft, "stderr": sft_se},
            "ppo": {"mean": ppo, "stderr": ppo_se}}


BAR = {"rm_accuracy": 0.9, "gold": gold(0.3, 0.06, 1.2, 0.05), "best": 2.0, "kl": {"mean": 1.0}, "kl_budget": 4.0,
       "wall_seconds": 130, "train_gold": {"mean": 1.3, "stderr": 0.05}, "exploit_rate": 0.25}


def test_bar_passes_a_clear_improvement():
    rows = bar_rows(**BAR)
    assert failed(rows) == []
    assert rows[1]["value"] == pytest.approx(0.9 / math.sqrt(0.06 ** 2 + 0.05 ** 2))  # gain in standard errors
    assert "0.567" in rows[2]["target"]  # (2 - 0.3) / 3
    # the gap 1.3 - 1.2 against a quarter of PPO's gain on training prompts, (1.3 - 0.3) / 4
    assert rows[4]["value"] == pytest.approx(0.1) and "0.250" in rows[4]["target"]


@pytest.mark.parametrize("kwargs, which", [
    ({"rm_accuracy": 0.79}, "RM accuracy, held-out gold-labelled pairs"),
    ({"gold": gold(0.3, 0.3, 1.2, 0.3), "train_gold": {"mean": 1.2}},
     "gold gain PPO - SFT, in standard errors"),  # 0.9 < 3 * 0.42: noise
    ({"gold": gold(0.3, 0.01, 0.8, 0.01), "train_gold": {"mean": 0.8}}, "gold gain PPO - SFT"),  # < (2 - 0.3) / 3
    ({"kl": {"mean": 4.5}}, "KL(PPO || SFT), nats per response"),
    ({"train_gold": {"mean": 1.6}}, "generalisation gap: PPO gold, training - held-out prompts"),  # 0.4 > 0.325
    ({"exploit_rate": EXPLOIT_TARGET + 0.01}, "exploit rate: PPO held-out samples with an exploit"),
    ({"wall_seconds": 700}, "wall time, seconds"),
])
def test_bar_names_what_failed(kwargs, which):
    assert failed(bar_rows(**{**BAR, **kwargs})) == [which]


def test_context_rows_report_flaws_before_and_after():
    flaws = {"sft": {"repeated adjective": 0.1, "exploit": 0.12}, "ppo": {"repeated adjective": 0.3, "exploit": 0.31}}
    rows = context_rows(BAR["gold"], 2.0, BAR["train_gold"], flaws, ["repeated adjective"])
    values = {r["name"]: r["value"] for r in rows}
    assert values["repeated adjective: share of samples, sft -> ppo"] == "0.100 -> 0.300"
    assert values["proxy exploits found (flaws PPO made more frequent)"] == "repeated adjective"
    assert all(r["passed"] is None for r in rows)


@pytest.mark.parametrize("available, expected", [(1, 1), (2, 2), (MAX_THREADS, MAX_THREADS), (64, MAX_THREADS)])
def test_demo_takes_the_threads_it_is_given_up_to_its_cap(available, expected):
    """The demo runs on torch's thread count (OMP_NUM_THREADS, else the physical cores), capped: its matrices are
    128 wide."""
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(available)
        assert demo_threads() == expected
    finally:
        torch.set_num_threads(before)


def test_configs_demo_yaml_is_what_the_demo_runs():
    """configs/demo.yaml documents the full demo's pipeline config; it must not drift from the code."""
    shipped = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    assert shipped == pipeline_dict(Path("runs/demo"), SIZES["full"], 0)


@pytest.mark.parametrize("name, schema", [
    ("sft", "rlhfkit.config.schema:SFTConfig"), ("rm", "rlhfkit.config.schema:RMConfig"),
    ("ppo", "rlhfkit.config.ppo_schema:PPOConfig"), ("pipeline", "rlhfkit.config.pipeline_schema:PipelineConfig"),
    ("pipeline-llama", "rlhfkit.config.pipeline_schema:PipelineConfig"),
    ("ppo-opt-1.3b-1gpu", "rlhfkit.config.ppo_schema:PPOConfig"),
    ("ppo-7b-zero3-8gpu", "rlhfkit.config.ppo_schema:PPOConfig"),
    ("demo", "rlhfkit.config.pipeline_schema:PipelineConfig"),
])
def test_example_configs_are_valid(name, schema):
    """Every shipped YAML passes the same validation as `rlhfkit CMD --config` (pipelines: all three sections)."""
    import importlib

    from rlhfkit.config.fields import load_config

    module, cls = schema.split(":")
    cfg = load_config(getattr(importlib.import_module(module), cls), str(ROOT / "configs" / f"{name}.yaml"))
    assert cfg.output_dir.startswith("runs/")
