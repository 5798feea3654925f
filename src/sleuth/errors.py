"""Errors that name the input at fault and say what to fix."""

from __future__ import annotations


class SleuthError(Exception):
    """Base class for errors meant to be shown to a user without a traceback."""


class DataFormatError(SleuthError):
    """A record in an input file is malformed. Carries the path and 1-based line number."""

    def __init__(self, path: str, line: int | None, message: str):
        self.path = str(path)
        self.line = line
        self.message = message
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {message}")


class ConfigError(SleuthError):
    """A config value is invalid; the message names the field."""


class IndexMismatchError(SleuthError):
    """An index was built from a different corpus or with different parameters."""


class ServiceError(SleuthError):
    """A remote service (retriever, generator, judge) failed after all retries."""


class CheckpointError(SleuthError):
    """A checkpoint is damaged or incomplete; the message names the file."""


class OutputError(SleuthError):
    """An output could not be written (disk full, read-only, no permission); names the path and the bytes."""
