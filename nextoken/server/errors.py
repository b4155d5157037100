"""Errors as the server returns them: OpenAI error objects `{"error": {"message", "type", "param", "code"}}`.

Every error response goes through `error_response`, so none carries a traceback or a file path; messages are capped
in length. `ApiError` is what handlers raise; `api_error_from` maps nextoken's own errors to it by `http_status`.
"""

from __future__ import annotations

import json
import re

from starlette.responses import Response

from nextoken.errors import InvalidInput, InvalidSamplingParams, NextokenError

RETRY_AFTER_S = 1  # what a client told to back off (queue full, draining) should wait before trying again
MAX_MESSAGE_CHARS = 500

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
    408: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
    503: "service_unavailable",
}
_PARAM_IN_MESSAGE = re.compile(r"^invalid (\w+)=")  # SamplingParams' messages start "invalid <name>=<value>"


class ApiError(Exception):
    """An HTTP error to send as an OpenAI error object."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = dict(headers or {})
        if status in (429, 503):
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def response(self) -> Response:
        return error_response(self.status, self.message, param=self.param, code=self.code, headers=self.headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> bytes:
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + "..."
    error = {"message": message, "type": _TYPES.get(status, "invalid_request_error" if status < 500 else
                                                     "server_error"), "param": param, "code": code}
    return json.dumps({"error": error}, ensure_ascii=True).encode()


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, param=param, code=code), status_code=status,
                    media_type="application/json", headers=headers)


def api_error_from(exc: NextokenError, param: str | None = None) -> ApiError:
    """A NextokenError as an ApiError with its `http_status`; InvalidSamplingParams names its parameter, and so does
    an InvalidInput that carries one (else `param`)."""
    if isinstance(exc, InvalidSamplingParams):
        match = _PARAM_IN_MESSAGE.match(str(exc))
        param = match.group(1) if match else param
    elif isinstance(exc, InvalidInput) and exc.param is not None:
        param = exc.param
    status = exc.http_status
    if status >= 500 and status != 503:
        return ApiError(status, "internal error while generating; the request was not completed")
    return ApiError(status, str(exc), param=param)
