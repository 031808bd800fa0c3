"""Every error rlhfkit raises on purpose, in one module at the bottom layer (it imports nothing).

The command line turns a `USER_ERRORS` exception into one line, `rlhfkit VERB: error: MESSAGE`, and exit code
2; each message says what is wrong and where (a config key, a file:line and field, a model folder) and, where
there is one, what to do. `RunStopped` is not a failure: a signal stopped the run after it saved a checkpoint.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config problem; the message names the offending dotted key."""


class DataError(ValueError):
    """Input data that cannot be read or converted; the message is one line naming file, line and field:

        data/train.jsonl:17: field 'chosen': missing (row has keys: prompt, response)
    """


class OfflineError(DataError):
    """A hub dataset could not be fetched because there is no network; callers may look for a local copy."""


class ModelError(ValueError):
    """A model or tokenizer cannot be loaded; the message says which folder and why."""


class RunError(RuntimeError):
    """A run cannot start or continue; the message says why and what to do."""


class RunStopped(RuntimeError):
    """A run stopped on request (SIGTERM / SIGINT) after saving a checkpoint; the message says how to resume."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


class TemplateRefused(ValueError):
    """The chat template raised on a conversation, even with same-role turns merged; the row is unusable
    (skipped and counted, or a DataError with `data.strict_rows`)."""


# what a command reports as one line and exit code 2
USER_ERRORS = (ConfigError, DataError, ModelError, RunError)


def where(source: str, line: int | None) -> str:
    """`path:line` (1-based line or row), or just `path` when the source has no lines (e.g. a whole file)."""
    return f"{source}:{line}" if line is not None else str(source)
