"""The arena's pieces by hand: which algorithms, their configs from the demo's, the bar, the table and the report."""

import json
from pathlib import Path

import pytest

from rlhfkit.demo.arena import ALGOS, GROUP, arena_configs, arena_rows, arena_table, gain_in_se, parse_algos
from rlhfkit.demo.run import SIZES, Demo, merged_pipeline
from rlhfkit.errors import ConfigError
from rlhfkit.report import write_report


def test_parse_algos_puts_ppo_first_once_and_rejects_unknown_names():
    assert parse_algos("grpo,dpo") == ["ppo", "grpo", "dpo"]
    assert parse_algos("dpo, ppo,dpo") == ["ppo", "dpo"]
    assert parse_algos("all") == list(ALGOS) == ["ppo", "grpo", "rloo", "reinforce_pp", "dpo"]
    with pytest.raises(ConfigError, match="--algos: unknown kto; choose from ppo, grpo, rloo, reinforce_pp, dpo"):
        parse_algos("grpo,kto")


def test_arena_configs_keep_ppos_budget_and_change_only_the_estimator(tmp_path):
    demo = Demo(tmp_path, SIZES["full"], 3, ["ppo.ppo.kl_coef=0.3", "train.seed=5"], algos=parse_algos("all"))
    configs = arena_configs(demo, merged_pipeline(demo))
    assert set(configs) == {"grpo", "rloo", "reinforce_pp", "dpo"}  # PPO is the demo's own run
    ppo = merged_pipeline(demo)["ppo"]
    for algo in ("grpo", "rloo"):
        cfg = configs[algo][1]
        assert cfg.ppo.advantage_estimator == algo and cfg.ppo.n_samples_per_prompt == GROUP
        # PPO's samples per iteration, its iterations and learning rate; its KL coefficient as a k3 loss
        assert cfg.train.batch_size * GROUP == ppo["train"]["batch_size"] == 32
        assert cfg.train.max_steps == ppo["train"]["max_steps"] and cfg.train.lr == ppo["train"]["lr"]
        assert (cfg.ppo.kl_coef, cfg.ppo.kl_loss_coef) == (0.0, 0.3)
    rpp = configs["reinforce_pp"][1]
    assert rpp.ppo.advantage_estimator == "reinforce_pp" and rpp.ppo.n_samples_per_prompt == 1
    assert rpp.train.batch_size == 32 and rpp.ppo.kl_coef == 0.3
    for algo in ("grpo", "rloo", "reinforce_pp"):
        cfg = configs[algo][1]
        assert cfg.actor == str(tmp_path / "sft" / "final") and cfg.reward == str(tmp_path / "rm" / "final")
        assert cfg.output_dir == str(tmp_path / "arena" / algo) and cfg.train.seed == 5  # shared keys reach it
    dpo = configs["dpo"][1]
    assert dpo.model == str(tmp_path / "sft" / "final") and dpo.data.train == str(tmp_path / "data" / "pairs.jsonl")
    assert dpo.dpo.loss == "sigmoid" and dpo.train.epochs == SIZES["full"]["dpo_epochs"] and dpo.train.seed == 5


def test_the_arena_gives_every_algorithm_ppos_samples_when_ppo_samples_several_per_prompt(tmp_path):
    """PPO overridden to 2 samples for each of 24 prompts: 48 samples per iteration, so GRPO and RLOO get 12
    groups of 4 and REINFORCE++ 48 prompts (not 24 // 4 = 6 groups and 24 prompts); a budget that does not
    split into groups is refused."""
    overrides = ["ppo.train.batch_size=24", "ppo.ppo.n_samples_per_prompt=2", "ppo.train.micro_batch_size=2"]
    demo = Demo(tmp_path, SIZES["full"], 3, overrides, algos=parse_algos("grpo,rloo,reinforce_pp"))
    configs = arena_configs(demo, merged_pipeline(demo))
    for algo in ("grpo", "rloo"):
        assert configs[algo][1].train.batch_size * configs[algo][1].ppo.n_samples_per_prompt == 48
    assert configs["reinforce_pp"][1].train.batch_size == 48
    assert configs["reinforce_pp"][1].ppo.n_samples_per_prompt == 1
    odd = Demo(tmp_path, SIZES["full"], 3, ["ppo.train.batch_size=18", "ppo.train.micro_batch_size=2",
                                            "ppo.ppo.mini_batch_size=6"], algos=["ppo", "grpo"])
    with pytest.raises(ConfigError, match="grpo: PPO's 18 samples per iteration .* do not split into groups of 4"):
        arena_configs(odd, merged_pipeline(odd))


