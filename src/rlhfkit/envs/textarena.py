"""TextArena's single-player games as episodes: `env=rlhfkit.envs.textarena:TextArena` (docs/agents.md).

    episode.env_args: {game: Blackjack-v0, options: {num_hands: 3}}   # a TextArena env id; its class's arguments
    rows: {"prompt": "Blackjack-v0 game 7", "seed": 7}                # game_rows(game, seeds) writes them

One episode plays one game, seeded by its row's `seed`, so a run replays the same games and a GRPO group plays one
game several times; the row's prompt is only a label. The game's messages are the user turns: its opening (the
rules, the first board) opens the episode, and after each model turn comes only what is new (a hint, the next
board, an invalid-move notice), since the chat already holds the history that TextArena's observation wrappers
would repeat every turn. The model's text, stripped of surrounding whitespace, is the action, through the id's own
action wrappers (the plain ids bracket a turn that has no brackets: `42` plays `[42]`; `-raw` ids take the text as
it is). The episode's reward is the one TextArena gives when the game ends (`env.close()`); invalid moves are the
game's business (a notice, then its penalty). A game that the episode limits cut short has no TextArena reward and
is left unjudged.

TextArena's games draw from the global `random` module, which their State seeds on reset; every call into TextArena
here runs under one lock with the episode's own generator state swapped in, so episodes in parallel threads neither
disturb each other's games nor the rest of the run's random state.

Checked before any model loads (`TextArena.check_args`): the package, the id, the options, and that the game starts
here with one player (a game that needs downloads or a hosted model, or is for several players, is a ConfigError
naming `episode.env_args.game`).
"""

from __future__ import annotations

import difflib
import random
import re
import sys
import threading
from typing import Any, Optional

from rlhfkit.envs.base import Environment, Step
from rlhfkit.errors import ConfigError

INSTALL = "pip install 'rlhfkit[textarena]'"
KEY = "episode.env_args.game"
# textarena 0.7.4's single-player games that start and play with no network on Python 3.11 (measured by
# tests/unit/test_textarena_env.py); each also comes as `-raw` (no wrappers) and `-train`. Not here: Hangman,
# Wordle, WordLadder and WordSearch (nltk's word lists, downloaded on first use), GuessWho and TwentyQuestions
# (a hosted model on OpenRouter), Klondike and UltimateTexasHoldem (their code needs Python 3.12), Countdown,
# Cryptarithm, Slitherlink and ThreeCardMonte (an invalid move ends them with a string for a reward: a bug of 0.7.4).
OFFLINE_GAMES = (
    "2048-v0", "2048-v0-ultra-easy", "2048-v0-mega-easy", "2048-v0-super-easy", "2048-v0-very-easy", "2048-v0-easy",
    "2048-v0-hard", "2048-v0-very-hard", "2048-v0-extreme",
    "2048-v0-3x3", "2048-v0-5x5", "2048-v0-6x6", "2048-v0-8x8", "2048-v0-10x10",
    "Bandit-v0", "Bandit-v0-hard",
    "Blackjack-v0", "Blackjack-v0-long",
    "Crosswords-v0", "Crosswords-v0-hardcore",
    "FifteenPuzzle-v0",
    "FrozenLake-v0", "FrozenLake-v0-random", "FrozenLake-v0-hardcore",
    "GuessTheNumber-v0", "GuessTheNumber-v0-hardcore",
    "LightsOut-v0",
    "LogicPuzzle-v0", "LogicPuzzle-v0-hard",
    "Mastermind-v0", "Mastermind-v0-hard", "Mastermind-v0-extreme",
    "Minesweeper-v0", "Minesweeper-v0-small", "Minesweeper-v0-medium", "Minesweeper-v0-hard",
    "PegJump-v0",
    "RushHour-v0",
    "Secretary-v0", "Secretary-v0-long",
    "Set-v0",
    "Sokoban-v0", "Sokoban-v0-medium",
    "Sudoku-v0", "Sudoku-v0-very-easy", "Sudoku-v0-easy", "Sudoku-v0-medium", "Sudoku-v0-hard",
    "TowerOfHanoi-v0", "TowerOfHanoi-v0-medium", "TowerOfHanoi-v0-hard", "TowerOfHanoi-v0-hardcore",
    "TowerOfHanoi-v0-extreme",
)

# every call into TextArena holds this lock: its games share the global `random` generator (see the docstring)
_TEXTARENA = threading.Lock()


def library():
    """The textarena module; ConfigError with the install line when it is missing."""
    try:
        import textarena
    except ImportError:
        raise ConfigError(f"config key '{KEY}': textarena is not installed; {INSTALL}") from None
    return textarena


def offline_list() -> str:
    """The offline games, for an error message: the plain ids, the variants said once."""
    plain = [game for game in OFFLINE_GAMES if game.endswith("-v0")]
    return f"{', '.join(plain)} (and their variants, e.g. GuessTheNumber-v0-hardcore; docs/agents.md)"


def game_rows(game: str, seeds) -> list[dict]:
    """Prompt rows for `game`, one per seed: {"prompt": a label, "seed": seed} (the game writes the opening)."""
    return [{"prompt": f"{game} game {seed}", "seed": int(seed)} for seed in seeds]


