"""The OpenAI-compatible HTTP API of `dlo serve` (FastAPI), served by rank 0.

Routes: `POST /v1/images/generations`, `POST /v1/videos` (JSON or multipart/form-data, as the
official SDK sends it), `GET /v1/videos` (list), `GET` and `DELETE /v1/videos/{id}`,
`GET /v1/videos/{id}/content`, `GET /v1/models` (the model, and its LoRA adapters as `MODEL:NAME`),
`/health` and `/ready` (GET and HEAD), `/metrics`.
Errors use OpenAI's body `{"error": {message, type, param, code}}`: 400 invalid fields (FastAPI's 422
included) or a request its own input failed on its rank, 401 wrong key, 404 unknown model, video or
route, 405 wrong method, 409 deleting an unfinished video, 413 body over `Limits.max_body_bytes`
(refused before any of it is parsed), 429 queue full (with Retry-After), 499 (counted only: the
client left before its answer), 500 one request failed alone (on its rank, or an unexpected error
here: always JSON), 502/504 the pod of a video job could not answer a forwarded request, 503 not
ready, draining (with Retry-After) or after a rank failure. A video request for a job of another
pod is answered from the shared video folder when that job is finished there, else forwarded to its
pod (`peers.py`); a job whose pod cannot be reached and that the folder does not hold is a 404.
`create_app` builds the app in named steps: middleware, error handlers, each group of routes.
Owns: HTTP only: routes, request bodies, waiting for a result while the client is there (a client
that leaves withdraws its request: `Engine.withdraw`), OpenAI error bodies, and the one mapping of
the service's domain errors (`dlo.serving.errors`) to status codes (`status_of`).
Must never: hold serving logic (queueing, waves, jobs: `service.py`), answer a client's malformed
input with a 5xx, decode an image on the event loop, or hold more than the body limit of any one
request in memory.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Iterator, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dlo.serving.accounting import CLIENT_CLOSED, Accounting
from dlo.serving.api_models import (
    ApiError,
    ImageGenerationRequest,
    ImagesResponse,
    ModelCard,
    ModelList,
    VideoCreateRequest,
    VideoDeleted,
    VideoError,
    VideoList,
    VideoObject,
    image_generation,
    model_caches,
    video_generation,
)
from dlo.serving.body_limit import BodyLimit
from dlo.serving.control import Result
from dlo.serving.request_bodies import body_error, validation_message, video_body
from dlo.serving.errors import (
    EngineUnavailable,
    InvalidInput,
    InvalidRequest,
    QueueFull,
    ServiceError,
    ShuttingDown,
    VideoElsewhere,
    VideoNotFinished,
    VideoNotFound,
    VideoNotReady,
)
from dlo.serving.faults import InjectedFault
from dlo.serving.peers import FORWARDED_HEADER, PeerError, Peers
from dlo.serving.service import Engine
from dlo.serving.tenants import Caller, HeldRequests, Tenants
from dlo.serving.videos import VideoJob

log = logging.getLogger(__name__)

TILED_HEADER = "X-DLO-VAE-Tiled"  # true: the decode ran tiled (not a plain decode's bytes: --vae-tiling)


def server_timing(res: Result) -> str:
    """The `Server-Timing` header of an answer: its rank's seconds per phase (prepare: text encoding,
    scheduler and latents; denoise; decode; encode_output) and in all, in milliseconds (what the
    HTTP side adds is the client's total less these)."""
    parts = [f"{name};dur={seconds * 1000:.1f}" for name, seconds in res.phase_seconds.items()]
    return ", ".join([*parts, f"rank;dur={res.seconds * 1000:.1f}"])
SHUTDOWN_RETRY_AFTER_S = 1  # a draining replica's 503: the Service already sends the retry elsewhere
_VIDEO_SCHEMA_REF = {"$ref": "#/components/schemas/VideoCreateRequest"}
# Reading a video request (its input_reference decoded) is CPU work: off the loop, two at a time.
_DECODE = ThreadPoolExecutor(2, thread_name_prefix="dlo-decode")


class ClientGone(Exception):
    """The client closed its connection while its request waited for or ran in a wave."""


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def status_of(e: ServiceError) -> int:
    """The HTTP status of a domain error: 429 for a full queue (retry later), 503 when the engine
    cannot serve (loading, stopping, failed), 404/409 for video jobs, 500 for anything the service
    did not expect."""
    if isinstance(e, QueueFull):
        return 429
    if isinstance(e, InvalidRequest):
        return 400
    if isinstance(e, (VideoNotFound, VideoElsewhere)):
        return 404
    if isinstance(e, VideoNotReady):
        return 400 if e.failed else 404
    if isinstance(e, VideoNotFinished):
        return 409
    if isinstance(e, EngineUnavailable):
        return 503
    if isinstance(e, InvalidInput):
        return 400
    return 500


def api_error(e: ServiceError) -> ApiError:
    return ApiError(status_of(e), e.message, getattr(e, "param", None), e.code)


def _service_response(e: ServiceError) -> JSONResponse:
    """The error body, plus `Retry-After` (seconds) where the domain error carries a hint."""
    response = _error(api_error(e))
    retry_after = getattr(e, "retry_after_s", None)
    if retry_after is None and isinstance(e, ShuttingDown):  # a draining replica: retry elsewhere
        retry_after = SHUTDOWN_RETRY_AFTER_S
    if retry_after is not None:
        response.headers["Retry-After"] = str(int(retry_after))
    return response


def create_app(engine: Engine, tenants: Tenants | None = None, peers: Peers | None = None) -> FastAPI:
    """The app; `tenants` (None: no keys) who may call, `peers` (None: a single pod) where the pods
    named by other video ids answer."""
    tenants = tenants if tenants is not None else Tenants()
    held = HeldRequests(tenants.max_queue, engine.metrics.mean_wave_seconds)  # each tenant's share of the queue

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await engine.startup()
        yield
        await engine.shutdown()
        if peers is not None:
            await peers.close()

    app = FastAPI(title="dlo serve", version="1", lifespan=lifespan,
                  description="OpenAI-compatible image and video generation on the Distributed Layerwise Offload "
                              "engine.")
    app.add_middleware(BodyLimit, max_bytes=engine.limits.max_body_bytes)
    # outermost of ours: every answer is counted (413s included), no body is read before the key
    app.add_middleware(Accounting, metrics=engine.metrics, tenants=tenants, routes=app.router.routes)
    _add_error_handlers(app, peers)
    _add_generation_routes(app, engine, held)
    _add_video_routes(app, engine)
    _add_operation_routes(app, engine)
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    return app


def _add_error_handlers(app: FastAPI, peers: Peers | None) -> None:
    """Every refusal in OpenAI's shape: our errors, the service's domain errors, FastAPI's own."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, e: ApiError) -> JSONResponse:
        return _error(e)

    @app.exception_handler(ServiceError)
    async def _service_error(_request: Request, e: ServiceError) -> JSONResponse:
        return _service_response(e)

    @app.exception_handler(VideoElsewhere)
    async def _elsewhere(request: Request, e: VideoElsewhere) -> Response:
        return await _forward(request, e, peers)

    @app.exception_handler(ClientGone)
    async def _gone(_request: Request, _e: ClientGone) -> Response:  # nobody reads it: counted as 499
        return _error(ApiError(CLIENT_CLOSED, "the client closed the connection", code="client_closed_request"))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        whole = body_error(list(e.errors()), request.headers.get("content-type", ""))  # no JSON object at all
        if whole is not None:
            return _error(whole)
        message, param = validation_message(list(e.errors()))
        return _error(ApiError(400, message, param, "invalid_request"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        # A bug in one request's handling (validation included) fails that request alone, in
        # OpenAI's shape, never as a plain-text 500.
        log.error("request failed path=%s error=%s: %s", request.url.path, type(e).__name__, e,
                  exc_info=not isinstance(e, InjectedFault))
        return _error(ApiError(500, f"the server failed this request: {type(e).__name__}: {e}",
                               code="internal_error"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        status = e.status_code if e.status_code < 500 else 503
        message, code = str(e.detail), None
        if status == 404:
            message, code = f"no route {request.method} {request.url.path}", "not_found"
        elif status == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
            code = "method_not_allowed"
        elif status == 400:  # FastAPI could not read the body: a value JSON allows that Python refuses
            cause = e.__cause__
            message = f"the request body could not be read: {cause or e.detail}"
            code = "invalid_json" if isinstance(cause, json.JSONDecodeError) else "invalid_value"
        err = ApiError(status, message, code=code)
        return JSONResponse(err.body(), status_code=status, headers=getattr(e, "headers", None))


async def _forward(request: Request, e: VideoElsewhere, peers: Peers | None) -> Response:
    """A job of another pod that the shared folder does not hold finished: ask that pod, unless this
    request was forwarded already. A pod that cannot be reached and left no record is gone: 404."""
    gone = ApiError(404, f"no video job {e.video_id!r} here (it names pod {e.pod!r}, which this server cannot "
                         "reach, and the video folder holds no finished record of it)", "video_id", "not_found")
    if peers is None or peers.url(e.pod) is None or FORWARDED_HEADER in request.headers:
        return _error(gone)
    try:
        return await peers.forward(request, e.pod)
    except PeerError as pe:
        log.warning("forwarding %s %s to pod %s failed: %s", request.method, request.url.path, e.pod, pe)
        if pe.code == "upstream_unreachable" and not e.recorded:
            return _error(gone)
        return _error(ApiError(pe.status, pe.message, None, pe.code))


async def _result_unless_gone(request: Request, engine: Engine, fut: asyncio.Future) -> Any:
    """The request's result; `ClientGone` when its client closes the connection first, after the
    request is withdrawn (a queued one never reaches the ranks; a running one finishes its wave)."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({fut, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if fut.done():
        return fut.result()
    dropped = engine.withdraw(fut)
    log.info("client left path=%s %s", request.url.path,
             "dropped before its wave" if dropped else "in its wave: the wave finishes, its result is dropped")
    raise ClientGone()


def _caller(request: Request) -> Caller:
    """Who sent `request` (set by `Accounting` before any route runs)."""
    return request.state.caller


def _add_generation_routes(app: FastAPI, engine: Engine, held: HeldRequests) -> None:
    @app.post("/v1/images/generations", response_model=ImagesResponse,
              summary="Create images (OpenAI Images API; extensions: seed, num_inference_steps, guidance_scale, "
                      "negative_prompt)")
    async def images(body: ImageGenerationRequest, request: Request, response: Response) -> ImagesResponse:
        engine.check_available()
        gen = image_generation(body, engine.facts, engine.limits, engine.model_id, engine.adapters,
                               engine.cfg.settings.cache)
        fut = held.submit(_caller(request), lambda: engine.submit(gen))
        res = await _result_unless_gone(request, engine, fut)
        response.headers[TILED_HEADER] = "true" if engine.decode_tiled(gen) else "false"
        response.headers["Server-Timing"] = server_timing(res)
        return ImagesResponse(
            created=int(time.time()),
            data=[{"b64_json": base64.b64encode(png).decode()} for png in res.outputs or ()],  # type: ignore[misc]
        )

    @app.post(
        "/v1/videos", response_model=VideoObject, summary="Create a video job (OpenAI Videos API)",
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": _VIDEO_SCHEMA_REF},
            "multipart/form-data": {"schema": _VIDEO_SCHEMA_REF},
        }}},
    )
    async def create_video(request: Request) -> VideoObject:
        engine.check_available()
        body = await video_body(request)
        gen = await asyncio.get_running_loop().run_in_executor(
            _DECODE, video_generation, body, engine.facts, engine.limits, engine.model_id, engine.adapters,
            engine.cfg.settings.cache)
        seconds = f"{gen.frames / gen.fps:g}"
        return _video_object(engine, engine.jobs.create(gen, seconds, _caller(request), held))


