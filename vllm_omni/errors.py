"""Errors that name the stage they come from."""

from __future__ import annotations


class StageError(RuntimeError):
    """A stage failed a request; `cause` is the stage's own exception."""

    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(f"stage {stage!r} failed: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.cause = cause


class StageStartError(RuntimeError):
    """One or more stages could not start; the message names each with its error."""

    def __init__(self, failures: dict[str, BaseException]) -> None:
        lines = [
            f"stage {name!r} failed to start: {type(e).__name__}: {e}"
            for name, e in failures.items()
        ]
        super().__init__("\n".join(lines) + "\n(each stage's own log is above)")
        self.failures = failures
