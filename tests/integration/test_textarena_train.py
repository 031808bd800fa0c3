"""`rlhfkit ppo env=rlhfkit.envs.textarena:TextArena` end to end on a real TextArena game and a tiny model.

The world: Blackjack-v0, three hands a game. A tiny Llama is fine-tuned on games played by a policy that hits 80% of
the time (its turns are "hit" or "stand"); hitting until you bust is the worst play, standing on every hand the
degenerate strategy that wins most (measured over 400 games: 0.38 of the hands against 0.14 for this policy). GRPO
on the game's own reward should find it: the reward rises and the games get shorter (fewer hits). Every transcript
the run sampled is replayed through TextArena from its seed: the same messages, and the score is TextArena's reward.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from conftest import read_metrics, run_cli, write_jsonl

pytestmark = pytest.mark.slow
pytest.importorskip("textarena")

from rlhfkit.envs.textarena import TextArena, game_rows  # noqa: E402

GAME, OPTIONS = "Blackjack-v0", {"num_hands": 3}


def played(seeds, p_hit: float, rng: random.Random):
    """(the conversation so far, the policy's next move) at every turn of a game per seed."""
    for seed in seeds:
        env = TextArena(GAME, OPTIONS)
        messages = [{"role": "user", "content": env.reset({"seed": seed})}]
        while True:
            move = "hit" if rng.random() < p_hit else "stand"
            yield list(messages), move
            step = env.step(move)
            if step.done:
                break
            messages += [{"role": "assistant", "content": move}, *step.messages]


@pytest.fixture(scope="module")
def blackjack_world(tmp_path_factory):
    """A tiny model that plays "hit" 80% of the time, and rows of 16 training and 64 held-out games."""
    from rlhfkit.config.fields import load_config
    from rlhfkit.config.schema import SFTConfig
    from rlhfkit.demo.tiny import build_tiny_llama, build_tokenizer, save_model_folder
    from rlhfkit.stages.sft import run_sft

    root = tmp_path_factory.mktemp("textarena")
    rows = [{"prompt": messages, "response": move} for messages, move in played(range(1000, 1200), 0.8,
                                                                                random.Random(0))]
    texts = ["\n\n".join(f"{m['role'].title()}: {m['content']}" for m in r["prompt"]) + f"\n\nAssistant: "
             f"{r['response']}" for r in rows[:300]]
    tokenizer = build_tokenizer(texts, vocab_size=512)
    model = build_tiny_llama(len(tokenizer), hidden=64, layers=2, heads=4, max_positions=1024)
    save_model_folder(model, tokenizer, root / "model")
    write_jsonl(root / "sft.jsonl", rows)
    write_jsonl(root / "games.jsonl", game_rows(GAME, range(16)))
    write_jsonl(root / "eval.jsonl", game_rows(GAME, range(500, 564)))
    run_sft(load_config(SFTConfig, None, [f"model={root / 'model'}", f"output_dir={root / 'sft'}",
                                          f"data.train={root / 'sft.jsonl'}", "data.eval_fraction=0",
                                          "data.max_length=1024", "train.max_steps=100", "train.batch_size=16",
                                          "train.micro_batch_size=16", "train.lr=3e-3", "train.eval_every=0",
                                          "log.tensorboard=false"]))
    return root


def replay(prompt: str, response: str, openings: dict) -> tuple[list[str], list[str], float | None]:
    """The sampled transcript played again through TextArena from its game's seed: (the messages the run showed
    after each model turn, the ones TextArena gives now, TextArena's reward)."""
    opening = prompt.removeprefix("User: ").removesuffix("\n\nAssistant:")
    env = TextArena(GAME, OPTIONS)
    env.reset({"seed": openings[opening]})
    parts = re.split(r"\n\nUser: (.*?)\n\nAssistant:", response, flags=re.S)
    moves, shown = parts[0::2], parts[1::2]
    given = []
    for move in moves:
        step = env.step(move)
        if step.done:
            break
        given.append(step.messages[0]["content"])
    return shown, given, env.reward()


def test_grpo_on_a_textarena_game_learns_its_degenerate_strategy(blackjack_world):
    world = blackjack_world
    proc = run_cli("ppo", f"actor={world / 'sft' / 'final'}", "env=rlhfkit.envs.textarena:TextArena",
                   f"episode.env_args={{game: {GAME}, options: {{num_hands: 3}}}}",
                   f"data.prompts={world / 'games.jsonl'}", f"data.eval_prompts={world / 'eval.jsonl'}",
                   f"output_dir={world / 'grpo'}", "ppo.advantage_estimator=grpo", "ppo.n_samples_per_prompt=4",
                   "train.batch_size=16", "train.micro_batch_size=32", "train.max_steps=12", "train.lr=2e-3",
                   "ppo.kl_coef=0", "ppo.kl_loss_coef=0.05", "gen.max_new_tokens=4", "episode.max_turns=16",
                   "episode.max_tokens=600", "train.eval_every=0", "train.save_every=0", "log.tensorboard=false",
                   "ppo.sample_every=6", "ppo.num_samples=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "episodes against env rlhfkit.envs.textarena:TextArena" in proc.stderr
    rows = [r for r in read_metrics(world / "grpo" / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 12
    # the games ran to TextArena's end, over several turns; the few that the episode limits cut short (a policy
    # that hits 16 times) have no TextArena reward, and are exactly the unjudged ones
    ended = [(r["episode/ended_done"], r["reward/unjudged"]) for r in rows]
    assert sum(done for done, _ in ended) / len(ended) > 0.97, ended
    assert all(unjudged == round((1 - done) * 64) for done, unjudged in ended), ended
    assert rows[0]["episode/turns"] > 4.5 and all(r["episode/turns"] >= 3 for r in rows)  # 3 hands: 3 turns at least
    # the reward rose and the games got shorter: the policy stands more (measured: reward 0.17, 0.23 in the first
    # two iterations, 0.34-0.40 in the last four; 5.3 -> 3.9 turns a game)
    first, last = (sum(r["reward/mean"] for r in part) / len(part) for part in (rows[:2], rows[-4:]))
    assert last > first + 0.08, [round(r["reward/mean"], 3) for r in rows]
    assert rows[-1]["episode/turns"] < rows[0]["episode/turns"] - 0.8
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["eval/reward_end"] > result["eval/reward_start"] + 0.08, result  # measured: 0.20 -> 0.34
    # the transcripts are TextArena's games, the scores its rewards
    openings = {TextArena(GAME, OPTIONS).reset(row): row["seed"] for row in game_rows(GAME, range(16))}
    samples = [json.loads(line) for line in (world / "grpo" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 12
    for sample in samples:
        shown, given, reward = replay(sample["prompt"], sample["response"], openings)
        assert shown == given and sample["reward"] == pytest.approx(reward), sample
