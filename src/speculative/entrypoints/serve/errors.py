"""The server's errors: OpenAI's error body, with an HTTP status."""

from __future__ import annotations

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               500: "server_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def __reduce__(self):  # pickled whole: Ray replicas send errors to the ingress (serve/ray_app.py)
        return APIError, (self.status, self.message, self.param, self.code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)
