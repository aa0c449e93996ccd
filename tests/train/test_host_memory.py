"""Host memory a step frees is reused, not returned to the kernel and faulted back in.

glibc maps large blocks afresh, again and again (a page fault per 4 KiB on first touch);
`keep_freed_host_memory` (nanotron_train/host_memory.py) makes a process serve such blocks from
its heap and keep the freed memory, and every Trainer calls it first. Counted in page faults,
in a fresh process each (a plain one, and one that set the thresholds), so nothing else runs
between the allocations.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

COUNT = r"""
import json, resource, sys, torch
if sys.argv[1] == "kept":
    from nanotron_train.host_memory import keep_freed_host_memory
    assert keep_freed_host_memory()
faults = []
for _ in range(16):  # a 64 MiB tensor, as a step's activation would be, made and freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(16 << 20)
    del block
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
# The last four: the tensor's small objects, allocated between the blocks, split the first
# freed blocks until the heap settles (a few rounds; a training loop's RSS settles likewise).
print(json.dumps(faults[-4:]))
"""


def _faults(kind: str) -> list[int]:
    out = subprocess.run(
        [sys.executable, "-c", COUNT, kind],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_kept_host_memory_is_reused_without_page_faults():
    plain, kept = _faults("plain"), _faults("kept")
    pages = (64 << 20) // 4096
    assert all(n >= pages // 2 for n in plain), plain  # mapped and faulted in every time
    assert all(n < pages // 100 for n in kept), kept  # the same memory, reused


def test_every_trainer_keeps_its_host_memory(monkeypatch):
    import nanotron_train.trainer as trainer_mod
    from nanotron_parallel.context import ParallelContext
    from nanotron_parallel.testing import shared_default_group
    from nanotron_train.config import config_from_dict
    from tests.train.test_memory_estimate import raw

    calls = []
    monkeypatch.setattr(trainer_mod, "keep_freed_host_memory", lambda: calls.append(1))
    with shared_default_group():
        pc = ParallelContext()
        try:
            trainer_mod.Trainer(config_from_dict(raw(), "test"), pc, stream=io.StringIO()).close()
        finally:
            pc.destroy()
    assert calls == [1]