def _add_video_routes(app: FastAPI, engine: Engine) -> None:
    @app.get("/v1/videos", response_model=VideoList,
             summary="This pod's video jobs of the caller's tenant (an admin key: all), newest first by default "
                     "(OpenAI cursor: limit, after, order)")
    async def list_videos(request: Request, limit: int = Query(20, ge=1, le=100),
                          after: str | None = Query(None, max_length=200),
                          order: Literal["asc", "desc"] = "desc") -> VideoList:
        jobs, has_more = engine.videos.list(limit=limit, after=after, order=order, caller=_caller(request))
        return VideoList(data=[_video_object(engine, j) for j in jobs], has_more=has_more,
                         first_id=jobs[0].id if jobs else None, last_id=jobs[-1].id if jobs else None)

    @app.get("/v1/videos/{video_id}", response_model=VideoObject, summary="A video job's status")
    async def get_video(video_id: str, request: Request) -> VideoObject:
        return _video_object(engine, engine.videos.get(video_id, _caller(request)))

    @app.delete("/v1/videos/{video_id}", response_model=VideoDeleted,
                summary="Delete a completed or failed video job and its file (409 while queued or running)")
    async def delete_video(video_id: str, request: Request) -> VideoDeleted:
        return VideoDeleted(id=engine.videos.delete(video_id, _caller(request)).id)

    @app.get("/v1/videos/{video_id}/content", summary="The MP4 of a completed video job",
             responses={200: {"content": {"video/mp4": {}}}})
    async def video_content(video_id: str, request: Request, variant: str = "video") -> Response:
        caller = _caller(request)
        engine.videos.content_path(video_id, caller)  # an unknown or unfinished job: its error before the variant's
        if variant != "video":
            raise ApiError(400, f"variant {variant!r} is not available; only \"video\"", "variant", "invalid_value")
        f = engine.videos.open_content(video_id, caller)  # opened now, never through a link: streams whole if it expires
        size = os.fstat(f.fileno()).st_size

        def chunks() -> Iterator[bytes]:
            with f:
                while block := f.read(1 << 16):
                    yield block

        return StreamingResponse(chunks(), media_type="video/mp4", headers={"Content-Length": str(size)})


