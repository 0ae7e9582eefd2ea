"""The ASGI guard in front of the service (plain ASGI, no framework): API key, body size, readable
validation errors, and a clear 503 while the model loads."""

from __future__ import annotations

import hmac
import json
from typing import Any, Callable, Collection, Sequence

from service.schemas import LIMIT_SETTINGS

HEALTH_PATHS = ("/livez", "/healthz", "/readyz")
RETRY_AFTER_SECONDS = 5  # what a client is told to wait while the model loads


def _format_loc(loc: Sequence[Any]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "body"


def validation_message(detail: Sequence[dict]) -> str:
    """pydantic error entries -> 'items[0].prompt: Field required; ...' (field first, as in RequestError)."""
    return "; ".join(f"{_format_loc(d.get('loc') or ())}: {d.get('msg', 'invalid')}" for d in detail)


class ApiGuard:
    """Plain ASGI middleware.

    - With an API key configured, every path but the health checks needs `Authorization: Bearer <key>` or
      `X-API-Key: <key>` (compared in constant time); 401 otherwise.
    - Request bodies over max_body_bytes: 413, before the application reads them.
    - A 400 in the framework's pydantic shape gets an "error" naming each failing field.
    - While `not_ready()` gives a reason (the model is loading, or its load failed and is retried), every
      path in `model_paths` answers 503 with `Retry-After` and the reason in JSON, and /readyz answers 503
      with the reason: a client sees why, not a refused connection or a hang.
    Nothing here logs headers or bodies.
    """

    def __init__(self, app, *, api_key: str | None = None, open_paths: Sequence[str] = HEALTH_PATHS,
                 max_body_bytes: int = 64 * 1024 * 1024, not_ready: Callable[[], str | None] | None = None,
                 model_paths: Collection[str] = ()):
        self.app = app
        self._key = api_key.encode() if api_key else None
        self.open_paths = frozenset(open_paths)
        self.max_body_bytes = max_body_bytes
        self.not_ready = not_ready
        self.model_paths = frozenset(model_paths)

    def _matches(self, given: bytes | None, expected: bytes | None) -> bool:
        return bool(given) and expected is not None and hmac.compare_digest(given, expected)

    def _authorised(self, headers: dict[bytes, bytes]) -> bool:
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        bearer = token.strip() if scheme.lower() == b"bearer" else None
        return self._matches(bearer, self._key) or self._matches(headers.get(b"x-api-key"), self._key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        if self._key is not None and path not in self.open_paths and not self._authorised(headers):
            return await _send_json(send, 401, {"error": "missing or invalid API key: send 'Authorization: Bearer "
                                                         "<key>' or 'X-API-Key: <key>'"},
                                    [(b"www-authenticate", b"Bearer")])
        reason = self.not_ready() if self.not_ready is not None and (path in self.model_paths or path == "/readyz") else None
        if reason is not None:
            if path == "/readyz":
                return await _send_json(send, 503, {"ready": False, "reason": reason})
            return await _send_json(send, 503, {"error": f"the model is not loaded yet: {reason}",
                                                "retry_after_seconds": RETRY_AFTER_SECONDS},
                                    [(b"retry-after", str(RETRY_AFTER_SECONDS).encode())])
        if scope.get("method") in ("POST", "PUT", "PATCH"):
            body = await self._read_body(receive, headers)
            if body is None:
                return await _send_json(send, 413, {"error": f"request body over the limit of {self.max_body_bytes} "
                                                             f"bytes (max_body_bytes, "
                                                             f"{LIMIT_SETTINGS['max_body_bytes']})"})
            receive = _replay(body, receive)
        await self.app(scope, receive, _readable_400(send))

    async def _read_body(self, receive, headers) -> bytes | None:
        try:
            if int(headers.get(b"content-length", b"0") or 0) > self.max_body_bytes:
                return None
        except ValueError:
            pass
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _send_json(send, status: int, payload: dict, extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra_headers]})
    await send({"type": "http.response.body", "body": body})


def _readable_400(send):
    """Rewrite the framework's pydantic 400 ({"error": "1 validation error for X", "detail": [...]}) so that
    "error" names the fields; every other response passes through untouched."""
    held: dict | None = None
    chunks: list[bytes] = []

    async def wrapped(message):
        nonlocal held
        if message["type"] == "http.response.start" and message.get("status") == 400:
            held = message
            return
        if held is None:
            return await send(message)
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(chunks)
        try:
            payload = json.loads(body)
            if isinstance(payload, dict) and isinstance(payload.get("detail"), list) and payload["detail"]:
                payload["error"] = validation_message(payload["detail"])
                body = json.dumps(payload).encode()
        except (ValueError, TypeError, AttributeError):
            pass
        headers = [(k, v) for k, v in held.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({**held, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return wrapped
