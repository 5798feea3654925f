"""JSON error responses shared by sleuth's HTTP servers: `{"detail": message, "field": name}`."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def error_response(
    status: int, message: str, field_name: str | None = None, headers: dict | None = None
) -> JSONResponse:
    body: dict[str, Any] = {"detail": message}
    if field_name is not None:
        body["field"] = field_name
    return JSONResponse(status_code=status, content=body, headers=headers)


def validation_error_response(exc: RequestValidationError, expected: str) -> JSONResponse:
    """422 naming every invalid field (the first one in `field`) and the expected request shape."""
    problems = []
    first_field = None
    for err in exc.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        where = ".".join(loc) or "body"
        first_field = first_field or where
        problems.append(f"{where}: {err.get('msg', 'invalid')}")
    return error_response(422, "invalid request: " + "; ".join(problems) + f" (expected {expected})", first_field)


class BodyLimitMiddleware:
    """Answer 413 to a request whose body passes `max_bytes`: refused from its Content-Length
    before anything is read, or, when it is streamed without one, as soon as the bytes received
    pass the limit (the app is then told the client left, and whatever it answers is dropped)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        if max_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> JSONResponse:
        return error_response(413, f"request body is larger than this server's limit of {self.max_bytes} bytes; "
                                   "send smaller requests (or start the server with a larger --max-body-bytes)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
        received = 0
        refused = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    refused = True
                    await self._too_large()(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        await self.app(scope, counting_receive, guarded_send)
