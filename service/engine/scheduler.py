"""Continuous-batching scheduler: the waiting and running queues, cache-slot accounting and the
policy that decides, every step, which waiting requests to prefill.

Plain Python, no torch: the engine hands the scheduler's decisions (``SchedulerOutput``, a plain
dataclass in ``records.py``) to the runner, so scheduling can be tested without a model (as in vLLM's v1 engine).

One slot is one hypothesis: a request with beam_size k holds k cache slots from its prefill until it
finishes or is cancelled. Requests are admitted first-in, first-out; when the oldest waiting request
does not fit (slots, token budget, running cap), nobody behind it is admitted either, so a large beam
request cannot be starved by a stream of small ones.

Policies (``EngineConfig.policy``):
- ``decode_first``: steps only decode while requests run; a prefill is forced on the k-th step in a
  row that finds requests waiting (k = ``prefill_every``, so a request that fits is prefilled within
  k steps of its arrival), or as soon as the waiting requests that fit into the free slots
  outnumber the running ones by ``waiting_ratio`` (an under-filled batch is refilled at once).
  A step with nothing running prefills at once.
- ``prefill_first``: admit whatever fits at every step (lowest queue wait, smaller prefill batches).
- ``static``: admit only when nothing runs: static batching through the engine (a baseline).
"""
from __future__ import annotations

from collections import deque
from typing import Optional, Protocol, Sequence

from .config import EngineConfig
from .errors import EngineValidationError, QueueFullError
from .records import ScheduledRequest, SchedulerOutput


# ---- slots -----------------------------------------------------------------------------------

class SlotAllocator(Protocol):
    """What the scheduler needs from a slot allocator: ``model.slots.SlotPool`` (the engine hands it
    the KV cache's own, ``KVCache.slots``). Raises from ``allocate`` when fewer than n are free, and
    ValueError from ``free`` for a slot that is not allocated."""
    num_slots: int

    @property
    def num_free(self) -> int: ...
    @property
    def usage(self) -> float: ...
    def allocate(self, n: int) -> list[int]: ...
    def free(self, slots: Sequence[int]) -> None: ...


# ---- the scheduler -----------------------------------------------------------------------------

class Scheduler:
    """FIFO waiting queue + running set over a fixed pool of cache slots.

    Invariant: every slot is either free in ``slots`` or held by exactly one running request;
    a request is in at most one of ``waiting`` / ``running``.
    """

    def __init__(self, config: EngineConfig, slots: SlotAllocator):
        self.config = config
        self.slots = slots
        self.waiting: deque[ScheduledRequest] = deque()
        self.running: dict[int, ScheduledRequest] = {}   # request_id -> request, in admission order
        self.step_count = 0
        self._steps_without_prefill = 0                    # decode steps taken while requests waited
        self._by_id: dict[int, ScheduledRequest] = {}
        self.admitting = True                              # False pauses admission (engine reconfiguring)

    # ---- queue ---------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_running_seqs(self) -> int:
        return self.slots.num_slots - self.slots.num_free

    def add(self, req: ScheduledRequest) -> None:
        """Append to the waiting queue. Raises QueueFullError when max_waiting requests wait, and
        EngineValidationError when the request could never be admitted (beam_size > max_num_seqs)."""
        if req.num_slots > self.slots.num_slots:
            raise EngineValidationError("beam_size", f"needs {req.num_slots} cache slots, the engine has "
                                                     f"{self.slots.num_slots} (max_num_seqs)")
        if req.request_id in self._by_id:
            raise ValueError(f"request {req.request_id} is already scheduled")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} sentences waiting)")
        req.arrival_step = self.step_count
        self.waiting.append(req)
        self._by_id[req.request_id] = req

    def finish(self, request_id: int) -> Optional[ScheduledRequest]:
        """Remove a request (finished, failed or cancelled) from whichever queue holds it and free
        its slots. Unknown ids are ignored (returns None)."""
        req = self._by_id.pop(request_id, None)
        if req is None:
            return None
        if self.running.pop(request_id, None) is not None:
            self.slots.free(req.slots)
        else:
            self.waiting.remove(req)
        return req

    abort = finish

    # ---- policy --------------------------------------------------------------------------------
    def _wants_prefill(self) -> bool:
        if not self.waiting or not self.admitting:
            return False
        if not self.running:
            return True
        policy = self.config.policy
        if policy == "prefill_first":
            return True
        if policy == "static":
            return False
        return (self._steps_without_prefill + 1 >= self.config.prefill_every
                or self._num_admissible() > self.config.waiting_ratio * len(self.running))

    def _num_admissible(self) -> int:
        """Waiting requests (from the head) that would fit into the free slots now. Counting these
        rather than all waiting requests keeps an overloaded engine (long queue, full batch) from
        prefilling a sliver at every step."""
        free, n = self.slots.num_free, 0
        cap = self.config.max_running_requests
        room = len(self.waiting) if cap is None else max(cap - len(self.running), 0)
        for req in self.waiting:
            if n >= room or req.num_slots > free:
                break
            free -= req.num_slots
            n += 1
        return n

    def _admit(self) -> list[ScheduledRequest]:
        """Take waiting requests in FIFO order while slots, the token budget and the running cap allow."""
        cfg = self.config
        batch: list[ScheduledRequest] = []
        free = self.slots.num_free
        longest = 0
        cap = cfg.max_running_requests
        while self.waiting:
            req = self.waiting[0]
            if req.num_slots > free or (cap is not None and len(self.running) + len(batch) >= cap):
                break
            longest_new = max(longest, req.num_src_tokens)
            if batch and (len(batch) + 1) * longest_new > cfg.max_prefill_tokens:
                break  # a lone request longer than the budget still goes (it would never fit otherwise)
            self.waiting.popleft()
            req.slots = self.slots.allocate(req.num_slots)
            req.admitted_step = self.step_count
            free -= req.num_slots
            longest = longest_new
            batch.append(req)
        return batch

    def schedule(self) -> SchedulerOutput:
        """Decide the next step: which waiting requests to prefill, and decode every running one."""
        self.step_count += 1
        decode = list(self.running.values())
        prefill = self._admit() if self._wants_prefill() else []
        # Steps in a row that left requests waiting; reset by a prefill or an empty queue.
        self._steps_without_prefill = 0 if prefill or not self.waiting else self._steps_without_prefill + 1
        for req in prefill:
            self.running[req.request_id] = req
        longest = max((r.num_src_tokens for r in prefill), default=0)
        return SchedulerOutput(self.step_count, prefill, decode,
                               num_prefill_tokens=sum(r.num_src_tokens for r in prefill),
                               num_prefill_padded=longest * len(prefill))

    def stats(self) -> dict:
        """Queue and slot figures (plain numbers, for metrics)."""
        return {"running_requests": len(self.running), "running_sequences": self.num_running_seqs,
                "waiting_requests": len(self.waiting), "free_slots": self.slots.num_free,
                "num_slots": self.slots.num_slots, "kv_cache_usage": self.slots.usage, "steps": self.step_count}
