"""HTTP API of a trained searcher: the searcher as a tool any LLM can call for evidence.

    POST /search  {"question": str, "max_turns": int?, "top_k": int?}
        -> {"context": [{id, title, text}], "context_text", "trajectory": {...}, "retrieval_count",
            "batch_size", "timings": {"queue_s", "search_s", "answer_s", "total_s"}, ...}
    POST /answer  same body -> the same plus "answer" (a frozen generator answers from the context)
    GET  /health  model, loop, retriever, limits, counters (never behind auth)

Errors are JSON `{"detail": message, "field"?: name}`: 422 invalid request, 400 /answer without a
generator, 401 missing/wrong bearer token, 503 retriever or model failure, 504 timeout.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from sleuth.http_errors import BodyLimitMiddleware, error_response, validation_error_response
from sleuth.serve.schemas import AnswerResponse, SearchRequest, SearchResponse
from sleuth.serve.service import (
    NoAnswerGenerator,
    RequestError,
    SearcherService,
    SearchTimeout,
    ServiceFailure,
)

OPEN_PATHS = frozenset({"/health"})


def bearer_token_ok(header: str | None, token: str) -> bool:
    """True when an Authorization header carries exactly `Bearer <token>` (compared in constant time)."""
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode("utf-8"), token.encode("utf-8"))


DEFAULT_MAX_BODY_BYTES = 1 << 20  # a question is at most a few thousand characters


def create_app(
    service: SearcherService,
    *,
    token: str | None = None,
    name: str = "sleuth-searcher",
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """A FastAPI app serving `service`; with `token`, every route but /health needs `Bearer <token>`,
    and /health shows the model, index and generator (which may be paths) only to a caller with it.
    A body over `max_body_bytes` gets 413 before it is read."""
    if token is not None and not token.strip():
        raise ValueError("token is empty; unset it to disable auth or set a non-empty secret")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        service.close()

    app = FastAPI(title=name, lifespan=lifespan)
    app.state.service = service
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)

    if token is not None:

        @app.middleware("http")
        async def _require_token(request: Request, call_next):
            if request.url.path not in OPEN_PATHS and not bearer_token_ok(
                request.headers.get("authorization"), token
            ):
                service.count("rejected")
                return error_response(
                    401,
                    "missing or wrong bearer token: send 'Authorization: Bearer <token>'",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def _invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        service.count("rejected")
        return validation_error_response(
            exc, '{"question": str, "max_turns": int (optional), "top_k": int (optional)}'
        )

    async def _run(req: SearchRequest, want_answer: bool) -> dict[str, Any] | JSONResponse:
        try:
            query = service.validate(req.question, req.max_turns, req.top_k, want_answer=want_answer)
        except RequestError as err:
            service.count("rejected")
            return error_response(422, err.message, err.field)
        try:
            return await service.search(query)
        except NoAnswerGenerator as err:
            service.count("rejected")
            return error_response(400, str(err))
        except ServiceFailure as err:
            return error_response(503, str(err))
        except SearchTimeout as err:
            return error_response(504, str(err))

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        described = service.describe()
        if token is not None and not bearer_token_ok(request.headers.get("authorization"), token):
            for private in ("model", "retriever", "generator"):  # may be paths on the server's disk
                described.pop(private, None)
        return {
            "status": "ok",
            "name": name,
            **described,
            "auth": token is not None,
            "stats": service.snapshot_stats(),
        }

    @app.post("/search", response_model=SearchResponse, response_model_exclude_none=False)
    async def search(req: SearchRequest) -> Any:
        return await _run(req, want_answer=False)

    @app.post("/answer", response_model=AnswerResponse)
    async def answer(req: SearchRequest) -> Any:
        return await _run(req, want_answer=True)

    return app
