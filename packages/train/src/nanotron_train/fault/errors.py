"""Why training stopped on purpose: one line for the user, exit status 1, no traceback."""


class TrainingStopped(RuntimeError):
    """Raised on every rank with the same one-line message (a policy said stop)."""
