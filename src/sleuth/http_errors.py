"""JSON error responses shared by sleuth's HTTP servers: `{"detail": message, "field": name}`."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse


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
