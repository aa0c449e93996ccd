"""Fault tolerance: each module does one job.

coordination.py  the key-value store every rank shares (torchrun's), for out-of-band agreement
watchdog.py      a collective/p2p blocked past the timeout: name who hung, dump stacks, exit
launcher.py      the launcher (torchrun) died: exit instead of living on as an orphan
preemption.py    SIGTERM/SIGUSR1: every rank agrees on the last step, saves, exits 0
nonfinite.py     a non-finite loss or gradient norm: skip, stop or roll back
spikes.py        loss spikes by a robust z-score over a window
spike_recovery.py  on a loss spike: back to an older checkpoint, skip data (at most K times)
"""
