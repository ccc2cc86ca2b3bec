"""OpenAI's error envelope: what every layer of the server raises for a client to read."""


class ApiError(Exception):
    """An error the client gets in OpenAI's envelope."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers: tuple = ()
    ):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, list(headers)  # (name, value)s

    def body(self) -> dict:
        kind = {401: "authentication_error", 429: "rate_limit_error"}.get(self.status, "invalid_request_error")
        return {
            "error": {
                "message": str(self),
                "type": "server_error" if self.status >= 500 else kind,
                "param": self.param,
                "code": self.code,
            }
        }
