"""Why training stopped on purpose: one line for the user, exit status 1, no traceback."""


class TrainingStopped(RuntimeError):
    """Raised on every rank with the same one-line message (a policy said stop)."""


class NonFiniteStop(TrainingStopped):
    """The `stop` policy met a non-finite loss or gradient norm at `step`."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step
