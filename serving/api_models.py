"""HTTP bodies of the OpenAI-compatible API, and their translation into `Generation`s.

Owns: the pydantic request and response models (OpenAI Images and Videos shapes plus our
extensions `seed`, `num_inference_steps`, `guidance_scale`, `negative_prompt`, `lora`, `lora_scale`, `cache`;
a LoRA adapter is also chosen by the model id `MODEL:ADAPTER`, as GET /v1/models lists it), the OpenAI error
body, and every limit check: anything a client can get wrong is an `ApiError` with status 400 and
the offending field in `param`, never a 5xx.
Must never: import torch.
"""

from __future__ import annotations

import math
import re
import secrets
from typing import Any, Collection, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from dlo.plan.limits import Limits
from dlo.engine.cache_presets import NONE, PRESETS, CacheSpec, CacheSpecError, cache_spec, listing
from dlo.engine.families import PipelineFacts
from dlo.engine.request import Generation
from dlo.serving.served_limits import default_frames, default_size, default_steps

MAX_SEED = 2**63 - 1
MAX_LORA_SCALE = 10.0  # |lora_scale|: peft takes any float; beyond this an adapter only breaks images
_SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")  # ASCII digits, matched whole (no trailing newline)


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        # any other 4xx (404 route, 405 method, 409 conflict) is still the client's request
        kind = self.TYPES.get(self.status) or ("invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


class _Extensions(BaseModel):
    """Fields beyond OpenAI's: how the diffusion runs."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="the served model's id (GET /v1/models); optional")
    prompt: str = Field(..., description="what to generate")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="same seed, same bytes; random when omitted")
    num_inference_steps: int | None = Field(None, description="denoising steps (server default when omitted)")
    guidance_scale: float | None = Field(None, allow_inf_nan=False, description="classifier-free guidance scale")
    negative_prompt: str | None = Field(None, description="what to steer away from")
    lora: str | None = Field(None, description="a LoRA adapter of this server by name (GET /v1/models lists it as "
                                               "MODEL:NAME; `model: \"MODEL:NAME\"` chooses it too)")
    lora_scale: float | None = Field(None, allow_inf_nan=False,
                                     description=f"the adapter's strength, -{MAX_LORA_SCALE:g} to {MAX_LORA_SCALE:g} "
                                                 "(peft's scale: 0 the base model, 1 as trained; default 1)")
    cache: str | dict[str, Any] | None = Field(
        None, description=f"a step cache (diffusers' cache hooks): a preset's name ({', '.join(PRESETS)}), or "
                          "{\"preset\": NAME, PARAMETER: VALUE, ...} (GET /v1/models lists the presets and their "
                          f"parameters); \"{NONE}\": none; omitted: the server's default (dlo serve --cache)")
    user: str | None = Field(None, description="accepted for OpenAI compatibility; unused")

    @field_validator("guidance_scale", "lora_scale", mode="before")
    @classmethod
    def _a_number_not_a_flag(cls, v: Any) -> Any:
        if isinstance(v, bool):  # JSON true is no scale (pydantic would take it as 1.0)
            raise ValueError("must be a number, not true or false")
        return v

    @field_validator("cache", mode="before")
    @classmethod
    def _preset_or_object(cls, v: Any) -> Any:
        if v is not None and not isinstance(v, (str, dict)):  # else pydantic names a member of the union
            raise ValueError(f"must be a preset name or an object {{\"preset\": NAME, ...}}, got {type(v).__name__}")
        return v

    @field_validator("prompt", "negative_prompt")
    @classmethod
    def _unicode_text(cls, v: str | None) -> str | None:
        # JSON may escape a lone UTF-16 surrogate ("\ud800"): a str Python holds but no encoder or
        # tokenizer accepts. Refused here, before the request is queued.
        if v is not None:
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"must be valid Unicode text: character {e.start} is a lone UTF-16 surrogate "
                                 f"({v[e.start]!r})") from None
        return v


class ImageGenerationRequest(_Extensions):
    n: int = Field(1, description="number of images")
    size: str | None = Field(None, description='"WIDTHxHEIGHT", multiples of the model\'s patch size, '
                                               'at least its smallest side')
    response_format: Literal["b64_json", "url"] = Field("b64_json", description="only b64_json is served")
    output_format: Literal["png"] | None = None
    quality: str | None = Field(None, description="accepted for OpenAI compatibility; unused")
    style: str | None = Field(None, description="accepted for OpenAI compatibility; unused")


class VideoCreateRequest(_Extensions):
    seconds: str | int | float | None = Field(None, description='clip length ("4", "8", "12"); frames = seconds x fps, '
                                                                "rounded to the model's valid counts")
    size: str | None = Field(None, description='"WIDTHxHEIGHT"')
    num_frames: int | None = Field(None, description="exact frame count (overrides seconds)")
    input_reference: Any = Field(None, description="image-to-video models: the first frame (PNG/JPEG/WebP; a "
                                                    "multipart file upload as the official SDK sends it, or a "
                                                    "base64 data URL in JSON); refused by text-to-video models")

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds_number(cls, v: Any) -> Any:
        if v is None:
            return v
        try:
            f = float(v)
        except (TypeError, ValueError):
            raise ValueError("seconds must be a number such as \"4\"") from None
        if not math.isfinite(f) or f <= 0 or f > 3600:
            raise ValueError("seconds must be > 0 and <= 3600")
        return f


class ImageData(BaseModel):
    b64_json: str


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dlo"
    parent: str | None = None  # a LoRA adapter's base model (as vLLM lists adapters)
    root: str | None = None  # a LoRA adapter's file or folder in --lora-dir
    limits: dict[str, Any] | None = None  # the base model's: the largest request accepted (derived or given)
    caches: dict[str, Any] | None = None  # the base model's step caches: presets, defaults (`cache_presets.listing`)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VideoError(BaseModel):
    code: str
    message: str


class VideoObject(BaseModel):
    id: str
    object: Literal["video"] = "video"
    created_at: int
    completed_at: int | None = None
    expires_at: int | None = None
    model: str
    progress: int
    prompt: str | None = None
    seconds: str
    size: str
    status: Literal["queued", "in_progress", "completed", "failed"]
    error: VideoError | None = None
    # extensions: whether its decode runs tiled (not the bytes of a plain decode: dlo serve --vae-tiling),
    # and once completed, its rank's seconds per phase (prepare, denoise, decode, encode_output)
    vae_tiled: bool | None = None
    timings: dict[str, float] | None = None


class VideoList(BaseModel):
    """`GET /v1/videos`: OpenAI's cursor page (`after` = the `last_id` of the previous page)."""

    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool = True


# ---- translation --------------------------------------------------------------------------------
def _bad(message: str, param: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value")


def parse_size(size: str, facts: PipelineFacts, limits: Limits) -> tuple[int, int]:
    m = _SIZE.fullmatch(size)
    if m is None:
        raise _bad(f'size must look like "WIDTHxHEIGHT" (e.g. "{limits.default_size}"), got {size!r}', "size")
    w, h = int(m.group(1)), int(m.group(2))
    mult, least = facts.size_multiple, facts.smallest_side
    if w % mult or h % mult or w < least or h < least:
        raise _bad(f"size {size}: width and height must be multiples of {mult} of at least {least} for this model",
                   "size")
    if w > limits.max_width or h > limits.max_height:
        raise _bad(f"size {size} exceeds this server's limit of {limits.max_width}x{limits.max_height}", "size")
    return w, h


def _adapter(req: _Extensions, model_id: str, adapters: Collection[str]) -> dict[str, Any]:
    """The request's LoRA adapter (`lora_id`, `lora_scale`): by `model: "MODEL:NAME"` or `lora: NAME`."""
    named, param = None, "model"
    if req.model is not None and req.model != model_id:
        if not req.model.startswith(model_id + ":"):
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves {model_id!r}", "model",
                           "model_not_found")
        named = req.model[len(model_id) + 1:]
    if req.lora is not None:
        if named is not None and named != req.lora:
            raise _bad(f"model {req.model!r} and lora {req.lora!r} name different adapters; give one", "lora")
        named, param = req.lora, "lora"
    if named is not None and named not in adapters:
        known = ", ".join(sorted(adapters)) or "none (dlo serve --lora-dir DIR loads them)"
        raise _bad(f"no LoRA adapter {named!r} on this server; its adapters: {known}", param)
    if req.lora_scale is not None:
        if named is None:
            raise _bad("lora_scale needs an adapter (lora, or model MODEL:NAME)", "lora_scale")
        if abs(req.lora_scale) > MAX_LORA_SCALE:
            raise _bad(f"lora_scale must be between -{MAX_LORA_SCALE:g} and {MAX_LORA_SCALE:g}, got {req.lora_scale!r}",
                       "lora_scale")
    return {"lora_id": named, "lora_scale": float(req.lora_scale if req.lora_scale is not None else 1.0)}


def _cache(req: _Extensions, facts: PipelineFacts, model_id: str, default: CacheSpec | None) -> CacheSpec | None:
    """The request's step cache: its `cache`, else the server's default; a model whose blocks or
    pipeline diffusers' cache hooks do not know takes none (a 400 where one is asked for)."""
    if req.cache is None:
        return default if facts.adapter.step_caches else None
    try:
        spec = cache_spec(req.cache)
    except CacheSpecError as e:
        raise _bad(str(e), e.param) from None
    if spec is not None and not facts.adapter.step_caches:
        raise _bad(f"model {model_id!r} ({facts.pipeline_class}) runs no step cache", "cache")
    return spec


def model_caches(facts: PipelineFacts, default: CacheSpec | None) -> dict[str, Any] | None:
    """The base model card's `caches`: the presets a request may ask for and the server's default
    (`dlo serve --cache`); None for a model that runs no step cache."""
    return listing(default) if facts.adapter.step_caches else None


def _common(req: _Extensions, facts: PipelineFacts, limits: Limits, model_id: str,
            adapters: Collection[str] = (), cache: CacheSpec | None = None) -> dict[str, Any]:
    lora = _adapter(req, model_id, adapters)
    for name in ("prompt", "negative_prompt"):
        text = getattr(req, name)
        if text is not None and len(text) > limits.max_prompt_chars:
            raise _bad(f"{name} has {len(text)} characters; the limit is {limits.max_prompt_chars}", name)
    if not req.prompt.strip():
        raise _bad("prompt must not be empty", "prompt")
    # omitted: the default clamped to the limits (`served_limits`), never a 400
    steps = req.num_inference_steps if req.num_inference_steps is not None else default_steps(facts, limits)
    if not facts.min_steps <= steps <= limits.max_steps:
        raise _bad(f"num_inference_steps must be between {facts.min_steps} and {limits.max_steps} for this model, "
                   f"got {steps}", "num_inference_steps")
    guidance = req.guidance_scale if req.guidance_scale is not None else facts.default_guidance
    if not 0 <= guidance <= limits.max_guidance_scale:
        raise _bad(f"guidance_scale must be between 0 and {limits.max_guidance_scale:g}, got {guidance:g}",
                   "guidance_scale")
    return {
        "prompt": req.prompt, "negative_prompt": req.negative_prompt, "steps": steps, "guidance_scale": float(guidance),
        "seed": req.seed if req.seed is not None else secrets.randbelow(2**31), **lora,
        "cache": _cache(req, facts, model_id, cache),
    }


def image_generation(req: ImageGenerationRequest, facts: PipelineFacts, limits: Limits, model_id: str,
                     adapters: Collection[str] = (), cache: CacheSpec | None = None) -> Generation:
    """`cache`: the server's default step cache (`dlo serve --cache`), for a request that names none."""
    if facts.image_input:
        raise _bad(f"model {model_id!r} ({facts.pipeline_class}) is image-to-video: use /v1/videos with "
                   "input_reference", "model")
    if not facts.images:
        raise _bad(f"model {model_id!r} ({facts.pipeline_class}) makes videos only (at least {facts.min_frames} "
                   "frames): use /v1/videos", "model")
    if req.response_format == "url":
        raise _bad('response_format "url" is not supported: this server keeps no image store; '
                   'use "b64_json"', "response_format")
    max_n = min(limits.max_n, facts.max_n or limits.max_n)  # Cosmos3: one sample per pipeline call
    if not 1 <= req.n <= max_n:
        raise _bad(f"n must be between 1 and {max_n}, got {req.n}", "n")
    common = _common(req, facts, limits, model_id, adapters, cache)
    w, h = parse_size(req.size, facts, limits) if req.size is not None else default_size(facts, limits)
    return Generation(kind="image", width=w, height=h, n=req.n, **common)


def form_field(name: str, value: Any) -> Any:
    """A multipart form value of POST /v1/videos: text as is, the `input_reference` upload as its bytes
    (the body limit already bounds it); any other file upload is refused."""
    if isinstance(value, str):
        return value
    if name == "input_reference":
        return value.file.read()
    raise ApiError(400, f"file upload {name!r} is not supported", name, "invalid_value")


def reference_image(value: Any, max_pixels: int) -> bytes:
    """The `input_reference` as encoded image bytes, checked: decodable by PIL, at most `max_pixels`
    pixels (read from the header before anything is decoded: the decode's cost is bounded by the
    cap, whatever the file's compression ratio; the pipeline resizes it to the video's size).
    CPU-bound: the server runs it off the event loop."""
    import base64
    import io

    from PIL import Image, UnidentifiedImageError

    if isinstance(value, str):
        text = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value
        try:
            value = base64.b64decode(text, validate=True)
        except ValueError:
            raise _bad("input_reference must be an image file upload or a base64 (data URL) image", "input_reference") from None
    if not isinstance(value, (bytes, bytearray)) or not value:
        raise _bad("input_reference must be an image file upload or a base64 (data URL) image", "input_reference")
    try:
        with Image.open(io.BytesIO(value)) as img:
            w, h = img.size
            if w * h > max_pixels:
                raise _bad(f"input_reference is {w}x{h} ({w * h} pixels); this server takes at most {max_pixels} "
                           "pixels (limits: max_reference_pixels)", "input_reference")
            img.convert("RGB").load()  # decodes the whole image now: a truncated file is the client's fault
    except ApiError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise _bad(f"input_reference is not a readable image: {e}", "input_reference") from None
    return bytes(value)


def video_generation(req: VideoCreateRequest, facts: PipelineFacts, limits: Limits, model_id: str,
                     adapters: Collection[str] = (), cache: CacheSpec | None = None) -> Generation:
    """`cache`: as `image_generation` takes it."""
    if not facts.supports_video:
        raise _bad(f"model {model_id!r} ({facts.pipeline_class}) makes images only; use /v1/images/generations",
                   "model")
    if req.input_reference is not None and not (facts.image_input or facts.accepts_image):
        raise _bad(f"input_reference (image-to-video) is not supported by model {model_id!r} ({facts.pipeline_class}, "
                   "text-to-video)", "input_reference")
    if req.input_reference is None and facts.image_input:
        raise _bad(f"model {model_id!r} ({facts.pipeline_class}) is image-to-video: input_reference (the first "
                   "frame) is required", "input_reference")
    common = _common(req, facts, limits, model_id, adapters, cache)
    w, h = parse_size(req.size, facts, limits) if req.size is not None else default_size(facts, limits, video=True)
    if req.input_reference is not None:
        common["image"] = reference_image(req.input_reference, limits.max_reference_pixels)
    fps = facts.fps or limits.video_fps  # a model with a rate of its own (MiniMax-H3, Cosmos3) runs at it
    if req.num_frames is not None:
        frames = req.num_frames
    elif req.seconds is not None:
        frames = facts.valid_frames(float(req.seconds), fps)
    else:  # neither: 4 s (at least the model's shortest clip), within max_frames (`served_limits`)
        frames = default_frames(facts, limits, fps)
    problem = facts.frames_error(frames)  # the family's rule (Wan 4k+1, MiniMax-H3 17k+5 in 5..15 s)
    if problem:
        raise _bad(problem, "num_frames" if req.num_frames is not None else "seconds")
    if frames > limits.max_frames:
        raise _bad(f"{frames} frames exceed this server's limit of {limits.max_frames} "
                   f"(at {fps} fps: at most {limits.max_frames / fps:g} s)", "num_frames" if req.num_frames else "seconds")
    return Generation(kind="video", width=w, height=h, frames=frames, fps=fps, **common)
