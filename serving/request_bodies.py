"""The bodies of requests FastAPI does not parse itself: `POST /v1/videos` in JSON or form data.

Owns: `video_body` (the body read, parsed and validated: any malformed input is an `ApiError` 400),
`closed_multipart` (a multipart body that ends with its closing delimiter), `nested_form` (form
fields the official SDK writes for a nested value, `cache[threshold]`, folded back into objects),
`validation_message` (pydantic's first error as OpenAI's message and `param`) and `body_error`
(a body FastAPI parsed for a route, such as `POST /v1/images/generations`, that is no JSON
object: said as `video_body` says it, `param` null).
Must never: answer malformed input with anything but an `ApiError` 400, or hold a body beyond the
limit `body_limit.BodyLimit` already enforced.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from dlo.serving.api_models import ApiError, VideoCreateRequest, form_field


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """pydantic's first error as OpenAI's message and `param` (the field's dotted path)."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", ()) if x not in ("body",)]
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid request')}", param


_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false",
               type(None): "null"}


def body_error(errors: list[dict[str, Any]], ctype: str) -> ApiError | None:
    """The 400 of a body that is not one JSON object (FastAPI's `RequestValidationError` of the
    whole body), or None when the body parsed and a field is wrong (`validation_message`)."""
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":  # loc: ("body", the character where the parse stopped)
        error = (first.get("ctx") or {}).get("error") or first.get("msg")
        where = f" (char {loc[1]})" if len(loc) > 1 else ""
        return ApiError(400, f"could not parse the request body as JSON: {error}{where}", None, "invalid_json")
    if loc != ("body",):
        return None
    if first.get("type") == "missing":
        return ApiError(400, "the request body is empty; it must be a JSON object such as {\"prompt\": \"...\"}",
                        None, "invalid_json")
    value = first.get("input")
    if isinstance(value, (bytes, bytearray)):  # not parsed: not sent as JSON
        return ApiError(400, "the request body must be a JSON object sent with Content-Type: application/json "
                             f"(got Content-Type: {ctype or 'none'})", None, "invalid_json")
    kind = _JSON_KINDS.get(type(value), type(value).__name__)
    return ApiError(400, f"the request body must be a JSON object, got {kind}", None, "invalid_json")


def closed_multipart(body: bytes, ctype: str) -> bool:
    """Whether a multipart body ends with its closing delimiter (`--BOUNDARY--`): without it the
    last part may be cut, and parsers keep what they got without saying so."""
    from python_multipart.multipart import parse_options_header

    _, params = parse_options_header(ctype)
    boundary = params.get(b"boundary")
    return bool(boundary) and b"--" + boundary + b"--" in body[-(len(boundary) + 256):]


def nested_form(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """Form fields as the official SDK writes a nested `extra_body` value (`cache[preset]`,
    `cache[threshold]`, `cache[mag_ratios][]` once per item): folded back into objects and lists,
    each nested text read as JSON where it is a number, true, false or null (form data has only
    text); plain fields as they came. A field both plain and nested is a 400 naming it."""
    data: dict[str, Any] = {}
    for key, value in items:
        name, _, rest = key.partition("[")
        if not rest or not isinstance(value, str):
            if isinstance(data.get(key), (dict, list)):  # a plain field after its nested ones
                raise ApiError(400, f"form field {key!r} conflicts with another field of {key!r}", key,
                               "invalid_value")
            data[key] = value
            continue
        parts = rest[:-1].split("][") if rest.endswith("]") else [rest]
        listed = parts[-1] == ""
        parts = parts[:-1] if listed else parts
        try:
            if not parts:  # `name[]`: a list at the top
                data.setdefault(name, []).append(_scalar(value))
                continue
            node = data.setdefault(name, {})
            for part in parts[:-1]:
                node = node.setdefault(part, {})
            if listed:
                node.setdefault(parts[-1], []).append(_scalar(value))
            else:
                node[parts[-1]] = _scalar(value)
        except (AttributeError, TypeError):  # a field both a value and an object or a list
            raise ApiError(400, f"form field {key!r} conflicts with another field of {name!r}", name,
                           "invalid_value") from None
    return data


def _scalar(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, (int, float, bool)) or value is None else text


async def video_body(request: Request) -> VideoCreateRequest:
    """`POST /v1/videos`'s body, JSON or form data (as the official SDK sends it), validated; a
    malformed one is an `ApiError` 400."""
    ctype = request.headers.get("content-type", "")
    try:
        if ctype.startswith("multipart/form-data") or ctype.startswith("application/x-www-form-urlencoded"):
            if ctype.startswith("multipart/") and not closed_multipart(await request.body(), ctype):
                raise ApiError(400, "the multipart body has no closing boundary (--BOUNDARY--): it is incomplete",
                               None, "invalid_json")
            form = await request.form()
            data: Any = nested_form([(k, form_field(k, v)) for k, v in form.multi_items()])
        else:
            data = await request.json()
    except ApiError:
        raise
    except ValueError as e:  # malformed JSON (the client's fault), or a value Python refuses (5,000 digits)
        code = "invalid_json" if isinstance(e, json.JSONDecodeError) else "invalid_value"
        raise ApiError(400, f"could not parse the request body: {e}", None, code) from None
    except Exception as e:  # a malformed form: the client's fault
        raise ApiError(400, f"could not parse the request body as JSON or form data: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    try:
        return VideoCreateRequest.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(list(e.errors()))
        raise ApiError(400, message, param, "invalid_request") from None
