"""Why an engine failed: recorded once, from whichever thread finds it (the loop that crashed, a
failed overlapped pass, a lost tensor-parallel rank), and told at that moment to whoever must act
before the open requests end (a server leaving rotation: `Server._engine_failed`)."""

from __future__ import annotations

import logging
import threading
from typing import Callable

log = logging.getLogger("tandem.engine")


class Failure:
    def __init__(self, on_failure: Callable[[str], None] | None = None):
        self.reason: str | None = None  # None while the engine has not failed
        self.on_failure = on_failure  # called once, on the failing thread
        self._lock = threading.Lock()

    def record(self, reason: str) -> bool:
        """Keep the first failure and tell `on_failure`; False for any later one."""
        with self._lock:
            if self.reason is not None:
                return False
            self.reason = reason
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:  # the failure itself must still end every open request
                log.exception("on_failure raised")
        return True


def crash_reason(error: BaseException) -> str:
    """The engine loop died of `error`: the reason, with what the loop was handling (its notes)."""
    where = "".join(f" ({note})" for note in getattr(error, "__notes__", ()))
    return f"engine loop crashed: {type(error).__name__}: {error}{where}"
