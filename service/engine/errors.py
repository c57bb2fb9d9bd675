"""The errors the engine raises on purpose (no torch here, so the scheduler can use them). Each is a
kind of the service's domain errors (``service/protocol.py``), which the HTTP layer maps to a status
once (``service/replica.to_service_error``).
"""
from __future__ import annotations

from service.protocol import InvalidRequest, Overloaded, Unavailable


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class QueueFullError(EngineError, Overloaded):
    """The bounded waiting queue is full; retry later (the API answers 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        Overloaded.__init__(self, message, None, retry_after_s)
        self.retry_after_s = retry_after_s


class EngineValidationError(EngineError, InvalidRequest):
    """A request field is out of range; ``field`` names it, ``message`` starts with it (the API answers 422)."""

    def __init__(self, field: str, message: str):
        InvalidRequest.__init__(self, f"{field}: {message}", field)


class EngineStoppedError(EngineError, Unavailable):
    """The engine is stopped (or stopping) and takes no more requests."""

    def __init__(self, message: str = "engine is stopped"):
        Unavailable.__init__(self, message)
