"""Supervising the engines: restart an engine process that died, kill one that hangs.

One `Supervision` per app runs a small loop on the event loop (every `TICK_S`) over one
`EngineSupervisor` per generating model. Each tick, for its engine:

* running: the watchdog. An engine process that holds work (a generation sent to it, a model
  call) and has sent nothing back for `stall_s` is stuck (stopped, deadlocked, in an endless
  kernel): it is killed with SIGKILL, and so handled as any engine process that died.
* died (the ProcessClient's reader saw the pipe close): what it ran has already ended with an
  error (code engine_restarting). The waiting line stays; a new engine process is started
  after a backoff (`backoff_s`, doubling up to `backoff_max_s`) on a worker thread, and takes
  the line from where it was. Requests that arrive meanwhile wait in line, for at most
  `wait_s`: past that, those waiting end and new ones are refused, both with a 503
  (code engine_restarting) whose Retry-After says when the next engine process should be up.
* a crash loop: more than `max_restarts` deaths within `window_s` (or restarts turned off
  with max_restarts 0) and the supervisor gives up: state "failed", every request refused
  with a 503 (code engine_failed) that says why, /readyz 503 with the same words.

Each model's state (starting, running, restarting, failed, stopped), restart count and reason
are what /readyz, /models and /metrics report. An engine on a thread of the server (ENGINE_PROCESS
false) cannot be restarted or killed: its state is watched and reported only.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterable

from attnlens.app.engine.front import EngineFailed, EngineFront

log = logging.getLogger("attnlens.engine")

TICK_S = 0.1  # how often each engine is looked at


@dataclass(frozen=True)
class RestartPolicy:
    """How engines are restarted (ATTNLENS_ENGINE_* settings)."""

    max_restarts: int = 5  # deaths within window_s before giving up; 0: never restart
    window_s: float = 300.0
    backoff_s: float = 0.5  # before the first restart; doubles after each death within the window
    backoff_max_s: float = 30.0
    wait_s: float = 10.0  # a request waits this long in line for a restarting engine, then 503
    stall_s: float = 30.0  # the watchdog: no progress this long while holding work = dead


class EngineSupervisor:
    """Watches one model's engine (see the module docstring)."""

    def __init__(self, name: str, engine: EngineFront, policy: RestartPolicy,
                 clock: Callable[[], float] = time.monotonic):
        self.name, self.engine, self.policy, self.clock = name, engine, policy, clock
        self.restartable = engine.restartable and policy.max_restarts > 0
        if engine.restartable:
            engine.supervise()  # a death keeps the line: this decides (restart, or give up and say why)
        self.restarts = 0  # engine processes started after the first
        self.deaths: collections.deque[float] = collections.deque()  # within the window
        self.down_since: float | None = None  # when the running engine process was lost
        self.next_attempt: float | None = None  # when the next start is due (None: none scheduled)
        self.refusing = False  # past wait_s: the line was emptied, new requests get 503
        self._attempt: asyncio.Future | None = None
        self.last_error: str | None = None  # why the last start attempt failed

    @property
    def state(self) -> str:
        return self.engine.state

    @property
    def detail(self) -> str | None:
        """Why the model does not run, in words for /readyz and /models (None when it runs)."""
        state = self.state
        if state == "running":
            return None
        if not self.engine.restartable:
            return "the engine thread has stopped" if state == "failed" else None
        base = self.engine.detail or ""
        if state == "restarting":
            return f"{base}; restarting it (restart {self.restarts + 1}; at most {self.policy.max_restarts} " \
                   f"within {self.policy.window_s:g} s)"
        return base or None

    def retry_after(self) -> int:
        """Seconds until the engine is likely back: the backoff left, then one start-up."""
        now = self.clock()
        left = max(0.0, (self.next_attempt or now) - now)
        start = self.engine.start_seconds or 1.0
        return max(1, math.ceil(left + start))

    # --- one tick --------------------------------------------------------------
    def check(self) -> None:
        engine = self.engine
        if not engine.restartable or engine.state in ("stopped", "failed", "starting"):
            return
        now = self.clock()
        if engine.state == "running":
            stalled = engine.stalled_for(now)
            if stalled > self.policy.stall_s:
                log.error("the engine process for model %r made no progress for %.0f s while holding work; "
                          "killing it (ATTNLENS_ENGINE_STALL_S)", self.name, stalled)
                engine.kill(f"no progress for {stalled:.0f} s while holding work (ATTNLENS_ENGINE_STALL_S)")
            return
        # restarting: the engine process is gone (or the last attempt to start one failed)
        if self.down_since is None:
            self.down_since = now
        if self._attempt is None and self.next_attempt is None:
            self._died(now)
            if engine.state == "failed":
                return
        if now - self.down_since > self.policy.wait_s:  # requests have waited long enough
            if not self.refusing:
                self.refusing = True
                engine.refuse_while_down(f"the engine of model {self.name!r} is restarting "
                                         f"({engine.detail}); retry later", self.retry_after())
            else:
                engine.update_retry_after(self.retry_after())
        if self._attempt is None:
            assert self.next_attempt is not None  # _died scheduled it (above, or when the last attempt failed)
            if now >= self.next_attempt:
                self._attempt = asyncio.ensure_future(asyncio.to_thread(engine.restart))
                self._attempt.add_done_callback(self._attempt_done)

    def _died(self, now: float) -> None:
        """The engine process was lost (or failed to start) just now: schedule a restart, or give up."""
        self.deaths.append(now)
        while self.deaths and now - self.deaths[0] > self.policy.window_s:
            self.deaths.popleft()
        why = self.engine.detail or "the engine process stopped"
        if not self.restartable:
            self._give_up(f"{why}; restarts are off (ATTNLENS_ENGINE_MAX_RESTARTS=0)")
        elif len(self.deaths) > self.policy.max_restarts:
            self._give_up(f"{why}; it stopped {len(self.deaths)} times within {self.policy.window_s:g} s "
                          f"(ATTNLENS_ENGINE_MAX_RESTARTS={self.policy.max_restarts}), so it is not restarted "
                          f"again")
        else:
            backoff = min(self.policy.backoff_max_s, self.policy.backoff_s * 2 ** (len(self.deaths) - 1))
            self.next_attempt = now + backoff
            log.warning("restarting the engine process of model %r in %.1f s", self.name, backoff)

    def _give_up(self, message: str) -> None:
        log.error("model %r: %s", self.name, message)
        self.engine.give_up(f"model {self.name!r} cannot generate: {message}", EngineFailed)

    def _attempt_done(self, attempt: asyncio.Future) -> None:
        self._attempt, self.next_attempt = None, None
        error = attempt.exception() if not attempt.cancelled() else None
        if attempt.cancelled() or self.engine.state == "stopped":
            return
        if error is None:
            self.restarts += 1
            self.down_since, self.refusing, self.last_error = None, False, None
            log.warning("model %r: a new engine process (pid %s) runs, after %.1f s to start", self.name,
                        self.engine.core_pid, self.engine.start_seconds)
            return
        # the new engine process did not start: the next check counts it as one more death
        self.last_error = f"{type(error).__name__}: {error}"
        log.error("model %r: the engine process did not start: %s", self.name, self.last_error)


