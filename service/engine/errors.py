"""The errors the engine raises on purpose (no torch here, so the scheduler can use them).

The HTTP layer maps each to a status once (``service/api/errors.py``).
"""
from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class QueueFullError(EngineError):
    """The bounded waiting queue is full; retry later (the API answers 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineValidationError(EngineError, ValueError):
    """A request field is out of range; ``field`` names it (the API answers 422)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class EngineStoppedError(EngineError):
    """The engine is stopped (or stopping) and takes no more requests."""
