"""The layout planner: for a model, a cluster and a batch, which layouts fit and which is fastest.

`python -m nanotron_train.plan` (cli.py). enumerate.py lists the candidate layouts (each a
config the config checks accept), memory.py is the memory model (shared with the check before
allocation), comm.py the bytes each collective moves per step, step_time.py the step time,
devices.py the device constants, calibrate.py fits them from a run's metrics file.
"""
