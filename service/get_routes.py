"""GET endpoints beside BentoML's (its APIs are POST only): plain ASGI middleware that answers GET on the
paths it is given with the JSON their function returns, and passes everything else through."""

from __future__ import annotations

import json
from typing import Any, Callable, Mapping


class GetRoutes:
    def __init__(self, app, *, routes: Mapping[str, Callable[[], tuple[int, Any]]]):
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope, receive, send):
        handler = self.routes.get(scope.get("path", "")) if scope["type"] == "http" else None
        if handler is None or scope.get("method") not in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        status, payload = handler()
        body = json.dumps(payload).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})