def test_a_bad_override_fails_in_the_arenas_configs_too(tmp_path):
    demo = Demo(tmp_path, SIZES["quick"], 0, ["ppo.ppo.kl_coeff=0.1"], algos=["ppo", "grpo"])
    with pytest.raises(ConfigError, match="kl_coeff"):
        arena_configs(demo, merged_pipeline(demo))


ARENA = {
    "sft": {"mean": 0.30, "stderr": 0.05, "n": 320}, "samples": 320, "best": 2.0,
    "algos": {
        "ppo": {"gold": {"mean": 1.10, "stderr": 0.05}, "gain": 0.80, "gain_se": 0.80 / 0.05 / 2 ** 0.5, "kl": 0.9,
                "exploit": 0.2, "seconds": 120.0, "used": "3840 samples"},
        "dpo": {"gold": {"mean": 0.40, "stderr": 0.05}, "gain": 0.10, "gain_se": 0.10 / 0.05 / 2 ** 0.5, "kl": 2.5,
                "exploit": 0.1, "seconds": None, "used": "8768 pairs"},
    },
}


def test_every_algorithm_has_its_bar_and_a_line_in_the_table():
    rows = arena_rows(ARENA)
    assert [(r["name"], r["passed"]) for r in rows] == [
        ("arena: ppo gold gain over SFT, in standard errors", True),  # 11.3 standard errors
        ("arena: dpo gold gain over SFT, in standard errors", False)]  # 1.4
    lines = arena_table(ARENA).splitlines()
    assert lines[0].split()[:2] == ["policy", "gold"] and lines[1].split()[:4] == ["sft", "0.300", "±", "0.050"]
    assert lines[2].split() == ["ppo", "1.100", "±", "0.050", "11.3", "0.90", "0.20", "120", "3840", "samples"]
    assert lines[3].split() == ["dpo", "0.400", "±", "0.050", "1.4", "2.50", "0.10", "?", "8768", "pairs"]


def test_a_gain_without_any_spread_passes_no_bar():
    """SFT and a policy that both score a constant have no standard error: the gain is +-inf or 0 of them, and
    the bar (>= 3 standard errors) is not passed on that, as the demo's own PPO bar does not."""
    assert gain_in_se(0.0, 0.0) == 0.0 and gain_in_se(0.5, 0.0) == float("inf")
    assert gain_in_se(-0.5, 0.0) == float("-inf") and gain_in_se(0.3, 0.1) == pytest.approx(3.0)
    flat = {**ARENA, "algos": {"ppo": {**ARENA["algos"]["ppo"], "gain": 0.0, "gain_se": gain_in_se(0.0, 0.0)},
                               "rloo": {**ARENA["algos"]["ppo"], "gain": 0.2, "gain_se": gain_in_se(0.2, 0.0)}}}
    assert [r["passed"] for r in arena_rows(flat)] == [False, False]


def test_the_report_shows_the_arena_table_and_its_plot(tmp_path):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    (tmp_path / "arena.json").write_text(json.dumps(ARENA))
    html = Path(write_report(tmp_path)).read_text()
    assert "The arena" in html and "plots/arena.png" in html and "8768 pairs" in html
    assert (tmp_path / "plots" / "arena.png").stat().st_size > 1000
    (tmp_path / "arena.json").write_text(json.dumps({"algos": {"ppo": {"kl": 1.0}}}))
    with pytest.raises(ValueError, match="arena.json: expected"):
        write_report(tmp_path)


@pytest.mark.parametrize("argv, message", [
    (["--algo", "grpo"], "--algo chooses the --task demo's algorithm; the toy world compares algorithms with --algos"),
    (["--task", "arithmetic", "--early-stop"], "--early-stop picks the toy world's PPO checkpoint of best gold "
                                               "reward; the --task demo has no gold reward to pick by"),
])
def test_a_demo_flag_of_the_other_mode_is_an_error_not_ignored(tmp_path, capsys, argv, message):
    from rlhfkit.cli import main as cli_main

    assert cli_main(["demo", *argv, "--output", str(tmp_path / "demo")]) == 2
    assert capsys.readouterr().err.strip() == f"rlhfkit demo: error: {message}"
    assert not (tmp_path / "demo").exists()
