"""Suite-wide setup: keep it minimal."""

import sys
from pathlib import Path

# Helper modules next to the tests (e.g. tests/parallel/tp_checks.py) are imported as
# `tests.<area>.<module>`; make that work however pytest is launched (`pytest` or `-m pytest`).
_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# The distributed tests' children fork from a server that imported these once (see
# nanotron_parallel.testing): most tests' ranks build a model or a trainer. torch._dynamo:
# torch.optim imports it on a trainer's first optimizer (its @_disable_dynamo wrappers), ~1.3 s
# of CPU in every child otherwise.
from nanotron_parallel.testing import preload  # noqa: E402

preload(
    "torch._dynamo",
    "nanotron_models",
    "nanotron_train.trainer",
    "nanotron_train.config",
    "tests.train.test_checkpoint",
)
