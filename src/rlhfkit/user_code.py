"""The user's own code a config names: `module:function` (or `:Class`) from the working directory or PYTHONPATH, or
`path/to/file.py:function`. A reward function (`reward`), an environment class (`env`), a tool (`episode.tools`) and
a served reward (`rlhfkit serve-reward`) are all loaded here, with one error line naming the file and line that
raised. Imports nothing of rlhfkit but errors, so every layer may load user code through it."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Callable

from rlhfkit.errors import ModelError


def load_user_object(spec: str, what: str = "reward") -> Callable:
    """Import `module:function` (from the working directory or PYTHONPATH) or load `path/file.py:function`.
    An error while importing is one line naming the file and line that raised; `what` names the config key
    (reward, env) in it."""
    target, name = spec.rsplit(":", 1)
    if target.endswith(".py"):
        path = Path(target).expanduser()
        if not path.is_file():
            raise ModelError(f"{what} '{spec}': file '{target}' does not exist")
        module_name = f"rlhfkit_{what}_{path.stem}"
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        # registered while it runs, as an import does: dataclasses and pickling look their module up there
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(module_name, None)
            raise ModelError(f"{what} '{spec}': importing '{target}' failed: {type(exc).__name__}: {exc} "
                             f"({import_failed_at(exc, path)})") from None
    else:
        if os.getcwd() not in sys.path:  # `python -m` adds it, console scripts do not
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as exc:
            if exc.name and target.startswith(exc.name):  # the module itself (or its package) is not found
                raise ModelError(f"{what} '{spec}': cannot import module '{target}': {exc}") from None
            raise ModelError(f"{what} '{spec}': importing module '{target}' failed: {type(exc).__name__}: {exc} "
                             f"({import_failed_at(exc)})") from None
        except Exception as exc:
            raise ModelError(f"{what} '{spec}': importing module '{target}' failed: {type(exc).__name__}: {exc} "
                             f"({import_failed_at(exc)})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ModelError(f"{what} '{spec}': '{target}' has no {'class' if what == 'env' else 'function'} '{name}'")
    return fn


def import_failed_at(exc: BaseException, path: Path | None = None) -> str:
    """'at file.py:LINE' where importing a user's module raised: a syntax error's own place, else the deepest frame
    in `path` (the reward file), else the deepest frame outside the import machinery."""
    import traceback

    if isinstance(exc, SyntaxError) and exc.filename:
        return f"at {exc.filename}:{exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
    own = [f for f in frames if path is not None and Path(f.filename).resolve() == path.resolve()]
    frame = (own or frames)[-1] if frames else None
    return f"at {frame.filename}:{frame.lineno}" if frame else "no traceback"
