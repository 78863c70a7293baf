"""The rollout runner of the GPU path: runs the rollouts that verl's trainer enqueues in agl-server's store.

On GPU plans Agent Lightning's verl trainer (AglRolloutManager) registers its vLLM servers with agl-server,
enqueues one rollout per sample (input = a task row of the plan's train split) and polls until each is
terminal, then reads the calls the gateway captured and the rollout's last `reward` event. Something has to
run the queued rollouts: upstream, agl-controller's local runner (a subprocess per rollout). The
StoreWorker does the same with the team harness, through LightningBackend.run_rollout, so a rollout on GPU
is run, scored and marked exactly like one on CPU:

- claim: every queued rollout (`GET /api/rollouts?state_in=queuing`) is marked running with attempt "0";
- run: the team harness against the gateway's per-rollout proxy URL, with the model name the trainer
  registered; the reference scorer's result is posted as the `reward` event;
- a harness that fails or is killed marks its rollout failed with the reason (the trainer gets it back as
  a failed rollout with no calls; none is left running), and the worker keeps going.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from runner_kit.rollout import EnvironmentDown

from .backend import Gateway, LightningBackend


@dataclass
class WorkerCounts:
    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)  # "<rollout id>: <reason>", first 20


class StoreWorker:
    """Polls agl-server for queued rollouts and runs each with the team harness, `concurrency` at a time."""

    def __init__(self, backend: LightningBackend, *, model: str, max_turns: int, concurrency: int = 4,
                 poll_s: float = 0.2):
        self.backend = backend
        self.model = model
        self.max_turns = max_turns
        self.concurrency = concurrency
        self.poll_s = poll_s
        self.counts = WorkerCounts()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="rollout")
        self._running: set[str] = set()
        self._thread = threading.Thread(target=self._loop, name="store-worker", daemon=True)
        self.error: BaseException | None = None  # what stopped the polling loop, if anything did

    def start(self) -> StoreWorker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.backend.kill_harnesses()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._claim_queued(self.backend.gateway)
                self._stop.wait(self.poll_s)
        except BaseException as error:  # reported by the stage; the trainer then times its rollouts out
            self.error = error

    def _claim_queued(self, gateway: Gateway) -> None:
        with self._lock:
            free = self.concurrency - len(self._running)
        if free <= 0:
            return
        try:
            queued = gateway.api("GET", f"/api/rollouts?state_in=queuing&limit={free}")
        except EnvironmentDown:
            return  # a restart is under way; the next poll sees the new store
        for rollout in queued:
            rollout_id = rollout["rollout_id"]
            with self._lock:
                if rollout_id in self._running:
                    continue
                self._running.add(rollout_id)
                self.counts.claimed += 1
            self._pool.submit(self._run, gateway, rollout_id, rollout.get("input") or {})

    def _run(self, gateway: Gateway, rollout_id: str, task_input: dict[str, Any]) -> None:
        failure = None
        missing = [key for key in ("family", "item") if key not in task_input]
        if missing:
            failure = f"ValueError: the rollout's input lacks {missing} (a task row of the plan's split was expected)"
            self.backend.mark_failed(gateway, rollout_id, failure.removeprefix("ValueError: "))
        else:
            task = {"family": task_input["family"], "item": task_input["item"], "max_turns": self.max_turns}
            try:
                self.backend.run_rollout(gateway, rollout_id, task, self.model)  # marks it failed when it raises
            except Exception as error:
                failure = f"{type(error).__name__}: {error}"
        with self._lock:
            self._running.discard(rollout_id)
            if failure is None:
                self.counts.succeeded += 1
                return
            self.counts.failed += 1
            if len(self.counts.failures) < 20:
                self.counts.failures.append(f"{rollout_id}: {failure[:300]}")
