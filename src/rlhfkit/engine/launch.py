"""A process's place among the ranks before any engine exists, as its launcher (torchrun, `deepspeed`) set it.

The engines own ranks once they run; this is for the code around them that runs first or outside them (the
command line printing a result, the pipeline writing its summary): only the main process writes.
"""

from __future__ import annotations

import os


def launcher_rank() -> int:
    """The global rank the launcher gave this process (0 when it was started without one)."""
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    return launcher_rank() == 0
