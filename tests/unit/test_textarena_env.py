"""TextArena's single-player games as episodes (envs/textarena.py), against the real games: the opening, scripted
wins and losses with the rewards TextArena gives, invalid moves, seeds, and the errors before any model loads."""

from __future__ import annotations

import random
import sys
import threading

import pytest

from rlhfkit.envs.textarena import OFFLINE_GAMES, TextArena, game_rows
from rlhfkit.errors import ConfigError

SLOW_TO_GENERATE = {"Sokoban-v0-medium", "Sudoku-v0-hard"}  # seconds per reset, up to ~35 s for some seeds


@pytest.fixture(scope="module")
def ta():
    return pytest.importorskip("textarena")


def target(seed: int, low: int = 1, high: int = 20) -> int:
    """GuessTheNumber's secret: its State seeds the global generator, then the game draws randint(low, high)."""
    return random.Random(seed).randint(low, high)


def binary_search(env: TextArena) -> list[str]:
    """Play GuessTheNumber-v0 by its hints; the messages the game sent after each guess."""
    low, high, said = 1, 20, []
    while True:
        guess = (low + high) // 2
        step = env.step(f"I guess [{guess}]")
        if step.done:
            return said
        said.append(step.messages[0]["content"])
        low, high = (guess + 1, high) if "higher" in said[-1] else (low, guess - 1)


def test_the_opening_is_the_games_own_prompt(ta):
    opening = TextArena("GuessTheNumber-v0").reset({"prompt": "GuessTheNumber-v0 game 3", "seed": 3})
    assert opening.startswith("You are Player 0. You are playing Guess The Number.\n")
    assert "between 1 and 20 within 10 turns" in opening and "For example, [5]." in opening
    assert "[GAME]" not in opening  # the game's text, not TextArena's transcript of it
    blackjack = TextArena("Blackjack-v0").reset({"seed": 3})
    assert blackjack.startswith("You are playing Blackjack") and "\n\nHand 1/5\nYour hand: " in blackjack


def test_a_winning_play_gets_textarenas_reward_and_each_turn_only_what_is_new(ta):
    env = TextArena("GuessTheNumber-v0")
    env.reset({"seed": 3})
    said = binary_search(env)
    assert target(3) == 8 and said == ["The target number is lower.", "The target number is higher.",
                                       "The target number is higher."]  # 10, 5, 7, then 8
    assert env.reward() == 1.0 and env.outcome == "Congratulations! You guessed the correct number."


def test_a_losing_play_gets_textarenas_partial_reward_at_its_turn_limit(ta):
    env = TextArena("GuessTheNumber-v0", {"max_turns": 2})
    env.reset({"seed": 3})
    assert [env.step(guess).done for guess in ("[15]", "[16]", "[17]")] == [False, False, True]
    # GuessTheNumber's score for a lost game: 1 - |last guess - target| / (max - min)
    assert env.reward() == pytest.approx(1 - abs(17 - 8) / 19)
    assert env.outcome == "The turn limit has been reached. Guess: 17, Target: 8"


def test_invalid_moves_get_the_games_notice_then_its_penalty(ta):
    env = TextArena("GuessTheNumber-v0")
    env.reset({"seed": 3})
    assert env.step("[12]").messages[0]["content"] == "The target number is lower."
    notice = env.step("twelve").messages[0]["content"]  # no number: the first invalid move is forgiven
    assert notice.startswith("You attempted an invalid move. Reason: Invalid move format.")
    last = env.step("[12]")  # a number already guessed: the second invalid move in a row ends the game
    assert last.done and env.outcome.startswith("Invalid Move: Invalid move. Player 0 has already guessed")
    assert env.reward() == pytest.approx(1 - abs(12 - 8) / 19)  # scored by the last valid guess


def test_the_action_is_the_models_text_through_the_ids_own_wrappers(ta):
    plain, raw = TextArena("GuessTheNumber-v0"), TextArena("GuessTheNumber-v0-raw")
    plain.reset({"seed": 3})
    raw.reset({"seed": 3})
    assert plain.step("8").done and plain.reward() == 1.0  # the plain id brackets a turn that has none: [8]
    assert raw.step("8").messages[0]["content"].startswith("You attempted an invalid move.")


def play_blackjack(seed: int, moves: int) -> tuple[list[str], float | None]:
    """A fixed policy (hit, stand, hit, ...) on one game: every message the game sent, and its reward."""
    env = TextArena("Blackjack-v0")
    said = [env.reset({"seed": seed})]
    for k in range(moves):
        step = env.step("[Hit]" if k % 2 == 0 else "[Stand]")
        if step.done:
            break
        said.append(step.messages[0]["content"])
    return said, env.reward()


