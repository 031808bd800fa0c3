"""`python -m rlhfkit` with rank 0's HF export slowed by SLOW_EXPORT_S seconds (before it writes anything): the
fault injection of `test_multinode.py`'s long-export test, kept on the test side.

torchrun runs this file in place of `-m rlhfkit` (same arguments). It stands for a model large enough that
rank 0 writes its export for longer than `engine.collective_timeout_s` while the other ranks wait.
"""

import os
import sys
import time

from rlhfkit.cli import main
from rlhfkit.engine import deepspeed_engine

DELAY = float(os.environ["SLOW_EXPORT_S"])
real_write = deepspeed_engine.write_hf_folder


def slow_write(*args, **kwargs):
    time.sleep(DELAY)
    return real_write(*args, **kwargs)


if int(os.environ.get("RANK", "0")) == 0:
    deepspeed_engine.write_hf_folder = slow_write

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
