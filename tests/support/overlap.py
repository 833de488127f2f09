"""Holding an overlapped engine between a step's launch and its result, on purpose.

`StepGate` makes every forward pass wait on the runner thread until the test lets it through, one
at a time. While a pass waits, the engine thread is in `OverlappedSteps.poll_while_running`: it
applies the inbox (aborts, `call`s) and polls the KV connector, with the held step launched and,
usually, the next one planned behind it. That is the window in which a request's counts run ahead
of its known tokens (`Request.num_cacheable`), reached here without luck.
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class StepGate:
    """Wraps `engine.runner` so that each pass waits for `allow()` (or `open()`). Install it
    before the engine has anything to run."""

    def __init__(self, engine):
        assert engine.overlap, "the gate holds the overlapped loop's runner thread"
        self.engine = engine
        self._prepare, self._run = engine.runner.prepare, engine.runner.run
        self._plans: dict[int, object] = {}  # id(prepared step) -> its StepPlan
        self._cond = threading.Condition()
        self._passes = 0  # passes allowed and not yet started
        self._open = False
        self.held = None  # the StepPlan whose pass waits at the gate now
        engine.runner.prepare = self._prepare_recorded
        engine.runner.run = self._run_gated

    def _prepare_recorded(self, plan):
        step = self._prepare(plan)
        self._plans[id(step)] = plan
        return step

    def _run_gated(self, step):
        plan = self._plans.pop(id(step))
        with self._cond:
            self.held = plan
            self._cond.notify_all()
            # A loop that stops (shut down, crashed) waits for its step in flight: let it end.
            while not (self._open or self._passes > 0 or self.engine.steps.stopping or self.engine.inbox.closed):
                self._cond.wait(0.05)
            self._passes -= self._passes > 0 and not self._open
            self.held = None
        return self._run(step)

    def allow(self, n: int = 1) -> None:
        with self._cond:
            self._passes += n
            self._cond.notify_all()

    def open(self) -> None:
        """Let every pass through from now on."""
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def parked(self) -> bool:
        """On the engine thread: the oldest step not yet updated is the one held at the gate, so
        the engine thread is inside poll_while_running for it (and stays there until `allow`)."""
        launched, in_flight = self.engine.scheduler.launched, self.engine.steps.in_flight
        with self._cond:
            held = self.held if self._passes == 0 else None  # a pass allowed and not yet started: moving
        # Between steps the held one is still `in_flight`; in poll_while_running the newer one is (or none).
        return (held is not None and bool(launched) and launched[0][0] is held
                and (in_flight is None or in_flight[0] is not held))

    def step_until(self, probe: Callable[[], object], timeout: float = 60.0):
        """Let passes through one at a time until `probe()`, run on the engine thread while it is
        parked, returns something truthy; returns that, with the engine still parked."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.engine.call(lambda: self.parked() and (probe() or None))
            if state is False:  # not parked yet: the engine thread is on its way to the gate
                time.sleep(0.001)
                continue
            if state is not None:
                return state
            self.allow()
        raise AssertionError(f"no parked state satisfied {probe} within {timeout:g}s")
