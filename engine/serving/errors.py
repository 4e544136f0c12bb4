"""The serving domain's errors: what the service raises, and what the server maps to HTTP.

Owns: one exception type per way a request can be refused or lost by the service, each with a
stable `code` (also the OpenAI-style error code the server sends). The HTTP status of each is the
server's business (`server.py`), never the service's.
Must never: import FastAPI or name HTTP status codes.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request the service cannot take or could not finish; `code` names the reason."""

    code = "service_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(ServiceError):
    """A request this server's configuration cannot run (e.g. tokens that do not split over --sp)."""

    code = "invalid_value"


class QueueFull(ServiceError):
    """The wave queue holds `--max-queue` requests: retry later."""

    code = "queue_full"


class EngineUnavailable(ServiceError):
    """The engine cannot take requests now (loading, stopping, or failed)."""

    code = "not_ready"


class EngineFailed(EngineUnavailable):
    """A rank died, stalled or failed: the server exits and the pod restarts."""

    code = "engine_failed"


class ShuttingDown(EngineUnavailable):
    """The server is stopping (SIGTERM, or after a fault)."""

    code = "shutting_down"
