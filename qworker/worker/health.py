"""A tiny non-blocking HTTP server for probes: /healthz (alive), /readyz (taking jobs), /metrics."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

Handler = Callable[[], tuple[int, str, str]]  # -> (status, content type, body)
_REASONS = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}


class HealthServer:
    def __init__(self, host: str, port: int, routes: dict[str, Handler]):
        self.host, self.port, self.routes = host, port, routes
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5.0)
            while (await asyncio.wait_for(reader.readline(), 5.0)) not in (b"\r\n", b"\n", b""):
                pass  # headers are not needed
            parts = line.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else "/"
            handler = self.routes.get(path)
            status, ctype, body = handler() if handler else (404, "text/plain", "not found\n")
            data = body.encode()
            writer.write(
                f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data
            )
            await writer.drain()
        except Exception:  # noqa: BLE001 - a broken probe connection must not hurt the worker
            log.debug("health request failed", exc_info=True)
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
