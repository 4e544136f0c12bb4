"""The serving domain's errors: what the service raises, and what the server maps to HTTP.

Owns: one exception type per way a request can be refused or lost by the service, each with a
stable `code` (also the OpenAI-style error code the server sends). The HTTP status of each is the
server's business (`server.py`), never the service's.
Must never: import FastAPI or name HTTP status codes.
"""

from __future__ import annotations

from typing import Protocol


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
    """The wave queue holds `--max-queue` requests: retry after `retry_after_s` seconds (a hint)."""

    code = "queue_full"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TenantQueueFull(QueueFull):
    """One tenant (or, without named keys, one client address) holds `--max-queue-per-tenant`
    requests queued or running: the others are still served."""

    code = "tenant_queue_full"


class EngineUnavailable(ServiceError):
    """The engine cannot take requests now (loading, stopping, or failed)."""

    code = "not_ready"


class EngineFailed(EngineUnavailable):
    """A rank died, stalled or failed: the server exits and the pod restarts."""

    code = "engine_failed"


class ShuttingDown(EngineUnavailable):
    """The server is stopping (SIGTERM, or after a fault)."""

    code = "shutting_down"


# -- video jobs (dlo.serving.videos) ---------------------------------------------------------
class VideoNotFound(ServiceError):
    """No such video job here (never created, deleted, or expired); `param` names the field."""

    code = "not_found"

    def __init__(self, message: str, *, param: str = "video_id") -> None:
        super().__init__(message)
        self.param = param


class VideoNotReady(ServiceError):
    """A job's content was asked for before it completed (`failed`: it never will)."""

    code = "video_not_ready"

    def __init__(self, message: str, *, failed: bool = False) -> None:
        super().__init__(message)
        self.failed = failed


class VideoNotFinished(ServiceError):
    """A queued or running job cannot be deleted: it holds a place in a wave."""

    code = "video_not_finished"


class VideoElsewhere(ServiceError):
    """The job id names another pod: ask that pod (the server forwards the request). `recorded`:
    the shared folder holds its (unfinished) record, so the job existed."""

    code = "video_elsewhere"

    def __init__(self, pod: str, video_id: str, *, recorded: bool = False) -> None:
        super().__init__(f"video {video_id} belongs to pod {pod}")
        self.pod, self.video_id, self.recorded = pod, video_id, recorded


class VideoStorageError(ServiceError):
    """The video folder could not be written (full, read-only): the job was not recorded, or a
    delete did not happen."""

    code = "storage_error"


class VideoStoreReadOnly(EngineUnavailable):
    """The video folder cannot be written: this server takes no video jobs (another replica may)."""

    code = "storage_read_only"


class VideoJobsFull(QueueFull):
    """The store holds its maximum of video jobs (in all, or of this tenant or client): none is evicted
    before it expires, so a new one waits."""

    code = "too_many_video_jobs"

    def __init__(self, message: str, retry_after_s: int = 60) -> None:
        super().__init__(message, retry_after_s)


class RequestFailed(ServiceError):
    """One request failed on its rank outside the collective schedule; the engine serves on."""

    code = "generation_failed"


class InvalidInput(RequestFailed):
    """One request failed on its rank because of its own input."""

    code = "invalid_input"


def request_failed(err: "RequestErrorLike") -> RequestFailed:
    """The domain error of a request that failed alone on its rank (`control.RequestError`)."""
    if err.client_fault:
        return InvalidInput(f"the request could not be processed ({err.phase}): {err.message}")
    return RequestFailed(f"generating this request failed ({err.phase}): {err.message}; other requests are "
                         "unaffected, retrying may succeed")


class RequestErrorLike(Protocol):
    phase: str
    message: str
    client_fault: bool
