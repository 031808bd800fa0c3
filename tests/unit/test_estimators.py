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

    with pytest.raises(ModelError, match=r"reward 'x' takes solution, which the prompt rows do not have "
                                         r"\(their fields: answer, level\)"):
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
