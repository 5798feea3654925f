"""JSON error responses shared by sleuth's HTTP servers: `{"detail": message, "field": name}`."""

from __future__ import annotations

import asyncio
import time
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
    return error_response(
        422, "invalid request: " + "; ".join(problems) + f" (expected {expected})", first_field
    )


class BodyBudget:
    """The request-body bytes a server holds at once, across its concurrent requests.

    A request reserves its Content-Length (or, streamed without one, the per-request limit) before
    its body is read and keeps the reservation until its response is sent: the body, its parsed
    JSON and the lists built from it live that long. A reservation that does not fit waits at most
    `wait_s` for earlier requests to finish, then is refused (the caller answers 503), so nothing
    queues without bound. `held_bytes`/`peak_held_bytes` count reservations, `received_bytes`/
    `peak_received_bytes` the body bytes actually read by requests still in progress."""

    def __init__(self, total_bytes: int, wait_s: float = 1.0):
        if total_bytes < 1:
            raise ValueError(f"body_budget_bytes must be >= 1, got {total_bytes}")
        if not wait_s >= 0:
            raise ValueError(f"body budget wait_s must be >= 0, got {wait_s}")
        self.total_bytes = total_bytes
        self.wait_s = wait_s
        self.held_bytes = 0
        self.peak_held_bytes = 0
        self.received_bytes = 0
        self.peak_received_bytes = 0
        self.in_progress = 0
        self.refused = 0
        self._waiters: list[asyncio.Future] = []

    async def acquire(self, nbytes: int) -> bool:
        """Reserve `nbytes`, waiting at most `wait_s`; False (and counted as refused) if they never fit."""
        deadline = time.monotonic() + self.wait_s
        while self.held_bytes + nbytes > self.total_bytes:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.refused += 1
                return False
            woken = asyncio.get_running_loop().create_future()
            self._waiters.append(woken)
            try:
                await asyncio.wait({woken}, timeout=remaining)
            finally:
                if woken in self._waiters:
                    self._waiters.remove(woken)
        self.held_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        self.in_progress += 1
        return True

    def note_received(self, nbytes: int) -> None:
        self.received_bytes += nbytes
        self.peak_received_bytes = max(self.peak_received_bytes, self.received_bytes)

    def release(self, reserved: int, received: int) -> None:
        """End a request that reserved `reserved` bytes and read `received`; wake every waiter to retry."""
        self.held_bytes -= reserved
        self.received_bytes -= received
        self.in_progress -= 1
        waiters, self._waiters = self._waiters, []
        for woken in waiters:
            if not woken.done():
                woken.set_result(None)

    def stats(self) -> dict[str, int]:
        return {
            "body_budget_bytes": self.total_bytes,
            "body_bytes_held": self.held_bytes,
            "body_bytes_held_peak": self.peak_held_bytes,
            "body_budget_refused": self.refused,
        }


def _declared_body_bytes(scope: Scope) -> int | None:
    """The Content-Length of a request, 0 for one without a body, None when it streams (chunked)."""
    chunked = False
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
        if name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    return None if chunked else 0


class BodyLimitMiddleware:
    """Answer 413 to a request whose body passes `max_bytes`: refused from its Content-Length
    before anything is read, or, when it is streamed without one, as soon as the bytes received
    pass the limit (the app is then told the client left, and whatever it answers is dropped).

    With a `budget`, a request with a body first reserves its size there (see `BodyBudget`); one
    that cannot within the budget's wait gets 503 with Retry-After, its body unread."""

    def __init__(self, app: ASGIApp, max_bytes: int, budget: BodyBudget | None = None):
        if max_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_bytes}")
        if budget is not None and budget.total_bytes < max_bytes:
            raise ValueError(
                f"body_budget_bytes ({budget.total_bytes}) is smaller than max_body_bytes "
                f"({max_bytes}): a request at the limit could never be served; raise the budget"
            )
        self.app = app
        self.max_bytes = max_bytes
        self.budget = budget

    def _too_large(self) -> JSONResponse:
        return error_response(
            413,
            f"request body is larger than this server's limit of {self.max_bytes} bytes; "
            "send smaller requests (or start the server with a larger --max-body-bytes)",
        )

    def _over_budget(self) -> JSONResponse:
        assert self.budget is not None
        return error_response(
            503,
            f"this server already holds its budget of {self.budget.total_bytes} bytes of request bodies "
            f"({self.budget.in_progress} requests in progress); retry shortly (or start it with a larger "
            "--body-budget-bytes)",
            headers={"Retry-After": "1"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _declared_body_bytes(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large()(scope, receive, send)
            return
        # a streamed body is counted against the limit as it arrives, so it can need the whole limit
        reserved = self.max_bytes if declared is None else declared
        if self.budget is not None and reserved and not await self.budget.acquire(reserved):
            await self._over_budget()(scope, receive, send)
            return
        received = 0
        refused = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                chunk = len(message.get("body", b""))
                received += chunk
                if self.budget is not None and reserved:
                    self.budget.note_received(chunk)
                if received > self.max_bytes:
                    refused = True
                    await self._too_large()(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not refused:
                await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        finally:
            if self.budget is not None and reserved:
                self.budget.release(reserved, received)
