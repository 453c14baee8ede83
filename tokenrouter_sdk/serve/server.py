"""Running the app: `BackgroundServer` (uvicorn in a thread with its own event loop, for a
notebook: the caller's loop, if any, is never used) and `serve_forever` (the command line's
foreground server). Port 0 binds a free port first, so the URL is known before serving."""

from __future__ import annotations

import asyncio
import socket
import threading

from .app import close_app

STOP_GRACE_S = 5.0  # seconds open connections get to finish when the server stops
KEEP_ALIVE_S = 75.0  # idle keep-alive connections are kept this long (clients that back off and retry reuse them)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: a free one).

    Raises:
        OSError: the address is in use or not available (names it).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(
            e.errno, f"cannot listen on {host}:{port}: {e.strerror}; pick another --port (0 = any free one)"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _config(app, log_level: str):
    import uvicorn

    return uvicorn.Config(
        app,
        log_level=log_level,
        lifespan="off",
        timeout_graceful_shutdown=STOP_GRACE_S,
        timeout_keep_alive=KEEP_ALIVE_S,
        access_log=False,
    )


class BackgroundServer:
    """uvicorn serving ``app`` in a daemon thread named ``tokenrouter-serve`` with its own event
    loop; `start` returns once it accepts connections.

    Args:
        app: from `tokenrouter_sdk.serve.app.create_app`.
        host: address to listen on (default loopback only).
        port: TCP port (0: a free one).
        log_level: uvicorn's log level.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.app = app
        self.sock = bind(host, port)
        self.url = url_of(self.sock)
        self.server = uvicorn.Server(_config(app, log_level))
        self.loop: asyncio.AbstractEventLoop | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tokenrouter-serve", daemon=True)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self.loop = loop
        try:
            loop.run_until_complete(self.server.serve(sockets=[self.sock]))
        except BaseException as e:  # noqa: BLE001 - reported by start() / stop()
            self.error = e
        finally:
            try:
                loop.run_until_complete(loop.shutdown_asyncgens())
            finally:
                loop.close()

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        """Start serving; returns when uvicorn is up.

        Raises:
            RuntimeError: uvicorn did not start within ``timeout`` seconds, or failed (its error).
        """
        self._thread.start()
        deadline = timeout
        while not self.server.started and self._thread.is_alive() and deadline > 0:
            self._thread.join(0.01)
            deadline -= 0.01
        if not self.server.started:
            self.stop()
            raise RuntimeError(f"the HTTP server did not start: {self.error!r}")
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = STOP_GRACE_S + 5.0) -> None:
        """Abort the requests it serves, stop uvicorn and join its thread. Idempotent."""
        loop = self.loop
        if loop is not None and self._thread.is_alive():
            try:
                loop.call_soon_threadsafe(close_app, self.app)
            except RuntimeError:  # the loop already closed
                close_app(self.app)
        else:
            close_app(self.app)
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        try:
            self.sock.close()
        except OSError:
            pass


def serve_forever(app, sock: socket.socket, log_level: str = "info") -> None:
    """Serve ``app`` on ``sock`` in this thread until SIGINT/SIGTERM (uvicorn's handlers)."""
    import uvicorn

    server = uvicorn.Server(_config(app, log_level))
    try:
        server.run(sockets=[sock])
    finally:
        close_app(app)
        sock.close()
