"""The request body limit, enforced before any parsing (413 naming ``max_body_bytes``)."""

from __future__ import annotations

import json
from collections import deque

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyLimit:
    """ASGI middleware: refuse bodies over ``max_bytes``, by header or by counting.

    The body is read here (at most ``max_bytes + 1`` of it) and handed on unchanged, so a
    client that sends no Content-Length, or a false one, meets the same limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {"detail": f"request body exceeds the limit max_body_bytes={self.max_bytes}"}
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await self._refuse(send)
                    return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg: Message = await receive()
            if msg["type"] != "http.request":
                break  # the client went away; let the app see it
            chunk: bytes = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send)
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        # Handed on chunk by chunk: joining them here would copy the whole body on the event
        # loop while every other request waits.
        pending = deque(chunks or [b""])

        async def replay() -> Message:
            if pending:
                chunk = pending.popleft()
                return {"type": "http.request", "body": chunk, "more_body": bool(pending)}
            return await receive()

        await self.app(scope, replay, send)
