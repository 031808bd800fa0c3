"""The demo's pieces checked by hand: the gold reward, the label-noise pair builder, the bar, the world, demo.yaml."""

import math
from pathlib import Path

import pytest
import yaml

from rlhfkit.demo import world as W
from rlhfkit.demo.bar import bar_rows, failed
from rlhfkit.demo.evaluate import mean_stderr
from rlhfkit.demo.run import SIZES, pipeline_dict
from rlhfkit.demo.sampling import label_pairs

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("response, expected", [
    ("the river is cold .", 0.0),
    ("the river is calm .", 1.0),
    ("the river is calm and warm .", 2.0),
    ("the river is calm , warm and bright .", 3.0),
    ("the river is calm , warm , bright and gentle .", 3.0),  # capped at GOLD_CAP
    ("the river is calm , calm and calm .", 1.0),  # a repeated good word counts once
    ("the river is Calm,warm.", 2.0),  # case and punctuation do not hide a word
    ("", 0.0),
])
def test_gold_reward_counts_distinct_good_words_capped(response, expected):
    assert W.gold_reward(response) == expected


def test_best_gold_is_reachable_and_maximal():
    best = "the river is " + W.join_adjectives(sorted(W.GOOD)[:W.GOLD_CAP]) + " ."
    assert W.gold_reward(best) == W.BEST_GOLD == W.GOLD_CAP
    assert W.gold_reward(" ".join(sorted(W.GOOD) * 3)) == W.BEST_GOLD


def test_world_holds_out_topics_and_its_demonstrations_vary_in_gold():
    world = W.make_world(0, n_demonstrations=400, n_corpus=50)
    train_topics = {p.split()[-1] for p in world.train_prompts}
    heldout_topics = {p.split()[-1] for p in world.heldout_prompts}
    assert len(heldout_topics) == W.HELD_OUT_TOPICS and not train_topics & heldout_topics
    assert {d["prompt"] for d in world.demonstrations} <= set(world.train_prompts)
    golds = [W.gold_reward(d["response"]) for d in world.demonstrations]
    # the labeller does not know GOOD: about a quarter of the adjectives are good, so the gold varies
    assert set(golds) >= {0.0, 1.0, 2.0} and 0.3 < sum(golds) / len(golds) < 1.2
    assert W.make_world(0, 400, 50) == world  # seeded


def test_label_pairs_choose_by_gold_and_drop_ties():
    prompts = ["p1", "p2", "p3"]
    first = ["the x is calm .", "the x is cold .", "the x is old ."]
    second = ["the x is cold .", "the x is calm and warm .", "the x is wet ."]
    rows, stats = label_pairs(prompts, first, second, W.gold_reward, noise=0.0, seed=0)
    assert stats == {"pairs": 2, "ties_dropped": 1, "flipped": 0}
    assert rows == [{"prompt": "p1", "chosen": "the x is calm .", "rejected": "the x is cold ."},
                    {"prompt": "p2", "chosen": "the x is calm and warm .", "rejected": "the x is cold ."}]
    flipped, stats = label_pairs(prompts, first, second, W.gold_reward, noise=1.0, seed=0)
    assert stats["flipped"] == 2
    assert [(r["chosen"], r["rejected"]) for r in flipped] == [(r["rejected"], r["chosen"]) for r in rows]


def test_label_noise_flips_the_configured_fraction_reproducibly():
    n = 2000
    good, bad = ["the x is calm ."] * n, ["the x is cold ."] * n
    rows, stats = label_pairs(["p"] * n, good, bad, W.gold_reward, noise=0.1, seed=3)
    wrong = sum(r["chosen"] == bad[0] for r in rows)
    assert wrong == stats["flipped"]
    assert abs(wrong / n - 0.1) < 4 * math.sqrt(0.1 * 0.9 / n)  # within 4 binomial standard deviations
    assert label_pairs(["p"] * n, good, bad, W.gold_reward, noise=0.1, seed=3) == (rows, stats)


def test_mean_stderr_by_hand():
    stats = mean_stderr([1.0, 2.0, 3.0, 4.0])
    assert stats["mean"] == 2.5 and stats["n"] == 4
    # squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5; sample variance 5 / 3; stderr sqrt(5 / 3 / 4)
    assert stats["stderr"] == pytest.approx(math.sqrt(5 / 3 / 4))


def gold(sft, sft_se, ppo, ppo_se):
    return {"base": {"mean": 0.2, "stderr": 0.03}, "sft": {"mean": sft, "stderr": sft_se},
            "ppo": {"mean": ppo, "stderr": ppo_se}}


def test_bar_passes_a_clear_improvement():
    rows = bar_rows(0.9, gold(0.6, 0.04, 2.0, 0.03), best=3.0, kl={"mean": 3.0}, kl_budget=8.0, wall_seconds=130)
    assert failed(rows) == []
    assert rows[1]["value"] == pytest.approx(1.4 / 0.05)  # the gain in standard errors of the difference
    assert "0.800" in rows[2]["target"]  # (3 - 0.6) / 3


@pytest.mark.parametrize("kwargs, which", [
    ({"rm_accuracy": 0.84}, "RM accuracy, held-out gold-labelled pairs"),
    ({"gold": gold(0.6, 0.25, 1.5, 0.25)}, "gold gain PPO - SFT, in standard errors"),  # 0.9 < 3 * 0.35: noise
    ({"gold": gold(0.6, 0.01, 1.3, 0.01)}, "gold gain PPO - SFT"),  # significant but < (3 - 0.6) / 3
    ({"kl": {"mean": 8.5}}, "KL(PPO || SFT), nats per response"),
    ({"wall_seconds": 700}, "wall time, seconds"),
])
def test_bar_names_what_failed(kwargs, which):
    args = {"rm_accuracy": 0.9, "gold": gold(0.6, 0.04, 2.0, 0.03), "best": 3.0, "kl": {"mean": 3.0},
            "kl_budget": 8.0, "wall_seconds": 130, **kwargs}
    bad = failed(bar_rows(**args))
    assert bad == [which]


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
