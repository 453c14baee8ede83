"""Open file descriptors of this process against its limit (``ulimit -n``), for sub-server
processes: each Router with processes holds a few descriptors per model (its spec channel, its
process sentinel, a connection of the message hub, the shared-memory segments of its weights)
and a few for the hub itself.

`ensure_room` runs before a `ProcessTransport` starts: when the descriptors it will open do not
fit under the soft limit, the soft limit is raised within the hard one (logged), and where even
the hard limit is too low it fails with an error naming ``ulimit -n`` and the numbers.
`too_many_files` turns an EMFILE error met anyway into the same kind of message.
"""

from __future__ import annotations

import errno
import logging
import os

log = logging.getLogger(__name__)

HEADROOM = 64  # descriptors left free beyond an estimate (files a notebook opens meanwhile)


def open_fds() -> int | None:
    """Descriptors open in this process now (None where the platform cannot say)."""
    for d in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(d)) - 1  # less the one listdir opened
        except OSError:
            continue
    return None


def limits() -> tuple[int, int] | None:
    """(soft, hard) limit of open files of this process, or None without `resource` (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def ensure_room(needed: int, what: str) -> None:
    """Make sure ``needed`` more descriptors (plus `HEADROOM`) fit under the soft limit: raise
    the soft limit within the hard one if they do not (logged at WARNING, with the numbers).

    Args:
        needed: descriptors about to be opened.
        what: what opens them, for the messages (e.g. "the sub-server processes of 2 models").

    Raises:
        OSError (EMFILE): even the hard limit is too low; the message names ``ulimit -n``, the
            descriptors open, the soft and hard limits and how many are needed.
    """
    lim, now = limits(), open_fds()
    if lim is None or now is None:
        return
    import resource

    soft, hard = lim
    want = now + needed + HEADROOM
    if soft == resource.RLIM_INFINITY or want <= soft:
        return
    if hard != resource.RLIM_INFINITY and want > hard:
        raise OSError(
            errno.EMFILE,
            f"{what} need about {needed} more open files, but this process has {now} open "
            f"of its limit of {soft} (hard limit {hard}): raise it before starting Python "
            f"(`ulimit -n {max(4096, want)}` in the shell), close Routers you no longer "
            f"use (router.close()), or run sub-servers in threads "
            f"(Router(..., processes=False))",
        )
    new = want if hard == resource.RLIM_INFINITY else min(hard, max(want, min(hard, 4 * soft)))
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    log.warning(
        "raised the soft limit of open files (ulimit -n) of this process from %d to %d (hard limit %s): "
        "%d are open and %s need about %d more",
        soft,
        new,
        "unlimited" if hard == resource.RLIM_INFINITY else hard,
        now,
        what,
        needed,
    )


def too_many_files(e: BaseException, what: str) -> BaseException:
    """``e`` unchanged, or for an EMFILE error (too many open files) an OSError naming
    ``ulimit -n`` and the numbers (chained to ``e``)."""
    if not (isinstance(e, OSError) and e.errno == errno.EMFILE) and "Too many open files" not in str(e):
        return e
    lim, now = limits(), open_fds()
    nums = f"{now} open of a limit of {lim[0]} (hard limit {lim[1]})" if lim and now is not None else "at its limit"
    err = OSError(
        errno.EMFILE,
        f"{what}: too many open files ({nums}): raise the limit before starting Python "
        f"(`ulimit -n 4096` in the shell), close Routers you no longer use (router.close()), "
        f"or run sub-servers in threads (Router(..., processes=False)); the error was: {e}",
    )
    err.__cause__ = e
    return err
