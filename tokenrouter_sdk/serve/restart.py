"""`AutoRestart`: a server restarts a sub-server that died, up to a limit, and says so in its log.

The engine fails the requests the dead sub-server held (the clients get 500 with the reason) and
refuses new ones (503) until the model is restarted; `AutoRestart` sees the death (an engine
observer gets the `ModelDied`), restarts the model from another thread (`Router.restart`), and
logs one line when it starts, one when it serves again (or why it could not). After ``limit``
restarts of one model it restarts that model no more: ``/health`` stays 503 and the log says so.
"""

from __future__ import annotations

import logging
import threading
import time

from ..engine import messages

log = logging.getLogger("tokenrouter.serve")


class AutoRestart:
    """Restart each dead sub-server of ``router``, at most ``limit`` times per model.

    Args:
        router: the `Router` served.
        limit: restarts per model over the server's life (0: none; the death is logged only).
        timeout: seconds a restarted sub-server may take to connect (None: the transport's).

    Attributes:
        restarts: model -> restarts done (successful or not).
        history: one dict per death seen: ``model``, ``error``, ``action`` (``"restarted"``,
            ``"failed"``, ``"limit"``), ``seconds`` and ``detail``.
    """

    def __init__(self, router, limit: int, timeout: float | None = None):
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 0:
            raise ValueError(f"the restart limit must be an int >= 0 (restarts per model), got {limit!r}")
        self.router, self.limit, self.timeout = router, limit, timeout
        self.restarts: dict[str, int] = {}
        self.history: list[dict] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False
        self._remove = router.add_observer(self._observe)

    def _observe(self, ev) -> None:
        """Engine thread, under its lock: only hand the restart to a thread of its own."""
        if not isinstance(ev, messages.ModelDied) or self._closed:
            return
        t = threading.Thread(
            target=self._restart, args=(ev.model, ev.error), daemon=True, name=f"tokenrouter-restart-{ev.model}"
        )
        with self._lock:
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()

    def _restart(self, model: str, error: str) -> None:
        with self._lock:
            done = self.restarts.get(model, 0)
            if done >= self.limit:
                self.history.append(
                    {
                        "model": model,
                        "error": error,
                        "action": "limit",
                        "seconds": 0.0,
                        "detail": f"{done} restart(s) done, limit {self.limit}",
                    }
                )
                log.error(
                    "sub-server '%s' died (%s); not restarting it: %d restart(s) done, the limit is %d "
                    "(--restart-limit); /health answers 503 until the server is restarted",
                    model,
                    error,
                    done,
                    self.limit,
                )
                return
            self.restarts[model] = done + 1
        log.warning("sub-server '%s' died (%s); restarting it (%d of %d)", model, error, done + 1, self.limit)
        t0 = time.perf_counter()
        try:
            self.router.restart(model, timeout=self.timeout)
        except Exception as e:  # noqa: BLE001 - logged; the model stays dead and /health says so
            secs = time.perf_counter() - t0
            self.history.append(
                {
                    "model": model,
                    "error": error,
                    "action": "failed",
                    "seconds": secs,
                    "detail": f"{type(e).__name__}: {e}",
                }
            )
            log.error("sub-server '%s' could not be restarted after %.1f s: %s: %s", model, secs, type(e).__name__, e)
            return
        secs = time.perf_counter() - t0
        self.history.append({"model": model, "error": error, "action": "restarted", "seconds": secs, "detail": ""})
        log.warning("sub-server '%s' restarted in %.1f s; serving again", model, secs)

    def close(self, timeout: float = 30.0) -> None:
        """Stop watching and wait for a restart under way. Idempotent."""
        self._closed = True
        self._remove()
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout)
