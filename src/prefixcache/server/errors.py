"""Errors in the route's own shape: OpenAI routes answer OpenAI error JSON, Anthropic routes
(``/v1/messages*``) answer Anthropic error JSON.

    OpenAI:    {"error": {"message": str, "type": str, "param": str | null, "code": str | null}}
    Anthropic: {"type": "error", "error": {"type": str, "message": str}}

Every handler here turns a failure into a 4xx with a message that says what to fix; the
catch-all turns an unexpected exception into a logged 500 of the same shape (a last resort: the
fuzz tests check it never fires).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixcache.limits import RejectedBody

log = logging.getLogger(__name__)

#: HTTP status -> Anthropic error type (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}

#: HTTP status -> OpenAI error type.
OPENAI_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """A failure the client can act on. ``status`` is the HTTP status; the route decides the shape.

    ``anthropic_status`` overrides the status for Anthropic routes (a full queue is 429 for
    OpenAI clients and 529 ``overloaded_error`` for Anthropic ones).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        anthropic_status: int | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.anthropic_status = anthropic_status or status
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def anthropic_error_body(err: APIError) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(err.anthropic_status, "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def openai_error_body(err: APIError) -> dict[str, Any]:
    kind = OPENAI_TYPES.get(err.status, "invalid_request_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def error_response(request: Request, err: APIError) -> JSONResponse:
    """The JSON response for ``err`` in the shape of the route ``request`` hit."""
    if is_anthropic_path(request.url.path):
        return JSONResponse(anthropic_error_body(err), status_code=err.anthropic_status, headers=err.headers)
    return JSONResponse(openai_error_body(err), status_code=err.status, headers=err.headers)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "json-or-python"}
#: Errors that only say "not this branch of a union"; the others say what to fix.
_TYPE_ERRORS = {
    "string_type",
    "list_type",
    "dict_type",
    "int_type",
    "float_type",
    "bool_type",
    "model_type",
    "model_attributes_type",
    "none_required",
    "union_tag_invalid",
    "int_from_float",
}


def _is_union_tag(part: str) -> bool:
    """Pydantic puts the union branch into ``loc`` (``str``, ``list[TextBlock]``, ``TextBlock``)."""
    return part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper()


def _loc_str(loc: tuple[Any, ...] | list[Any]) -> str:
    parts = [str(p) for p in loc if p != "body" and not (isinstance(p, str) and _is_union_tag(p))]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable sentence from pydantic's errors, and the offending parameter."""
    errors = exc.errors()
    if not errors:
        return "The request body is invalid.", None
    # The most telling error: a bad value beats an unknown tag of a tagged union (a content
    # block's "type"), which beats "wrong type for this union branch".
    first = next(
        (e for e in errors if e.get("type") not in _TYPE_ERRORS),
        next((e for e in errors if e.get("type") == "union_tag_invalid"), errors[0]),
    )
    kind = first.get("type", "")
    if kind == "json_invalid":
        return (
            "The request body is not valid JSON: send a JSON object with Content-Type: application/json."
        ), None
    loc = _loc_str(first.get("loc", ()))
    msg = str(first.get("msg", "is invalid"))
    if kind == "missing":
        text = (
            f"Missing required parameter '{loc}'."
            if loc
            else "The request body is missing: send a JSON object."
        )
    elif loc:
        text = f"Invalid value for '{loc}': {msg}."
    else:
        text = f"Invalid request body: {msg}. Send a JSON object."
    if kind == "model_attributes_type" and not loc:
        text = "The request body must be a JSON object (send Content-Type: application/json)."
    return text, loc or None


def template_refusal(exc: BaseException) -> APIError | None:
    """A chat template's own refusal (jinja's ``raise_exception``: roles that do not alternate, a
    system message out of place, ...) as a 400 naming ``messages``; None for any other error."""
    try:
        from jinja2.exceptions import TemplateError
    except ImportError:  # (no jinja: no templates to refuse anything)
        return None
    if not isinstance(exc, TemplateError):
        return None
    return APIError(
        400,
        f"The model's chat template refused these messages: {str(exc)[:300]}. Change 'messages' "
        "(their roles and order) to what the template accepts.",
        param="messages",
        code="invalid_messages",
    )


def install_error_handlers(app: FastAPI) -> None:
    """Route every failure through :func:`error_response`."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(request, APIError(400, message, param=param, code="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if isinstance(exc, RejectedBody):
            return error_response(
                request, APIError(exc.status_code, str(exc.detail), param=exc.param, code=exc.code)
            )
        if exc.status_code == 404:
            message = f"No route {request.method} {request.url.path}: see GET /openapi.json for the routes."
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        else:
            message = str(exc.detail)
        headers = dict(exc.headers) if exc.headers else None
        return error_response(request, APIError(exc.status_code, message, headers=headers))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        refused = template_refusal(exc)
        if refused is not None:
            return error_response(request, refused)
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        message = f"Internal server error ({type(exc).__name__}); see the server log."
        return error_response(request, APIError(500, message))
