"""Host memory a step frees is reused, not returned to the kernel and faulted back in.

glibc maps large blocks afresh, again and again (a page fault per 4 KiB on first
touch); a trainer's process serves such blocks from its heap and keeps the freed memory
(nanotron_train/host_memory.py). Counted in page faults, in a fresh process each: a plain one,
and one that built a Trainer first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.train.test_memory_estimate import raw

COUNT = r"""
import io, json, resource, sys, torch
if sys.argv[1] == "trainer":
    from nanotron_parallel.context import ParallelContext
    from nanotron_train.config import config_from_dict
    from nanotron_train.trainer import Trainer

    Trainer(config_from_dict(json.loads(sys.argv[2]), "memory"), ParallelContext(),
            stream=io.StringIO()).close()
faults = []
for _ in range(5):  # a 64 MiB tensor, as a step's activation would be, made and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(16 << 20)
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults[1:]))  # the first one maps new memory either way
"""


def _faults(kind: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", COUNT, kind, json.dumps(raw(tokens__train_steps=1))],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_trainer_process_reuses_freed_host_memory():
    plain, trainer = _faults("plain"), _faults("trainer")
    pages = (64 << 20) // 4096
    assert sum(plain) >= pages, plain  # mapped and faulted in again
    assert all(n < pages // 100 for n in trainer), trainer  # the same memory, reused