def test_a_seed_replays_its_game_in_any_thread_and_leaves_the_runs_random_alone(ta):
    alone = [play_blackjack(seed, 40) for seed in (0, 1, 2, 3) * 2]
    assert alone[0] == alone[4] and alone[0][0] != alone[1][0]
    assert all(reward is not None for _, reward in alone)
    together = [None] * len(alone)

    def play(i):
        together[i] = play_blackjack(i % 4, 40)

    random.seed(11)
    expected = random.random()
    random.seed(11)
    threads = [threading.Thread(target=play, args=(i,)) for i in range(len(alone))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert together == alone  # episodes in parallel draw from their own seeded generators
    assert random.random() == expected  # and the global generator is as the run left it


def test_rows_name_a_seed(ta):
    assert game_rows("Blackjack-v0", range(2)) == [{"prompt": "Blackjack-v0 game 0", "seed": 0},
                                                   {"prompt": "Blackjack-v0 game 1", "seed": 1}]
    with pytest.raises(ValueError, match="the row has no 'seed' field \\(fields: prompt\\)"):
        TextArena("Blackjack-v0").reset({"prompt": "hi"})
    with pytest.raises(ValueError, match="the row's 'seed' is 'x'; expected an integer"):
        TextArena("Blackjack-v0").reset({"seed": "x"})


@pytest.mark.parametrize("game", [pytest.param(g, marks=pytest.mark.slow) if g in SLOW_TO_GENERATE else g
                                  for g in OFFLINE_GAMES])
def test_every_listed_game_starts_offline_and_ends_on_invalid_moves_with_a_number(ta, game):
    TextArena.check_args(game)
    env = TextArena(game)
    assert env.reset({"seed": 0})
    for _ in range(4):
        if env.step("<no move here>").done:
            break
    assert env.outcome.startswith("Invalid Move") and isinstance(env.reward(), float)


@pytest.mark.parametrize("game, options, message", [
    ("GuessTheNumbr-v0", None, "textarena has no game 'GuessTheNumbr-v0'; did you mean GuessTheNumber-v0"),
    ("TicTacToe-v0", None, "TicTacToe-v0 is a game for several players"),
    ("PublicGoodsGame-v0", None, "PublicGoodsGame-v0 is a game for several players"),  # it accepts 1 player
    ("GuessWho-v0", None, "GuessWho-v0 cannot start here: ValueError: OpenRouter API key not found"),
    ("GuessTheNumber-v0", {"colour": "red"}, "'episode.env_args.options': textarena's GuessTheNumber-v0 refused"),
    ("", None, "expected a TextArena env id"),
])
def test_games_that_cannot_run_are_config_errors_naming_the_key(ta, monkeypatch, game, options, message):
    monkeypatch.delenv("OPENROUTER_API_KEY", raising=False)
    with pytest.raises(ConfigError) as raised:
        TextArena.check_args(game, options)
    text = str(raised.value)
    assert message in text and text.startswith("config key 'episode.env_args.")
    if "options" not in message and game:
        assert "GuessTheNumber-v0, LightsOut-v0" in text  # the games that do run offline


def test_a_game_that_needs_a_download_says_so(ta):
    try:
        TextArena.check_args("Hangman-v0")
    except ConfigError as exc:
        assert "Hangman-v0 needs nltk's 'words' data" in str(exc) and "python -m nltk.downloader words" in str(exc)
    else:  # nltk's word list is here (or was just downloaded): then the game does run
        import nltk

        assert nltk.data.find("corpora/words")


def test_a_config_naming_a_bad_game_fails_before_any_model(ta, tmp_path):
    from rlhfkit.config.fields import load_config
    from rlhfkit.config.ppo_schema import PPOConfig
    from rlhfkit.envs.load import load_environment

    def load(*overrides):
        return load_environment(load_config(PPOConfig, None, ["actor=x", "env=rlhfkit.envs.textarena:TextArena",
                                                              "data.prompts=p.jsonl", "train.max_steps=1",
                                                              *overrides]))

    assert load("episode.env_args={game: Blackjack-v0}").env_args == {"game": "Blackjack-v0"}
    with pytest.raises(ConfigError, match="config key 'episode.env_args.game': TicTacToe-v0 is a game for several"):
        load("episode.env_args={game: TicTacToe-v0}")
    with pytest.raises(ConfigError, match="TextArena\\(\\) cannot be called: missing a required argument: 'game'"):
        load()


def test_without_textarena_the_error_is_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "textarena", None)  # `import textarena` now raises ImportError
    for call in (lambda: TextArena.check_args("GuessTheNumber-v0"),
                 lambda: TextArena("GuessTheNumber-v0").reset({"seed": 0})):
        with pytest.raises(ConfigError) as raised:
            call()
        assert str(raised.value) == ("config key 'episode.env_args.game': textarena is not installed; "
                                     "pip install 'rlhfkit[textarena]'")
