"""The server's errors: an `APIError` is answered with the API's error body (status, message, the
request field it is about)."""

from __future__ import annotations


class APIError(Exception):
    """An error answered with the API's error body: HTTP status, message, the request field it
    is about, a code and a kind (OpenAI's names; the Anthropic layer maps them)."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None, counted: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)
        self.headers = headers
        self.counted = counted  # the request's outcome is in the metrics already


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)
