"""run_distributed itself: results in rank order, a failing rank's traceback, a hang's timeout."""

from __future__ import annotations

import os
import time

import pytest

from nanotron_parallel.testing import DistributedTestError, run_distributed


def fail_on_rank_one(marker: str) -> int:
    rank = int(os.environ["RANK"])
    if rank == 1:
        raise KeyError(f"{marker} from rank {rank}")
    return rank * 10


def hang_on_rank_one() -> int:
    if int(os.environ["RANK"]) == 1:
        time.sleep(600)
    return os.getpid()


def test_failing_rank_reports_its_traceback() -> None:
    with pytest.raises(DistributedTestError) as err:
        run_distributed(fail_on_rank_one, 2, "boom-7f3", timeout=180)
    assert err.value.rank == 1
    message = str(err.value)
    assert "rank 1 of 2 failed" in message
    assert "KeyError: 'boom-7f3 from rank 1'" in message
    assert "in fail_on_rank_one" in message  # the child's own frame, not just the parent's
    assert isinstance(err.value, AssertionError)


def test_hanging_rank_fails_within_timeout_and_leaves_no_process() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"timed out after 12s") as err:
        run_distributed(hang_on_rank_one, 2, timeout=12)
    assert time.monotonic() - start < 12 + 20  # the stack dump and kill take a few seconds
    # Rank 0 may or may not have finished starting up on a loaded machine; rank 1 never does.
    assert 1 in err.value.ranks
    import multiprocessing

    assert multiprocessing.active_children() == []


def test_local_functions_are_refused() -> None:
    def local() -> None:
        pass

    with pytest.raises(ValueError, match="module-level function"):
        run_distributed(local, 1)


def store_lookup_after_last_collective(delay_s: float) -> bytes:
    """Rank 0 (the store's host) leaves the block at once; rank 1 reads the store later."""
    import torch.distributed as dist

    from nanotron_parallel.testing import shared_default_group

    with shared_default_group():
        store = dist.distributed_c10d._get_default_store()
        store.set(f"rank{dist.get_rank()}", "here")
        dist.barrier()  # the last collective
        if dist.get_rank() == 1:
            time.sleep(delay_s)
            return store.get("rank0")
    return b"host"


def test_the_store_host_waits_for_every_rank_to_leave_the_shared_group() -> None:
    # Before, rank 0 destroyed the group (and the store it hosts) on leaving, and rank 1's
    # lookup failed with "Connection reset by peer".
    assert run_distributed(store_lookup_after_last_collective, 2, 1.0, timeout=120) == [
        b"host",
        b"here",
    ]
