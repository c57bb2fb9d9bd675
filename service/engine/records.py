"""The records the engine's parts hand each other, plain dataclasses with one comment per field.

    Engine.translate/stream --GenerationOptions--> Scheduler.add(ScheduledRequest)
    Scheduler.schedule() --SchedulerOutput--> ModelRunner.execute() --StepResult(SequenceOutput...)-->
    Engine (futures, streams) --TranslationResult(RequestStats), StepStats--> callers and metrics

No torch here: the scheduler and its tests use these without a model.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Optional

from service.protocol import GenerationOptions   # what a caller asks of one sentence (re-exported here)

if TYPE_CHECKING:
    from model.inference.beam import Hypothesis
    from model.inference.slots import BlockUpdate


@dataclass(eq=False)
class ScheduledRequest:
    """The scheduler's view of one request (one sentence)."""
    request_id: int
    num_src_tokens: int                      # source ids, EOS included: the prefill cost
    num_slots: int = 1                       # cache slots held while running: the beam size
    src_ids: tuple[int, ...] = ()            # source ids, EOS included (for the runner; never read here)
    options: Optional["GenerationOptions"] = None  # validated, max_new_tokens resolved (for the runner)
    stream: bool = False                     # the runner reports tokens as they become final
    arrival_step: int = -1                   # scheduler step count when it was added
    admitted_step: int = -1                  # step of its prefill
    slots: list[int] = field(default_factory=list)  # cache slots, assigned at admission
    max_new_tokens: Optional[int] = None     # target positions per hypothesis at most (KV blocks it may need)
    num_preemptions: int = 0                 # times its blocks were taken back and it was requeued
    group: Optional[Hashable] = None         # requests of one API call: admission takes turns between groups
    turn: int = 0                            # its place in those turns (set by the scheduler at add)


@dataclass
class SchedulerOutput:
    """What one engine step executes."""
    step: int                                # 1-based step number
    prefill: list[ScheduledRequest]          # admitted now: encoder, cross K/V, first decoder step
    decode: list[ScheduledRequest]           # admitted earlier: one decoder step each, all together
    num_prefill_tokens: int = 0              # real source ids in the prefill batch
    num_prefill_padded: int = 0              # batch size x longest source (the budgeted cost)
    preempted: list[ScheduledRequest] = field(default_factory=list)  # requeued now: drop their state
    blocks: Optional["BlockUpdate"] = None   # KV blocks the scheduler assigned and freed since the last step
                                             # (paged cache): the runner applies them before it writes

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def num_decode_seqs(self) -> int:
        """Hypotheses (slots) stepped by the decode forward."""
        return sum(r.num_slots for r in self.decode)


@dataclass
class SequenceOutput:
    """What one step produced for one request."""
    request_id: int
    new_tokens: list[int] = field(default_factory=list)  # tokens now final (greedy: one per step; beam: at the end)
    hypotheses: Optional[list[Hypothesis]] = None         # set when the request finished (n_best, best first)
    error: Optional[BaseException] = None                 # set when this request failed (others go on)

    @property
    def finished(self) -> bool:
        return self.hypotheses is not None or self.error is not None


@dataclass
class StepResult:
    """What the runner did in one step (plain numbers for StepStats, plus per-request outputs)."""
    outputs: list[SequenceOutput]
    num_decode_seqs: int = 0                 # rows of the decode forward (hypotheses)
    prefill_s: float = 0.0                   # wall time of the prefill call(s)
    decode_s: float = 0.0                    # wall time of the decode_step call(s)
    update_s: float = 0.0                    # top-k, searches, cache reorder


@dataclass
class RequestStats:
    """Timings of one request (seconds); handed to ``on_finish`` and returned with the result."""
    request_id: int
    status: str                               # "ok", "cancelled" or "error"
    finish_reason: str                        # best hypothesis' "eos" / "length"; else the status
    src_tokens: int                           # source ids, EOS included
    beam_size: int
    generated_tokens: int = 0                 # tokens of the best hypothesis, EOS counted when generated
    num_steps: int = 0                        # engine steps it took part in (its prefill step included)
    queue_wait_s: float = 0.0                 # submitted -> its prefill step began
    prefill_s: float = 0.0                    # duration of the prefill call it was part of
    decode_s: float = 0.0                     # end of its prefill step -> finished
    time_to_first_token_s: float = 0.0        # submitted -> its first token was chosen
    total_s: float = 0.0                      # submitted -> finished


@dataclass
class StepStats:
    """One engine step; handed to ``on_step``."""
    step: int
    num_prefill_requests: int                 # requests admitted (prefilled) this step
    num_prefill_tokens: int                   # their source ids
    num_prefill_padded_tokens: int            # prefill batch size x longest source
    num_decode_requests: int                  # requests in the decode forward
    num_decode_seqs: int                      # hypotheses (rows) in the decode forward
    num_scored_rows: int                      # rows scored this step (prefill + decode); beams count every row
    num_finished: int                         # requests that finished or failed this step
    prefill_s: float
    decode_s: float
    update_s: float                           # top-k, searches, cache reorder
    duration_s: float                         # the whole step, hand-off to the worker included
    running_requests: int                     # after the step
    running_sequences: int
    waiting_requests: int
    kv_cache_usage: float                     # fraction of KV-cache blocks in use, 0..1 (slots without paging)
    num_preempted: int = 0                    # requests preempted (requeued) by this step


@dataclass
class EngineStats:
    """A snapshot of an engine's queues and KV cache (``Engine.stats()``; the scheduler fills its part)."""
    running_requests: int                     # requests (sentences) decoding
    running_sequences: int                    # their hypotheses: rows of the decode step
    waiting_requests: int                     # requests queued for admission
    free_slots: int                           # KV-cache slots free
    num_slots: int                            # KV-cache slots in all (max_num_seqs)
    kv_cache_usage: float                     # fraction of KV blocks in use, 0..1 (of slots without paging)
    slot_usage: float                         # fraction of slots in use, 0..1
    steps: int                                # engine steps so far
    preemptions: int                          # requests requeued so far to free KV blocks
    kv_blocks: Optional[int] = None           # paged cache: blocks in all; None without paging
    free_kv_blocks: Optional[int] = None      # paged cache: blocks free
    kv_block_size: Optional[int] = None       # paged cache: target positions per block
    kv_cache_bytes: int = 0                   # the KV cache's memory, bytes
    kv_cache_bytes_used: int = 0              # bytes of the blocks in use
    max_waiting: int = 0                      # the waiting queue's bound (EngineConfig.max_waiting)
    policy: str = ""                          # EngineConfig.policy
    state: str = ""                           # "new", "running", "stopping" or "stopped"

    def as_dict(self) -> dict:
        """Plain numbers and strings, for metrics and JSON; the paged-cache fields only with paging."""
        d = dataclasses.asdict(self)
        return {k: v for k, v in d.items() if v is not None}


@dataclass
class TranslationResult:
    hypotheses: list[Hypothesis]              # n_best, best first
    timings: RequestStats
