"""The estimator table on rollout batches: group estimators find each prompt's samples in any row order,
REINFORCE++'s baseline variant by hand, outcome scores clipped, and global whitening on one process."""

from __future__ import annotations

import pytest
import torch

from rlhfkit.algos import masked_whiten
from rlhfkit.config.ppo_schema import PPOSection
from rlhfkit.engine.local import LocalEngine
from rlhfkit.rollout.batch import RolloutBatch
from rlhfkit.registry.estimators import ESTIMATORS
from rlhfkit.rollout.experience import whiten_over_ranks


def batch(scores, group, mask, rewards=None) -> RolloutBatch:
    mask = torch.tensor(mask, dtype=torch.float32)
    b, r = mask.shape
    return RolloutBatch(prompt_ids=torch.ones(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.long),
                        response_ids=torch.ones(b, r, dtype=torch.long), response_mask=mask,
                        prompt_texts=[""] * b, response_texts=[""] * b, group=torch.tensor(group),
                        scores=torch.tensor(scores), rewards=torch.tensor(rewards) if rewards else None)


def test_grpo_finds_groups_in_any_row_order_and_broadcasts_to_valid_tokens():
    cfg = PPOSection(advantage_estimator="grpo", n_samples_per_prompt=2, score_clip=None)
    # prompt 0: scores 1, 3 (mean 2, std sqrt(2)); prompt 1: 5, 5 (equal: 0); rows interleaved
    b = batch([1.0, 5.0, 3.0, 5.0], [0, 1, 0, 1], [[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    adv, _ = ESTIMATORS["grpo"].advantages(b, cfg)
    a = 1 / (2 ** 0.5 + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([[-a, -a, 0], [0, 0, 0], [a, a, a], [0, 0, 0]]))
    dr, _ = ESTIMATORS["grpo"].advantages(b, PPOSection(advantage_estimator="grpo", n_samples_per_prompt=2,
                                                        grpo_scale_by_std=False, score_clip=None))
    torch.testing.assert_close(dr[:, 0], torch.tensor([-1.0, 0.0, 1.0, 0.0]))


def test_rloo_and_score_clipping():
    cfg = PPOSection(advantage_estimator="rloo", n_samples_per_prompt=3, score_clip=5.0)
    b = batch([9.0, 0.0, 1.0], [0, 0, 0], [[1], [1], [1]])  # 9 is clipped to 5
    adv, _ = ESTIMATORS["rloo"].advantages(b, cfg)
    torch.testing.assert_close(adv[:, 0], torch.tensor([5 - 0.5, 0 - 3.0, 1 - 2.5]))


def test_group_statistics_count_the_judged_rows_only():
    """Groups [1, 0, unjudged, unjudged] (filled with the judged mean 0.5, as fill_unjudged does) and [1, 0, 1, 0],
    rows interleaved: each group's mean, GRPO's std and RLOO's k / (k - 1) come from its judged rows, so the first
    group's judged rows get the advantages a group of just [1, 0] gets (+-0.7071; RLOO +-1), not ones inflated by
    the filler rows (GRPO +-1.2247, RLOO +-0.667); the unjudged rows get 0, and a lone judged row too."""
    n = 4
    group = [0, 1, 0, 1, 0, 1, 0, 1]
    scores = [1.0, 1.0, 0.0, 0.0, 0.5, 1.0, 0.5, 0.0]
    judged = torch.tensor([True, True, True, True, False, True, False, True])
    mask = [[1]] * 8
    b = batch(scores, group, mask)
    b.judged = judged
    grpo, _ = ESTIMATORS["grpo"].advantages(b, PPOSection(advantage_estimator="grpo", n_samples_per_prompt=n,
                                                          score_clip=None))
    pair = 0.5 / (0.5 ** 0.5 + 1e-6)  # [1, 0]: mean 0.5, unbiased std 0.7071
    full = 0.5 / (torch.tensor([1.0, 0.0, 1.0, 0.0]).std().item() + 1e-6)  # the all-judged group, as before
    torch.testing.assert_close(grpo[:, 0], torch.tensor([pair, full, -pair, -full, 0.0, full, 0.0, -full]))
    rloo, _ = ESTIMATORS["rloo"].advantages(b, PPOSection(advantage_estimator="rloo", n_samples_per_prompt=n,
                                                          score_clip=None))
    torch.testing.assert_close(rloo[:, 0], torch.tensor([1.0, 2 / 3, -1.0, -2 / 3, 0.0, 2 / 3, 0.0, -2 / 3]))
    b.judged = torch.tensor([True, True, False, True, False, True, False, True])  # group 0: one judged row
    lone, _ = ESTIMATORS["rloo"].advantages(b, PPOSection(advantage_estimator="rloo", n_samples_per_prompt=n,
                                                          score_clip=None))
    assert lone[[0, 2, 4, 6], 0].tolist() == [0.0, 0.0, 0.0, 0.0]
    b.judged = torch.ones(8, dtype=torch.bool)  # all judged: exactly the plain statistics
    every, _ = ESTIMATORS["grpo"].advantages(b, PPOSection(advantage_estimator="grpo", n_samples_per_prompt=n,
                                                           score_clip=None))
    b.judged = None
    plain, _ = ESTIMATORS["grpo"].advantages(b, PPOSection(advantage_estimator="grpo", n_samples_per_prompt=n,
                                                           score_clip=None))
    assert torch.equal(every, plain)


def test_reinforce_pp_baseline_subtracts_the_group_mean_at_the_score_token_then_sums_returns():
    cfg = PPOSection(advantage_estimator="reinforce_pp_baseline", n_samples_per_prompt=2, gamma=1.0, score_clip=None)
    # shaped rewards: -0.1 KL on each token, the score (2 or 0; group mean 1) on the last valid token
    b = batch([2.0, 0.0], [0, 0], [[1, 1], [1, 0]], rewards=[[-0.1, 1.9], [-0.1, 0.0]])
    returns, _ = ESTIMATORS["reinforce_pp_baseline"].advantages(b, cfg)
    torch.testing.assert_close(returns, torch.tensor([[0.8, 0.9], [-1.1, 0.0]]))
    plain, _ = ESTIMATORS["reinforce_pp"].advantages(b, cfg)
    torch.testing.assert_close(plain, torch.tensor([[1.8, 1.9], [-0.1, 0.0]]))


def test_whitening_over_ranks_on_one_process_is_masked_whiten():
    torch.manual_seed(0)
    x, mask = torch.randn(4, 5), (torch.rand(4, 5) > 0.3).float()
    torch.testing.assert_close(whiten_over_ranks(x, mask, LocalEngine()), masked_whiten(x, mask))


def test_reward_functions_get_the_dataset_columns_they_name():
    import pytest

    from rlhfkit.errors import ModelError
    from rlhfkit.models.reward_fn import FunctionReward

    b = batch([0.0, 0.0], [0, 1], [[1], [1]])
    b.response_texts, b.fields = ["4", "5"], [{"answer": "4", "level": 1}, {"answer": "6", "level": 2}]

    def exact(prompts, responses, answer):
        return [float(r == a) for r, a in zip(responses, answer)]

    seen = {}

    def everything(prompts, responses, **columns):
        seen.update(columns)
        return [0.0, 0.0]

    assert FunctionReward(exact, "exact").__call__(b).tolist() == [1.0, 0.0]
    FunctionReward(everything, "everything")(b)
    assert seen == {"answer": ["4", "6"], "level": [1, 2]}
    assert FunctionReward(lambda p, r: [1.0, 2.0], "two")(b).tolist() == [1.0, 2.0]  # no columns asked for

    def needs_solution(prompts, responses, solution):
        return [0.0, 0.0]

    with pytest.raises(ModelError, match=r"reward function 'x' \(.*test_estimators.py:117\) takes a parameter "
                                         r"'solution' that the prompt rows do not have \(they have: answer, level\)"):
        FunctionReward(needs_solution, "x")(b)


def test_unjudged_responses_and_weighted_parts():
    import math

    import pytest

    from rlhfkit.errors import ModelError
    from rlhfkit.models.reward_fn import CombinedReward, FunctionReward
    from rlhfkit.stages.ppo_steps import fill_unjudged

    b = batch([0.0] * 3, [0, 0, 1], [[1]] * 3)
    b.response_texts = ["a", "bb", "ccc"]
    lengths = FunctionReward(lambda p, r: [float(len(x)) for x in r], "lengths")
    picky = FunctionReward(lambda p, r: [None if len(x) == 1 else 1.0 for x in r], "picky")
    assert math.isnan(picky(b)[0].item()) and picky(b)[1:].tolist() == [1.0, 1.0]
    with pytest.raises(ModelError) as err:
        FunctionReward(lambda p, r: [1.0, float("nan"), float("inf")], "nan")(b)
    assert str(err.value) == ("reward 'nan' returned nan for response 1 ('bb') and 1 more non-finite values: return "
                              "a finite number, or None for a response it cannot judge")
    both = CombinedReward([("lengths", lengths, 1.0), ("picky", picky, 0.5)])
    total = both(b)
    assert math.isnan(total[0].item()) and total[1:].tolist() == [2.5, 3.5]
    assert both.last == {"lengths": 2.0, "picky": 1.0}  # each part's mean over what it judged
    # row 0 unjudged: its group's judged mean (row 1: 2.5); a group with none judged gets 0
    filled = fill_unjudged(torch.tensor([float("nan"), 2.5, float("nan")]), torch.tensor([False, True, False]),
                           torch.tensor([0, 0, 1]))
    assert filled.tolist() == [2.5, 2.5, 0.0]


def test_a_reward_functions_result_is_checked_whatever_its_container():
    """A generator or a map is read once and checked like a list (its NaN is an error, not "unjudged"); a string, a
    dict or a bare number is refused rather than read as characters, keys or nothing; an int too large for a float
    is a non-finite score; a NumPy array of numbers is fine, one of strings is refused."""
    import numpy as np
    import pytest

    from rlhfkit.errors import ModelError
    from rlhfkit.models.reward_fn import FunctionReward

    b = batch([0.0] * 3, [0, 1, 2], [[1]] * 3)
    b.response_texts = ["a", "bb", "ccc"]

    def reward(result):
        return FunctionReward(lambda prompts, responses: result(), "r")(b)

    assert reward(lambda: (float(len(x)) for x in "abc")).tolist() == [1.0, 1.0, 1.0]
    assert reward(lambda: np.array([1.0, 0.5, 0.0])).tolist() == [1.0, 0.5, 0.0]
    assert reward(lambda: torch.tensor([1.0, 2.0, 3.0])).tolist() == [1.0, 2.0, 3.0]
    for result in (lambda: (x for x in [1.0, float("inf"), float("nan")]), lambda: map(float, ["1", "inf", "2"])):
        with pytest.raises(ModelError, match=r"reward 'r' returned inf for response 1 \('bb'\)"):
            reward(result)
    with pytest.raises(ModelError, match=r"reward 'r' returned inf for response 0"):
        reward(lambda: [10 ** 400, 0, 0])
    for result, kind in ((lambda: "101", "str"), (lambda: {"1": 0, "2": 0, "3": 0}, "dict"), (lambda: 1.0, "float"),
                         (lambda: torch.tensor(1.0), "Tensor")):
        with pytest.raises(ModelError, match=rf"reward 'r' returned a {kind} \(.*\): return a list of numbers"):
            reward(result)
    with pytest.raises(ModelError, match=r"returned a string \('1'\) for response 0"):
        reward(lambda: np.array(["1", "0", "1"]))


def test_rows_of_groups_that_scored_alike():
    from rlhfkit.stages.ppo_steps import equal_group_rows

    scores, group = torch.tensor([3.0, 1.0, 3.0, 2.0]), torch.tensor([1, 0, 1, 0])  # any row order
    assert equal_group_rows(scores, group, 2).tolist() == [True, False, True, False]  # group 1: 3, 3


def test_a_single_weighted_reward_model_is_standardised_before_its_weight():
    """normalize_reward with `reward: [{reward: rm, weight: 0.5}]`: w * (s - mean) / std, the RM's stored
    mean/std applied to its own scores (not (w * s - mean) / std)."""
    from rlhfkit.models.reward_fn import CombinedReward
    from rlhfkit.rollout.experience import adjust_scores

    class StoredStats:  # the shape of ModelReward: scores plus the mean/std from the RM's config.json
        stats = {"mean": 3.0, "std": 2.0}

        def __call__(self, batch, finished=None):
            return torch.tensor([3.0, 5.0, 1.0])

    cfg = PPOSection(normalize_reward=True)
    for weight, expected in ((0.5, [0.0, 0.5, -0.5]), (1.0, [0.0, 1.0, -1.0]), (-2.0, [0.0, -2.0, 2.0])):
        reward = CombinedReward([("rm", StoredStats(), weight)])
        scores = adjust_scores(reward(None), torch.ones(3, dtype=torch.bool), cfg, reward.stats)
        assert scores.tolist() == pytest.approx(expected), weight


# ---------------------------------------------------------------- the registry is the config's one truth


def ppo_help() -> str:
    """What `rlhfkit ppo --help` prints."""
    import contextlib
    import io

    from rlhfkit.cli import build_parser

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["ppo", "--help"])
    return out.getvalue()


def valid_section(name: str, **changes) -> dict:
    """The smallest ppo section that `name`'s entry accepts: groups of 2 where it compares samples, the KL
    coefficient at 0 where it puts the KL in the loss."""
    entry = ESTIMATORS[name]
    return {"advantage_estimator": name, "n_samples_per_prompt": 2 if entry.groups else 1,
            **({"kl_coef": 0.0} if entry.kl_in == "loss" else {}), **changes}


def section(name: str, **changes) -> PPOSection:
    from rlhfkit.config.fields import from_dict

    return from_dict(PPOSection, valid_section(name, **changes), prefix="ppo.")


def test_every_registered_estimator_is_a_choice_in_help_and_every_choice_is_registered():
    import dataclasses

    from rlhfkit.config.fields import help_rows
    from rlhfkit.config.ppo_schema import PPOConfig

    field = {f.name: f for f in dataclasses.fields(PPOSection)}["advantage_estimator"]
    assert tuple(field.metadata["choices"]) == tuple(ESTIMATORS)
    row = {key: (tp, doc) for key, tp, _, doc in help_rows(PPOConfig)}["ppo.advantage_estimator"]
    assert row[0].split("|") == list(ESTIMATORS)
    text = ppo_help()
    for name, entry in ESTIMATORS.items():
        assert section(name).estimator() is entry
        assert f"{name} ({'with a critic' if entry.critic else 'no critic'}): {entry.doc}" in row[1]
        assert entry.doc.split(":")[0] in text  # the doc reaches `rlhfkit ppo --help` (argparse rewraps lines)


def test_without_effect_is_defined_for_every_entry_and_names_only_real_ppo_settings():
    """For each estimator, every ESTIMATOR_SETTINGS key changed from its default: exactly the ones its entry does
    not read are named, and they are ppo.* fields; nothing is named at the defaults."""
    import dataclasses

    from rlhfkit.registry.estimators import CRITIC_SETTINGS, ESTIMATOR_SETTINGS

    fields = {f.name for f in dataclasses.fields(PPOSection)}
    assert set(ESTIMATOR_SETTINGS) <= fields and set(CRITIC_SETTINGS) <= set(ESTIMATOR_SETTINGS)
    changed = {"gamma": 0.9, "lam": 0.5, "value_clip": 0.3, "whiten_advantages": False, "grpo_scale_by_std": False,
               "value_head_init": "zero"}
    assert set(changed) == set(ESTIMATOR_SETTINGS)
    for name, entry in ESTIMATORS.items():
        assert set(entry.reads) <= fields, name
        assert section(name).without_effect() == [], name
        named = [item.split("=")[0] for item in section(name, **changed).without_effect()]
        assert named == list(entry.unread()), name
        assert set(named) <= fields and not set(named) & set(entry.reads), name
        assert ("grpo_scale_by_std" in named) == (name != "grpo")  # the one estimator that reads it


def test_validation_follows_each_entrys_flags():
    """groups: n_samples_per_prompt 1 refused; KL in the loss: adaptive_kl and a reward kl_coef refused; no critic:
    the critic's settings and `critic=` refused. Each check by the entry's flag, never by its name."""
    from rlhfkit.config import ConfigError
    from rlhfkit.config.fields import load_config
    from rlhfkit.config.ppo_schema import PPOConfig

    def refused(name, key, **changes):
        with pytest.raises(ConfigError, match=rf"^config key 'ppo\.{key}': {name} "):
            section(name, **changes)

    base = ["actor=a", "reward=r.py:f", "data.prompts=p", "train.max_steps=2", "train.batch_size=2",
            "train.micro_batch_size=2"]
    for name, entry in ESTIMATORS.items():
        if entry.groups:
            refused(name, "n_samples_per_prompt", n_samples_per_prompt=1)
        else:
            section(name, n_samples_per_prompt=1)
        if entry.kl_in == "loss":
            refused(name, "adaptive_kl", adaptive_kl=True)
            refused(name, "kl_coef", kl_coef=0.05)
        else:
            section(name, adaptive_kl=True, kl_coef=0.05)
        ppo = [f"ppo.{key}={value}" for key, value in valid_section(name).items()]
        if entry.critic:
            section(name, critic_lr=1e-5, critic_warmup_iters=2)
            load_config(PPOConfig, None, [*base, *ppo, "critic=some/folder"])
        else:
            refused(name, "critic_warmup_iters", critic_lr=1e-5)
            with pytest.raises(ConfigError, match=rf"^config key 'critic': {name} needs no critic"):
                load_config(PPOConfig, None, [*base, *ppo, "critic=some/folder"])


def test_a_contradictory_entry_is_refused_at_registration():
    from rlhfkit.registry.estimators import register_estimator

    def fn(batch, ppo):
        return batch.rewards, batch.rewards

    flags = {"doc": "d", "critic": False, "groups": False, "kl_in": "reward", "row_local": True, "whiten": "none"}
    for name, changes, message in [
            ("gae", {}, "is registered twice"),
            ("toy", {"reads": ("clip_eps",)}, r"reads \['clip_eps'\], not among ESTIMATOR_SETTINGS"),
            ("toy", {"reads": ("whiten_advantages",)}, "critic= and whiten= imply them"),
            ("toy", {"kl_in": "advantage"}, "kl_in='advantage'")]:
        with pytest.raises(ValueError, match=message):
            register_estimator(name, **{**flags, **changes})(fn)
    assert "toy" not in ESTIMATORS


@pytest.fixture
def toy_estimator():
    """A critic-free group estimator registered for one test, the way a contributor adds one: the score minus the
    group's mean, as the advantage of every token; KL in the loss; reads ppo.gamma (for the test's sake)."""
    from rlhfkit.registry.estimators import register_estimator

    @register_estimator("toy_mean_baseline", critic=False, groups=True, kl_in="loss", reads=("gamma",),
                        row_local=False, whiten="none", doc="Toy: the score minus its group's mean")
    def toy_mean_baseline(batch, ppo):
        from rlhfkit.algos import broadcast_to_tokens, group_baseline, per_group

        adv = per_group(group_baseline, batch.scores.float(), batch.group, ppo.n_samples_per_prompt)
        tokens = broadcast_to_tokens(adv, batch.response_mask)
        return tokens, tokens

    yield ESTIMATORS["toy_mean_baseline"]
    del ESTIMATORS["toy_mean_baseline"]


def test_a_registered_estimator_reaches_choices_help_validation_and_the_rollout_with_no_other_edit(toy_estimator):
    from rlhfkit.config import ConfigError
    from rlhfkit.config.fields import help_text, load_config
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.rollout.experience import add_advantages

    name = "toy_mean_baseline"
    text = help_text(PPOConfig)
    assert f"|{name}, default 'gae')" in text and "toy_mean_baseline (no critic): Toy: the score minus" in text
    assert f"rloo, reinforce_pp_baseline, {name} compare them" in text  # n_samples_per_prompt
    assert f"grpo, rloo, {name} put the KL in the loss" in text  # kl_coef
    assert "Toy: the score minus" in ppo_help()
    cfg = load_config(PPOConfig, None, ["actor=a", "reward=r.py:f", "data.prompts=p", "train.max_steps=2",
                                        "train.batch_size=2", "train.micro_batch_size=2", "ppo.n_samples_per_prompt=2",
                                        f"ppo.advantage_estimator={name}", "ppo.kl_coef=0", "ppo.gamma=0.9",
                                        "ppo.lam=0.5"])
    assert cfg.ppo.estimator() is toy_estimator
    assert cfg.ppo.without_effect() == ["lam=0.5"]  # gamma: the toy reads it
    for changes, key in [({"n_samples_per_prompt": 1}, "n_samples_per_prompt"), ({"kl_coef": 0.05}, "kl_coef"),
                         ({"critic_lr": 1e-5}, "critic_warmup_iters")]:
        with pytest.raises(ConfigError, match=rf"^config key 'ppo\.{key}': {name} "):
            section(name, **changes)
    # the rollout step calls the entry's function: prompt 0 scores 1, 3 (mean 2), prompt 1 scores 5, 5; rows mixed
    b = batch([1.0, 5.0, 3.0, 5.0], [0, 1, 0, 1], [[1, 1], [1, 0], [1, 1], [1, 1]])
    b.old_logprobs = b.ref_logprobs = torch.zeros(4, 2)
    out, _ = add_advantages(b, b.scores, 0.0, cfg.ppo)
    torch.testing.assert_close(out.advantages, torch.tensor([[-1.0, -1.0], [0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]))


def test_the_toy_estimator_is_gone_after_its_test():
    from rlhfkit.config import ConfigError

    assert "toy_mean_baseline" not in ESTIMATORS
    with pytest.raises(ConfigError, match="expected one of"):
        section("gae", advantage_estimator="toy_mean_baseline")
