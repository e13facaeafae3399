"""The request body limits, enforced before any parsing: one body at most ``max_body_bytes``
(413), and all bodies held at once at most ``max_held_body_bytes`` (503 with ``Retry-After``),
so that many large uploads arriving together cannot exhaust the server's memory."""

from __future__ import annotations

import json
import time
from collections import deque

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DRAIN_MAX_BYTES = 1 << 30
"""How much of a refused body is read and dropped, at most, before the connection is closed."""
DRAIN_MAX_S = 30.0
"""How long a refused body is read and dropped, at most."""


async def drain(receive: Receive) -> None:
    """Read and drop the rest of a refused request's body, before the refusal is sent. The
    server closes the connection as soon as a ``connection: close`` answer is sent; with bytes
    of the body still unread the kernel resets it, and a client still sending (four 155 MiB
    bodies at once) saw the reset instead of its 413. Read to the end first, the answer
    arrives. Bounded (:data:`DRAIN_MAX_BYTES`, :data:`DRAIN_MAX_S`): past that an endless body
    still ends in a reset."""
    read, start = 0, time.monotonic()
    while read < DRAIN_MAX_BYTES and time.monotonic() - start < DRAIN_MAX_S:
        msg: Message = await receive()
        if msg["type"] != "http.request" or not msg.get("more_body", False):
            return
        read += len(msg.get("body", b""))


class BodyLimit:
    """ASGI middleware: refuse bodies over ``max_bytes``, by header or by counting.

    The body is read here (at most ``max_bytes + 1`` of it) and handed on unchanged, so a
    client that sends no Content-Length, or a false one, meets the same limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, max_held_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_held_bytes = max_held_bytes
        self.held_bytes = 0  # body bytes of every request between its first chunk and its answer

    async def _refuse(self, send: Send) -> None:
        detail = f"request body exceeds the limit max_body_bytes={self.max_bytes}"
        await self._answer(send, 413, detail, [(b"connection", b"close")])

    async def _busy(self, send: Send) -> None:
        detail = (
            f"the server holds max_held_body_bytes={self.max_held_bytes} of request bodies "
            "already; retry"
        )
        await self._answer(send, 503, detail, [(b"connection", b"close"), (b"retry-after", b"1")])

    async def _answer(
        self, send: Send, status: int, detail: str, headers: list[tuple[bytes, bytes]]
    ) -> None:
        body = json.dumps({"detail": detail}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    *headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _over_held(self, more: int) -> bool:
        return self.max_held_bytes is not None and self.held_bytes + more > self.max_held_bytes

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
                    await drain(receive)
                    await self._refuse(send)
                    return
        chunks: list[bytes] = []
        size = 0
        try:
            while True:
                msg: Message = await receive()
                if msg["type"] != "http.request":
                    break  # the client went away; let the app see it
                chunk: bytes = msg.get("body", b"")
                size += len(chunk)
                if size > self.max_bytes or self._over_held(len(chunk)):
                    if msg.get("more_body", False):
                        await drain(receive)
                    await (self._refuse(send) if size > self.max_bytes else self._busy(send))
                    return
                self.held_bytes += len(chunk)
                chunks.append(chunk)
                if not msg.get("more_body", False):
                    break
            # Handed on chunk by chunk: joining them here would copy the whole body on the
            # event loop while every other request waits.
            pending = deque(chunks or [b""])

            async def replay() -> Message:
                if pending:
                    chunk = pending.popleft()
                    return {"type": "http.request", "body": chunk, "more_body": bool(pending)}
                return await receive()

            await self.app(scope, replay, send)
        finally:
            # The route holds the chunks until it answers (a parser process reads them); only
            # then are they counted out.
            self.held_bytes -= sum(map(len, chunks))
