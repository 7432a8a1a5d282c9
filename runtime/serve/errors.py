"""The API's errors, answered in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.code = code or {400: "invalid_request", 401: "invalid_api_key", 404: "not_found",
                             405: "method_not_allowed", 408: "request_timeout", 409: "conflict",
                             413: "request_too_large", 415: "unsupported_media_type", 416: "range_not_satisfiable",
                             429: "queue_full", 431: "request_header_fields_too_large", 500: "internal_error",
                             503: "unavailable", 507: "storage_full"}.get(status, "error")

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 429: "rate_limit_error"}.get(self.status, "invalid_request_error"
                                                                              if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
