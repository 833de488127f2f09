"""The engine loop's body: what one iteration runs once the inbox is applied, plainly or with
overlap scheduling.

`Steps`, on the engine thread: poll the KV connector (handing it what the scheduler reports,
applying what it asks through the scheduler) -> schedule -> execute -> update -> publish outputs,
the step's KV events and the statistics.

`OverlappedSteps` (overlap scheduling: the default on CUDA and for a decode, `overlap_scheduling`;
`--no-disable-overlap-schedule` asks for it on a CPU, `--disable-overlap-schedule` turns it off)
runs the same calls with the forward passes on a runner thread: while it computes step N the
engine thread plans step N+1 and launches it, then, until step N is done, applies the inbox and
polls the connector, and takes step N's output (update, publish). The runner thread then does all
of the process's torch work, the model's loading included (engine.py's docstring says why). Every
step runs after the one launched before it, so what the scheduler frees or shares now is only read
or written again by later steps. A failed forward pass fails the engine, as it does with tensor
parallelism: the step after it is already running on its output.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Callable

import torch

from tandem.server.config import EngineConfig
from tandem.server.scheduling.plan import StepOutput, StepPlan

if TYPE_CHECKING:
    from tandem.server.loop.engine import Engine

log = logging.getLogger("tandem.engine")


def overlap_scheduling(config: EngineConfig, device: torch.device, role: str = "colocated") -> bool:
    """`--disable-overlap-schedule`, or where it is unset: overlap on CUDA, and on a CPU for a
    decode server and with `--compute-priority idle`. On a CPU the host work overlap hides is
    about 1% of a step, and it costs a new prompt one more step of waiting (the next step is
    already launched when it arrives; docs/performance-log.md, "Overlap scheduling on two cores", has
    the measurement), which a decode, with no prompts to prefill, does not pay. It frees the engine
    thread to poll while a step computes: a decode notices arrived KV mid-step
    (`OverlappedSteps.poll_while_running`), and at idle priority the engine thread goes on while
    another process's work holds the cores."""
    if config.disable_overlap_schedule is not None:
        return not config.disable_overlap_schedule
    return device.type == "cuda" or role == "decode" or config.compute_priority == "idle"


class Steps:
    """One step at a time, on the engine thread, which also does the torch work."""

    stopping = False  # the inbox said Stop in the middle of a step

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def busy(self) -> bool:
        """A step is still computing: the loop must not wait for the inbox."""
        return False

    def run(self, fn: Callable, *args):
        """`fn(*args)` where this loop does its torch work."""
        return fn(*args)

    def step(self) -> None:
        """poll -> schedule -> execute -> update -> publish."""
        scheduler = self.engine.scheduler
        self.poll_connector()
        plan = scheduler.schedule()
        if plan is not None:
            try:
                out = self.engine.runner.execute(plan)
            except Exception as e:
                self.step_failed(plan, e)
            else:
                self.update(plan, out)
        elif scheduler.has_work():
            time.sleep(0.001)  # nothing fits right now; let inbox traffic (aborts) through
        self.publish()

    def poll_connector(self) -> None:
        """The one exchange with the KV connector per step: it gets what the scheduler reports,
        the scheduler applies what it asks."""
        scheduler, outputs = self.engine.scheduler, self.engine.outputs
        events = self.engine.connector.poll(scheduler.take_handed_off(), scheduler.reserved_tokens())
        for req in events.admit:
            scheduler.add(req)
        for req, first_token in events.arrived:
            scheduler.add_prefilled(req, first_token)
            outputs.publish(req)
        for rid, message, code in events.aborts:
            scheduler.abort(rid, message, code)
        for req, finish in events.ended:
            scheduler.end_elsewhere(req, finish)
            outputs.publish(req)

    def update(self, plan: StepPlan, out: StepOutput) -> None:
        try:
            for req in self.engine.scheduler.update(plan, out):
                self.engine.outputs.publish(req)
        except Exception as e:  # the loop crashes: name the step's requests
            e.add_note(f"while updating a step of requests {', '.join(seq.rid for seq in plan.seqs)}")
            raise

    def step_failed(self, plan: StepPlan, error: Exception) -> None:
        """Fail the step's requests and keep serving; or, where other work already depends on the
        step (tensor-parallel ranks that may now disagree about the KV cache), fail the engine."""
        log.exception("forward pass failed")
        if self.engine.ranks is not None:
            self.engine.fail(self.engine.ranks.explain(error))
        else:
            self.engine.scheduler.fail(plan, f"forward pass failed: {type(error).__name__}: {error}")

    def publish(self) -> None:
        """The end of a step: the streams that ended, the step's KV events, then the statistics
        (which count those events)."""
        self.engine.outputs.publish_ended()
        self.engine.kv_events.publish()
        self.engine.publish_snapshot()

    def settle(self) -> None:
        """The loop is over: nothing computes any more once this returns."""

    def close(self) -> None:
        """Release what this loop owns (once the engine is built, or failed to be)."""


class OverlappedSteps(Steps):
    """Overlap scheduling: the forward passes one step ahead, on the runner thread it owns."""

    def __init__(self, engine: Engine):
        super().__init__(engine)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="tandem-runner")  # every torch call
        self.in_flight: tuple[StepPlan, Future] | None = None  # launched, not yet updated

    @property
    def busy(self) -> bool:
        return self.in_flight is not None

    def run(self, fn: Callable, *args):
        return self.thread.submit(fn, *args).result()

    def step(self) -> None:
        """poll -> schedule step N+1 and launch it on the runner thread -> update step N (waiting
        for its output) -> publish; step N+1 computes meanwhile."""
        scheduler, runner = self.engine.scheduler, self.engine.runner
        self.poll_connector()
        plan = scheduler.schedule()
        launched = None
        if plan is not None:
            launched = plan, self.thread.submit(runner.run, runner.prepare(plan))
        previous, self.in_flight = self.in_flight, launched
        if previous is not None:
            ran, future = previous
            self.poll_while_running(future)
            try:
                out = future.result()
            except Exception as e:
                self.step_failed(ran, e)
            else:
                self.update(ran, out)
        elif plan is None and scheduler.has_work():
            time.sleep(0.001)
        self.publish()

    def poll_while_running(self, step: Future) -> None:
        """Until `step` is done, go on as between steps: apply the inbox (a decode registers a new
        request with its prefill now, not a step later) and poll the connector, as often as it
        asks while its requests wait for their KV. What they admit or free is only read or
        written by steps planned after this point."""
        engine = self.engine
        step.add_done_callback(lambda _: engine.wake())
        while not step.done() and not self.stopping:
            self.stopping = not engine.apply_inbox(engine.connector.step_poll_interval())
            self.poll_connector()

    def step_failed(self, plan: StepPlan, error: Exception) -> None:
        """The next step already runs on this one's output: fail the engine."""
        if self.engine.ranks is not None:
            super().step_failed(plan, error)
            return
        log.exception("forward pass failed")
        self.engine.fail(f"forward pass failed: {type(error).__name__}: {error}")

    def settle(self) -> None:
        """Wait for the step in flight: the device is done with the KV cache before the connector
        closes."""
        if self.in_flight is not None:
            wait([self.in_flight[1]])
            self.in_flight = None

    def close(self) -> None:
        self.thread.shutdown()