class TextArena(Environment):
    """A single-player TextArena game (`game`: its env id; `options`: keyword arguments of the game's class, e.g.
    {max_turns: 5}), seeded by the row's `seed` field."""

    def __init__(self, game: str, options: Optional[dict] = None):
        self.game, self.options = game, dict(options or {})
        self.env = None  # the game, with TextArena's wrappers for the id (the action goes through them)
        self.final: Optional[float] = None  # TextArena's reward once the game is over
        self.outcome = ""  # TextArena's reason for the end ("Congratulations! ...", "Invalid Move: ...")
        self._random = None  # this episode's state of the `random` generator

    @classmethod
    def check_args(cls, game: Any = None, options: Any = None) -> None:
        """ConfigError unless `game` is a single-player TextArena game that starts here with `options`."""
        ta = library()
        if not isinstance(game, str) or not game:
            raise ConfigError(f"config key '{KEY}': expected a TextArena env id, e.g. GuessTheNumber-v0; got "
                              f"{game!r}")
        if options is not None and not isinstance(options, dict):
            raise ConfigError(f"config key 'episode.env_args.options': expected a mapping of the game's keyword "
                              f"arguments, got {options!r}")
        known = ta.envs.registration.ENV_REGISTRY
        if game not in known:
            close = difflib.get_close_matches(game, list(known), n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ConfigError(f"config key '{KEY}': textarena has no game {game!r}; {hint}single-player games that "
                              f"run offline: {offline_list()}")
        probe = cls(game, options)
        probe._start(seed=0)
        if not isinstance(probe._base().state, ta.SinglePlayerState):
            raise _multi_player(game)

    # -- the Environment protocol ---------------------------------------------------------------------------
    def reset(self, row: dict) -> str:
        if "seed" not in row:
            raise ValueError(f"the row has no 'seed' field (fields: {', '.join(row) or 'none'}); TextArena rows "
                             f"are {{\"prompt\": \"...\", \"seed\": 7}}")
        try:
            seed = int(row["seed"])
        except (TypeError, ValueError):
            raise ValueError(f"the row's 'seed' is {row['seed']!r}; expected an integer") from None
        return self._start(seed)

    def step(self, text: str) -> Step:
        action = text.strip()  # the space a plain template puts after "Assistant:" is no part of the move
        done, _ = self._call(lambda: self.env.step(action))
        if done:
            rewards, info = self._call(self.env.close)
            self.outcome = str((info or {}).get(0, {}).get("reason", ""))
            value = (rewards or {}).get(0)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"textarena's {self.game} ended with reward {value!r:.80}, not a number (a bug of "
                                 f"the game; its reason: {self.outcome!r:.80})")
            self.final = None if value is None else float(value)
            return Step(done=True)
        return Step([{"role": "user", "content": self._news()}])

    def reward(self) -> Optional[float]:
        return self.final

    # -- TextArena ------------------------------------------------------------------------------------------
    def _start(self, seed: int) -> str:
        """Make the game and reset it for one player with `seed`; its opening messages. A game that cannot start
        here is a ConfigError that says why."""
        ta = library()
        self._random = random.Random(seed).getstate()
        try:
            self.env = self._call(lambda: ta.make(self.game, **self.options))
        except TypeError as exc:
            raise ConfigError(f"config key 'episode.env_args.options': textarena's {self.game} refused "
                              f"{self.options}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a game that cannot import or build here: said in one line
            raise _cannot_start(self.game, exc) from None
        try:
            self._call(lambda: self.env.reset(num_players=1, seed=seed))
        except Exception as exc:  # noqa: BLE001
            if _resets_with_two(ta, self.game, self.options):
                raise _multi_player(self.game) from None
            raise _cannot_start(self.game, exc) from None
        return self._news()

    def _call(self, call):
        """`call()` with this episode's generator state in the global `random` module, the run's own kept."""
        with _TEXTARENA:
            outer = random.getstate()
            random.setstate(self._random)
            try:
                return call()
            finally:
                self._random = random.getstate()
                random.setstate(outer)

    def _base(self):
        """The game under TextArena's wrappers: its observations are what is new since the last turn."""
        from textarena import Wrapper

        env = self.env
        while isinstance(env, Wrapper):
            env = env.env
        return env

    def _news(self) -> str:
        """What the game told the player since its last turn, the player's own action left out (the chat holds it)."""
        from textarena import ObservationType

        _, messages = self._call(self._base().get_observation)
        # (sender, text, kind); a few games write their fields in another order: the action is left out either way
        texts = [str(message[1]).strip() for message in messages if ObservationType.PLAYER_ACTION not in message]
        return "\n\n".join(text for text in texts if text) or "(the game says nothing; play your next move)"


def _resets_with_two(ta, game: str, options: dict) -> bool:
    """Whether `game` starts with two players (a multi-player game refusing one)."""
    try:
        with _TEXTARENA:
            outer = random.getstate()
            try:
                ta.make(game, **options).reset(num_players=2, seed=0)
            finally:
                random.setstate(outer)
    except Exception:  # noqa: BLE001 - any refusal: not a two-player game
        return False
    return True


def _multi_player(game: str) -> ConfigError:
    return ConfigError(f"config key '{KEY}': {game} is a game for several players; TextArena runs single-player "
                       f"games here: {offline_list()}")


def _cannot_start(game: str, exc: Exception) -> ConfigError:
    """Why a game cannot start on this machine, in one line, with the games that can."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip()  # nltk colours the resource's name
    if isinstance(exc, LookupError) and "nltk" in text.lower():
        resource = re.search(r"Resource\W+(\w+)", text)
        name = resource.group(1) if resource else "its corpora"
        why = (f"needs nltk's '{name}' data, which is not on this machine and could not be downloaded; fetch it "
               f"where there is network (python -m nltk.downloader {name}) and point NLTK_DATA at it")
    elif isinstance(exc, SyntaxError) and sys.version_info < (3, 12):
        why = f"does not import on Python {sys.version_info.major}.{sys.version_info.minor}: its code needs 3.12+"
    else:
        why = f"cannot start here: {type(exc).__name__}: {text.splitlines()[0] if text else ''}"
    return ConfigError(f"config key '{KEY}': textarena's {game} {why}; games that run offline: {offline_list()}")