def _add_operation_routes(app: FastAPI, engine: Engine) -> None:
    @app.get("/v1/models", response_model=ModelList,
             summary="The served model, then each LoRA adapter as MODEL:NAME with its parent (as vLLM lists adapters)")
    async def models() -> ModelList:
        cards = [ModelCard(id=engine.model_id, created=engine.created, limits=engine.limits.model_dump(),
                           caches=model_caches(engine.facts, engine.cfg.settings.cache))]
        cards += [ModelCard(id=f"{engine.model_id}:{name}", created=engine.created, parent=engine.model_id, root=root)
                  for name, root in engine.adapters.items()]
        return ModelList(data=cards)

    @app.api_route("/health", methods=["GET", "HEAD"],
                   summary="200 unless a rank failed or the start is stuck; the state and the requests running and "
                           "queued")
    async def health() -> JSONResponse:
        reason = engine.unhealthy_reason()
        if reason is not None:
            return JSONResponse({"status": "unhealthy", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok", "state": engine.state, **engine.occupancy()})

    @app.api_route("/ready", methods=["GET", "HEAD"], summary="200 once every rank has loaded and none failed")
    async def ready() -> JSONResponse:
        if not engine.ready:
            return JSONResponse({"ready": False, "state": engine.state, "reason": engine.failure}, status_code=503)
        return JSONResponse({"ready": True, "mode": engine.cfg.mode, "dp": engine.cfg.dp, "sp": engine.cfg.sp,
                             "warmup_seconds": engine.warmup_seconds, "warmup_size": engine.warm.size_text,
                             "warmup_steps": engine.warm.steps,
                             "startup_seconds": engine.startup_seconds,
                             "ranks": engine.rank_summary(), "plan": engine.options.plan})

    @app.get("/metrics", summary="Prometheus metrics (docs/contracts.md section 5)")
    async def metrics() -> Response:
        return Response(engine.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _openapi(app: FastAPI) -> dict[str, Any]:
    """The schema; /v1/videos parses its body itself (JSON or multipart): its body's schema too."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        defs = schema.setdefault("components", {}).setdefault("schemas", {})
        body = VideoCreateRequest.model_json_schema(ref_template="#/components/schemas/{model}")
        defs.update(body.pop("$defs", {}))
        defs["VideoCreateRequest"] = body
        app.openapi_schema = schema
    return app.openapi_schema


def _video_object(engine: Engine, job: VideoJob) -> VideoObject:
    return VideoObject(
        id=job.id, created_at=job.created_at, completed_at=job.completed_at, expires_at=job.expires_at,
        model=job.model, progress=engine.jobs.progress(job), prompt=job.prompt, seconds=job.seconds, size=job.size,
        status=job.status, error=VideoError(**job.error) if job.error is not None else None,
        vae_tiled=job.vae_tiled, timings=job.phase_seconds,
    )
