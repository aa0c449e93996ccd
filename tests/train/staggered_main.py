"""`torchrun -m tests.train.staggered_main ARGS`: `python -m nanotron_train ARGS`, except that
local rank 0 starts 20 s late, so some other rank always stops first: a config error must still
be printed (test_torchrun_errors.py). torchrun stops rank 0 when the first rank exits."""

from __future__ import annotations

import os
import time

from nanotron_train.__main__ import main
from nanotron_train.process_exit import exit_process

if __name__ == "__main__":
    if os.environ.get("LOCAL_RANK") == "0":
        time.sleep(20)
    exit_process(main())
