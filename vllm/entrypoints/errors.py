"""`OpenAIError`: a request that cannot be served as given, with the HTTP status the server
answers it with. Raised below the server too (chat rendering, shared with `LLM.chat`, which
raises it again as ValueError), so it imports nothing of the server."""

from __future__ import annotations


class OpenAIError(Exception):
    """An error answered with the OpenAI error body and an HTTP status (400 unless said)."""

    def __init__(self, message: str, err_type: str = "BadRequestError",
                 status_code: int = 400, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.err_type = err_type
        self.status_code = status_code
        self.headers = headers  # e.g. Retry-After on a 503
