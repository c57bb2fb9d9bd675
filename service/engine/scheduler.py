"""Continuous-batching scheduler: the waiting and running queues, cache-slot accounting and the
policy that decides, every step, which waiting requests to prefill.

Plain Python, no torch: the engine hands the scheduler's decisions (``SchedulerOutput``, a plain
dataclass in ``records.py``) to the runner, so scheduling can be tested without a model (as in vLLM's v1 engine).

One slot is one hypothesis: a request with beam_size k holds k cache slots from its prefill until it
finishes or is cancelled. Requests are admitted first-in, first-out; when the oldest waiting request
does not fit (slots, KV blocks, token budget, running cap), nobody behind it is admitted either, so a
large beam request cannot be starved by a stream of small ones.

Requests may carry a ``group`` (the translator gives every sentence of one API request the same
one); the queue then takes turns between groups, as start-time fair queueing does between flows
(Goyal et al., 1996): a request's ``turn`` is the scheduler's current turn (that of the last
admission) when it arrives, or one more than its group's previous request's turn when that is
later; the waiting queue is kept in turn order (arrival order among equal turns; preempted requests
at its head). So an API request of 256 sentences puts one sentence, not all 256, ahead of a
one-sentence request that arrives after it, and two large ones alternate. Requests without a group
(or one each) are served first-in, first-out, as before.

KV blocks (a paged cache; an allocator without blocks, a plain ``SlotPool``, is accounted in slots
only): the scheduler owns them, as vLLM's KV-cache manager does. Its ``BlockPool``
(``model.inference.slots``, the rule of how many blocks a hypothesis holds at a position) allocates
at admission a request's source blocks and each hypothesis' first target block, at every step a
block for each hypothesis whose position reaches a new one, and frees all of them when the request
finishes, is cancelled or preempted; ``SchedulerOutput.blocks`` hands those changes to the runner,
which applies them to the cache's block tables before it writes (the runner never allocates).
Admission needs the source blocks plus one per hypothesis, leaving ``reserve`` blocks free; before
every step the scheduler counts the blocks the running requests take (``step_blocks``) and, when
fewer are free, preempts the most recently admitted ones: their blocks and slots are freed and they
go back to the head of the waiting queue, to be prefilled again (their output is the same: decoding
is deterministic). The oldest running request is never preempted, and a request that could not fit
alone at its longest is refused at ``add``.

Admission order (``EngineConfig.admission``): ``fifo`` (the default) as above; ``shortest_first``
takes the waiting requests smallest job first (source tokens x beam size: a translation's output
grows with its source, so the size of each job is known at arrival), arrival order among equals,
with the same head-of-line rule in that order; a request that has waited ``max_wait_steps`` steps
(or was preempted) goes before every smaller one, in arrival order, so smaller ones pass a long
sentence for at most that many steps (sorting the queue costs O(n log n) per step while it waits). Under a burst this lowers the median latency (short sentences are not
queued behind long ones, as length-sorted batches do offline; Marian's ``--maxi-batch-sort src``)
at the cost of the longest ones' latency.

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
from .records import EngineStats, ScheduledRequest, SchedulerOutput


# ---- slots -----------------------------------------------------------------------------------

class SlotAllocator(Protocol):
    """What the scheduler needs from a slot allocator: ``model.inference.slots.SlotPool`` (the engine hands it
    the KV cache's own, ``KVCache.slots``, used by nobody else while it serves: a ``BlockPool`` for the
    paged cache, which adds ``num_blocks``, ``num_free_blocks``, ``block_size``, ``block_usage``, the
    block rule (``blocks_for``, ``target_blocks``, ``new_target_blocks``), ``allocate_source``,
    ``allocate_target`` and ``pop_update``; freeing a slot frees its blocks). Raises from ``allocate``
    when fewer than n are free, and ValueError from ``free`` for a slot that is not allocated."""
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

    Invariant: every slot (and KV block) is either free in ``slots`` or held by exactly one running
    request; a request is in at most one of ``waiting`` / ``running``; after ``schedule`` the cache's
    block tables, once the runner applies ``SchedulerOutput.blocks``, hold exactly the blocks of ``slots``.
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
        self.turn = 0                                      # the turn of the last admitted request (fair queueing)
        self._groups: dict = {}                            # group -> [its last turn, its requests waiting]
        self.num_preemptions = 0                           # requests requeued for blocks, in all

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

    # ---- KV blocks -----------------------------------------------------------------------------
    @property
    def paged(self) -> bool:
        return hasattr(self.slots, "num_blocks")

    @property
    def reserve(self) -> int:
        """Blocks admission leaves free for the running requests' growth: 1% of the pool."""
        return -(-self.slots.num_blocks // 100) if self.paged else 0

    def admit_blocks(self, req: ScheduledRequest) -> int:
        """Blocks a request takes at admission (``_admit``): its source, and the first block of each hypothesis."""
        if not self.paged:
            return 0
        return self.slots.blocks_for(req.num_src_tokens) + self.slots.new_target_blocks(req.num_slots, 0)

    def max_blocks(self, req: ScheduledRequest) -> int:
        """Blocks a request holds at its longest (source, and max_new_tokens positions per hypothesis)."""
        if not self.paged or req.max_new_tokens is None:
            return 0
        last = max(req.max_new_tokens, 1) - 1                 # the last target position it writes
        return self.slots.blocks_for(req.num_src_tokens) + req.num_slots * self.slots.target_blocks(last)

    def position(self, req: ScheduledRequest) -> int:
        """The target position a running request's hypotheses write in the current step (0 at its prefill)."""
        return self.step_count - req.admitted_step

    def step_blocks(self, req: ScheduledRequest) -> int:
        """Blocks a running request takes in the current step (``_grow``): a new one for each
        hypothesis whose position reaches a new block."""
        return self.slots.new_target_blocks(req.num_slots, self.position(req)) if self.paged else 0

    def _grow(self) -> list[ScheduledRequest]:
        """Allocate the blocks the running requests write in this step; when fewer are free, first
        requeue the newest running requests (freeing theirs) until they are. Returns the requeued."""
        per_slot: dict[int, int] = {}                # position -> blocks a hypothesis takes there
        growing: list[ScheduledRequest] = []
        need = 0
        for r in self.running.values():              # the rule once per position, not once per request
            p = self.step_count - r.admitted_step
            n = per_slot.get(p)
            if n is None:
                n = per_slot[p] = self.slots.new_target_blocks(1, p)
            if n:
                growing.append(r)
                need += n * r.num_slots
        out: list[ScheduledRequest] = []
        while need > self.slots.num_free_blocks and len(self.running) > 1:
            rid = next(reversed(self.running))
            req = self.running.pop(rid)
            need -= self.step_blocks(req)
            self.slots.free(req.slots)
            req.slots, req.admitted_step = [], -1
            req.num_preemptions += 1
            self.waiting.appendleft(req)             # its turn came already: first again
            out.append(req)
        self.num_preemptions += len(out)
        for req in growing:
            if req.admitted_step >= 0:               # not just preempted
                self.slots.allocate_target(req.slots, self.position(req))
        return out

    def add(self, req: ScheduledRequest) -> None:
        """Append to the waiting queue. Raises QueueFullError when max_waiting requests wait, and
        EngineValidationError when the request could never be admitted (beam_size > max_num_seqs)."""
        if req.num_slots > self.slots.num_slots:
            raise EngineValidationError("beam_size", f"needs {req.num_slots} cache slots, the engine has "
                                                     f"{self.slots.num_slots} (max_num_seqs)")
        if self.paged and self.max_blocks(req) > self.slots.num_blocks:
            raise EngineValidationError("beam_size", f"beam_size {req.num_slots} with {req.num_src_tokens} source "
                                                     f"tokens and max_new_tokens {req.max_new_tokens} needs up to "
                                                     f"{self.max_blocks(req)} KV-cache blocks, the engine has "
                                                     f"{self.slots.num_blocks} (kv_blocks)")
        if req.request_id in self._by_id:
            raise ValueError(f"request {req.request_id} is already scheduled")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} sentences waiting)")
        req.arrival_step = self.step_count
        self._enqueue(req)
        self._by_id[req.request_id] = req

    def _enqueue(self, req: ScheduledRequest) -> None:
        """Give ``req`` its turn and put it after every waiting request of an earlier or equal turn."""
        g = self._groups.get(req.group) if req.group is not None else None
        req.turn = self.turn if g is None else max(self.turn, g[0] + 1)
        if req.group is not None:
            if g is None:
                self._groups[req.group] = [req.turn, 1]
            else:
                g[0], g[1] = req.turn, g[1] + 1
        w = self.waiting
        i = len(w)
        while i and w[i - 1].num_preemptions == 0 and w[i - 1].turn > req.turn:   # usually no step at all
            i -= 1
        w.insert(i, req)

    def _dequeued(self, req: ScheduledRequest, admitted: bool) -> None:
        """Bookkeeping after ``req`` left the waiting queue (admitted, or finished/cancelled there)."""
        if admitted:
            self.turn = max(self.turn, req.turn)
        g = self._groups.get(req.group) if req.group is not None else None
        if g is not None and req.num_preemptions == 0:   # a preempted request is not counted again
            g[1] -= 1
            if not g[1]:
                del self._groups[req.group]

    def finish(self, request_id: int) -> Optional[ScheduledRequest]:
        """Remove a request (finished, failed or cancelled) from whichever queue holds it and free
        its slots and blocks (the next ``SchedulerOutput.blocks`` says so). Unknown ids are ignored
        (returns None)."""
        req = self._by_id.pop(request_id, None)
        if req is None:
            return None
        if self.running.pop(request_id, None) is not None:
            self.slots.free(req.slots)
        else:
            self.waiting.remove(req)
            self._dequeued(req, admitted=False)
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
        blocks = self._free_blocks()
        cap = self.config.max_running_requests
        room = len(self.waiting) if cap is None else max(cap - len(self.running), 0)
        for req in self._admission_order():
            if n >= room or req.num_slots > free or self.admit_blocks(req) > blocks:
                break
            free -= req.num_slots
            blocks -= self.admit_blocks(req)
            n += 1
        return n

    def _admission_order(self):
        """The waiting requests in the order they are admitted (``EngineConfig.admission``): the queue
        itself for fifo; for shortest_first, those due (waited ``max_wait_steps`` or preempted) first
        in arrival order, then the rest by job size (source tokens x beam), arrival order among equals."""
        if self.config.admission == "fifo" or len(self.waiting) < 2:
            return self.waiting
        due = self.step_count - self.config.max_wait_steps

        def key(req: ScheduledRequest) -> tuple:
            overdue = req.num_preemptions > 0 or req.arrival_step <= due
            return (not overdue, 0 if overdue else req.num_src_tokens * req.num_slots)
        return sorted(self.waiting, key=key)    # stable: the queue's (arrival) order among equal keys

    def _free_blocks(self) -> int:
        """Blocks admission may hand out now: free ones (this step's growth already taken) less the reserve."""
        return self.slots.num_free_blocks - self.reserve if self.paged else 0

    def _admit(self) -> list[ScheduledRequest]:
        """Take waiting requests in admission order (``_admission_order``) while slots, KV blocks, the
        token budget and the running cap allow; allocate their slots and blocks."""
        cfg = self.config
        batch: list[ScheduledRequest] = []
        free = self.slots.num_free
        blocks = self._free_blocks()
        longest = 0
        cap = cfg.max_running_requests
        for req in self._admission_order():     # not mutated in the loop: taken out after it
            if req.num_slots > free or (cap is not None and len(self.running) + len(batch) >= cap):
                break
            if self.admit_blocks(req) > blocks and (self.running or batch):
                break  # alone, a request admitted at add() always fits
            longest_new = max(longest, req.num_src_tokens)
            if batch and (len(batch) + 1) * longest_new > cfg.max_prefill_tokens:
                break  # a lone request longer than the budget still goes (it would never fit otherwise)
            req.slots = self.slots.allocate(req.num_slots)
            req.admitted_step = self.step_count
            if self.paged:                      # its source, in its first slot
                self.slots.allocate_source(req.slots[0], req.num_src_tokens)
            free -= req.num_slots
            blocks -= self.admit_blocks(req)
            longest = longest_new
            batch.append(req)
        for req in batch if self.paged else ():  # then position 0 of every hypothesis (after all sources)
            self.slots.allocate_target(req.slots, 0)
        if cfg.admission == "fifo":              # the batch is the queue's head
            for _ in batch:
                self.waiting.popleft()
        else:
            for req in batch:
                self.waiting.remove(req)
        for req in batch:
            self._dequeued(req, admitted=True)
        return batch

    def schedule(self) -> SchedulerOutput:
        """Decide the next step: which waiting requests to prefill, and decode every running one, with
        the KV blocks they write (``blocks``: what changed since the last step)."""
        self.step_count += 1
        preempted = self._grow() if self.paged else []
        decode = list(self.running.values())
        prefill = self._admit() if not preempted and self._wants_prefill() else []
        # Steps in a row that left requests waiting; reset by a prefill or an empty queue.
        self._steps_without_prefill = 0 if prefill or not self.waiting else self._steps_without_prefill + 1
        for req in prefill:
            self.running[req.request_id] = req
        longest = max((r.num_src_tokens for r in prefill), default=0)
        out = SchedulerOutput(self.step_count, prefill, decode,
                              num_prefill_tokens=sum(r.num_src_tokens for r in prefill),
                              num_prefill_padded=longest * len(prefill), preempted=preempted)
        if self.paged and not out.is_empty:      # an empty step is not executed: its frees wait for the next
            out.blocks = self.slots.pop_update()
        return out

    def stats(self) -> EngineStats:
        """Queue, slot and block figures (the engine adds its cache's bytes and its settings)."""
        paged = self.paged
        return EngineStats(running_requests=len(self.running), running_sequences=self.num_running_seqs,
                           waiting_requests=len(self.waiting), free_slots=self.slots.num_free,
                           num_slots=self.slots.num_slots, kv_cache_usage=self.usage, slot_usage=self.slots.usage,
                           steps=self.step_count, preemptions=self.num_preemptions,
                           kv_blocks=self.slots.num_blocks if paged else None,
                           free_kv_blocks=self.slots.num_free_blocks if paged else None,
                           kv_block_size=self.slots.block_size if paged else None)

    @property
    def usage(self) -> float:
        """Fraction of the KV cache in use, 0..1: of its blocks (paged), else of its slots."""
        return self.slots.block_usage if self.paged else self.slots.usage