class Supervision:
    """Every model's EngineSupervisor, checked by one loop on the event loop."""

    def __init__(self, supervisors: Iterable[EngineSupervisor]):
        self.supervisors = {s.name: s for s in supervisors}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="attnlens-supervision")

    async def stop(self) -> None:
        """No more checks or restarts (a start under way sees the engine closed and stops its process)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        while True:
            for s in self.supervisors.values():
                try:
                    s.check()
                except Exception:  # one model's trouble must not stop the others' supervision
                    log.exception("supervising model %r failed", s.name)
            await asyncio.sleep(TICK_S)

    def collect(self):
        """Prometheus metric families of every supervised engine (a custom collector)."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        states = GaugeMetricFamily("attnlens_engine_state", "1 for each model's engine state (starting, "
                                   "running, restarting, failed, stopped), 0 for the others", labels=["model", "state"])
        restarts = CounterMetricFamily("attnlens_engine_restarts", "Engine processes started again after one died",
                                       labels=["model"])
        for name, s in self.supervisors.items():
            current = s.state
            for state in ENGINE_STATES:
                states.add_metric([name, state], 1.0 if state == current else 0.0)
            restarts.add_metric([name], s.restarts)
        yield states
        yield restarts

    def describe(self):
        return []  # the families depend on the models: collected only when asked


ENGINE_STATES = ("starting", "running", "restarting", "failed", "stopped")
