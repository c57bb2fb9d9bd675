"""The inference engine: continuous batching with separate prefill and decode scheduling.

One asyncio task per engine runs the step loop; the model runs in one worker thread, so the event
loop keeps accepting, streaming and cancelling requests while a step computes:

    while not stopping:
        apply cancellations                  # scheduler.finish + runner.release, between steps only
        plan = scheduler.schedule()          # which waiting requests to prefill; all running decode
        result = await worker(runner.execute(plan))
                                             # prefill the admitted, ONE decode_step over every
                                             # running hypothesis (greedy and beam), searches advance
        update(plan, result)                 # stream tokens, resolve futures, free finished slots

Invariant (between steps): every KV-cache slot (and block) is free or held by exactly one running request, whose
search state lives in the runner; every request is waiting, running or resolved (exactly one), and
its future is resolved exactly once. Only the loop task mutates the scheduler and only the worker
thread runs the model, never at the same time. A request's output does not depend on what shares its
steps (each hypothesis attends only to its own slot), so it equals offline ``model.inference.generate.generate``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable, Optional, Sequence

import torch

from model.inference.beam import Hypothesis

from .config import EngineConfig, resolve_dtype
from .errors import EngineError, EngineStoppedError, EngineValidationError
from .process import check_fixed, torch_threads
from .records import (EngineStats, GenerationOptions, RequestStats, ScheduledRequest, SequenceOutput, StepResult,
                      StepStats, TranslationResult)
from .runner import ModelRunner
from .streams import TokenStream, _Request
from .scheduler import Scheduler
from .validation import resolve_options

log = logging.getLogger(__name__)


Callback = Optional[Callable[[object], None]]


class Engine:
    """Continuous-batching translation engine around one model (see the module docstring).

    Args:
        model: a ``model.transformer.Transformer`` (eval mode; any device/dtype).
        config: ``EngineConfig`` (slots, token budget, queue bound, policy).
        on_step: called with a ``StepStats`` after every step (on the event loop; keep it cheap).
        on_finish: called with a ``RequestStats`` when a request ends (ok, cancelled or error).
    """

    def __init__(self, model, config: Optional[EngineConfig] = None, on_step: Callback = None,
                 on_finish: Callback = None):
        self.model = model.eval()
        self.config = config or EngineConfig()
        self.on_step, self.on_finish = on_step, on_finish
        self.num_threads = torch.get_num_threads()  # what the worker thread runs with
        self._build(self.config)
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self._cancel_ids: set[int] = set()
        self._state = "new"                    # new -> running -> stopping -> stopped
        self._task: Optional[asyncio.Task] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._wakeup: Optional[asyncio.Event] = None
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending_config: Optional[tuple[EngineConfig, asyncio.Future]] = None

    def _build(self, config: EngineConfig) -> None:
        cfg = self.model.cfg
        self.max_src_len = min(config.max_src_len or cfg.max_len, cfg.max_len)
        self.max_tgt_len = min(config.max_tgt_len or cfg.max_len, cfg.max_len)
        if not hasattr(self, "loaded_dtype"):  # "auto" off CUDA keeps the dtype the model came in
            self.loaded_dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        device = next(self.model.parameters()).device
        self.dtype = resolve_dtype(config.dtype, device.type, self.loaded_dtype)   # float16 on CPU: an error
        with torch_threads(1):  # allocation only: keep the calling thread's OpenMP team small (see torch_threads)
            self.runner = ModelRunner(self.model, config.max_num_seqs, max_src_len=self.max_src_len,
                                      max_tgt_len=self.max_tgt_len, num_blocks=config.kv_blocks,
                                      block_size=config.kv_block_size, dtype=getattr(torch, self.dtype),
                                      cuda_graphs=config.cuda_graphs, cpu_kernels=config.cpu_kernels,
                                      fused_step=config.fused_step)
        if getattr(self, "scheduler", None) is None:
            self.scheduler = Scheduler(config, self.runner.cache.slots)
        else:
            self.scheduler.config, self.scheduler.slots = config, self.runner.cache.slots
        self.config = config

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the step loop on the running event loop (idempotent)."""
        if self._state == "new":
            self._start_now()
        elif self._state != "running":
            raise EngineStoppedError("engine is stopped")

    def _start_now(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-runner",
                                            initializer=torch.set_num_threads, initargs=(self.num_threads,))
        self._state = "running"
        self._task = self._loop.create_task(self._run(), name="engine-step-loop")

    async def stop(self) -> None:
        """Finish the current step, fail every outstanding request with EngineStoppedError, release
        the worker thread. Idempotent."""
        if self._state == "new":
            self._state = "stopped"
        if self._state != "running":
            return
        self._state = "stopping"
        self._wakeup.set()
        try:
            await self._task
        finally:
            for req in list(self._requests.values()):
                self._finish(req, error=EngineStoppedError("engine stopped"))
            if self._pending_config is not None and not self._pending_config[1].done():
                self._pending_config[1].set_exception(EngineStoppedError("engine stopped"))
            self._executor.shutdown(wait=True)
            self._state = "stopped"

    async def reconfigure(self, config: EngineConfig) -> None:
        """Apply a new EngineConfig (e.g. from Ray Serve ``user_config``). Policy and queue knobs
        apply at the next step; a new cache shape (max_num_seqs, max_src_len, max_tgt_len) is applied
        once running requests have finished (admission pauses until then). Waiting requests whose
        beam no longer fits fail with EngineValidationError; so does a new dtype, linear_dtype,
        cpu_kernels or fused_step (they need a new engine)."""
        if not isinstance(config, EngineConfig):
            config = EngineConfig.from_dict(config)
        device = next(self.model.parameters()).device
        if resolve_dtype(config.dtype, device.type, self.loaded_dtype) != self.dtype:  # a cast back up would not restore the weights
            raise EngineValidationError("dtype", f"the engine runs in {self.dtype}; a new dtype needs a new engine "
                                                 "(restart the replica)")
        check_fixed(config, self.config)   # the model and the runner are built with them
        shape = ("max_num_seqs", "max_src_len", "max_tgt_len", "kv_blocks", "kv_block_size", "cuda_graphs")
        if all(getattr(config, k) == getattr(self.config, k) for k in shape):
            self.config = self.scheduler.config = config
            return
        if self._state != "running":
            self._build(config)
            self._fail_unfit()
            return
        fut = self._loop.create_future()
        if self._pending_config is not None and not self._pending_config[1].done():
            self._pending_config[1].set_result(None)  # superseded by this one
        self._pending_config = (config, fut)
        self.scheduler.admitting = False
        self._wakeup.set()
        await fut

    def _fail_unfit(self) -> None:
        sched = self.scheduler
        for sreq in list(sched.waiting):
            if sreq.num_slots > self.config.max_num_seqs:
                self._finish(self._requests[sreq.request_id], error=EngineValidationError(
                    "beam_size", f"needs {sreq.num_slots} cache slots, the engine now has {self.config.max_num_seqs}"))
            elif sched.max_blocks(sreq) > sched.slots.num_blocks:
                self._finish(self._requests[sreq.request_id], error=EngineValidationError(
                    "beam_size", f"needs up to {sched.max_blocks(sreq)} KV-cache blocks, the engine now has "
                                 f"{sched.slots.num_blocks} (kv_blocks)"))

    # ---- requests ------------------------------------------------------------------------------
    def validate(self, src_ids: Sequence[int], options: Optional[GenerationOptions] = None) -> GenerationOptions:
        """The options as the engine would run them (``validation.resolve_options``: max_new_tokens
        resolved). Raises EngineValidationError(field, message) if the request can never be served."""
        return self._resolve(src_ids, options)

    async def translate(self, src_ids: Sequence[int], options: Optional[GenerationOptions] = None,
                        group: Optional[Hashable] = None) -> TranslationResult:
        """Translate one sentence (source ids, EOS included). ``group``: any hashable the sentences of
        one caller's request share (fifo admission takes turns between groups, ``scheduler.py``).
        Raises EngineValidationError, QueueFullError (at once, when max_waiting requests wait),
        EngineStoppedError, or EngineError if the request failed while running. Cancelling the
        awaiting task cancels the request; its slots are freed at the next step."""
        req = self._submit(src_ids, options, stream=False, group=group)
        return await req.future

    def stream(self, src_ids: Sequence[int], options: Optional[GenerationOptions] = None,
               group: Optional[Hashable] = None) -> TokenStream:
        """Submit a request and return an async iterator of its token ids, then the TranslationResult
        (``group`` as in ``translate``).

        Validation, QueueFullError and EngineStoppedError are raised here, before any iteration.
        """
        return TokenStream(self, self._submit(src_ids, options, stream=True, group=group))

    def stats(self) -> EngineStats:
        """A snapshot of the queues, slots and KV cache, with the settings that bound them."""
        cache = self.runner.cache
        used = cache.bytes_per_block * (cache.slots.num_blocks - cache.slots.num_free_blocks)
        return dataclasses.replace(self.scheduler.stats(), kv_cache_bytes=cache.nbytes, kv_cache_bytes_used=used,
                                   max_waiting=self.config.max_waiting, policy=self.config.policy, state=self._state)

    def _resolve(self, src_ids, options) -> GenerationOptions:
        opts = resolve_options(src_ids, options, self.model.cfg, self.config, self.max_src_len, self.max_tgt_len)
        sched = self.scheduler
        positions = len(opts.target_prefix) + opts.max_new_tokens
        need = sched.max_blocks(ScheduledRequest(0, len(src_ids), opts.beam_size, max_new_tokens=positions))
        if sched.paged and need > sched.slots.num_blocks:
            raise EngineValidationError("beam_size", f"beam_size {opts.beam_size} with {len(src_ids)} source tokens "
                                                     f"and {positions} target positions needs up to {need} "
                                                     f"KV-cache blocks, the engine has {sched.slots.num_blocks} (kv_blocks)")
        return opts

    def _submit(self, src_ids, options, stream: bool, group: Optional[Hashable] = None) -> _Request:
        if self._state == "new":
            self._start_now()
        if self._state != "running" or self._task.done():
            raise EngineStoppedError("engine is stopped")
        opts = self._resolve(src_ids, options)
        rid = next(self._ids)
        req = _Request(rid, [int(t) for t in src_ids], opts, self._loop.create_future(), stream,
                       asyncio.Queue() if stream else None, time.perf_counter())
        req.future.add_done_callback(lambda f, r=req: self._on_future_done(f, r))
        if opts.max_new_tokens == 0:  # nothing to generate after the prefix: the prefix is the answer, no model
            kw = {} if opts.attention_kinds else None
            self._finish(req, hypotheses=[Hypothesis(list(opts.target_prefix), 0.0, 0.0, "length", kw)])
            return req
        self.scheduler.add(ScheduledRequest(rid, len(req.src_ids), opts.beam_size, tuple(req.src_ids), opts, stream,
                                            max_new_tokens=len(opts.target_prefix) + opts.max_new_tokens,
                                            group=group))
        self._requests[rid] = req
        self._wakeup.set()
        return req

    def _on_future_done(self, fut: asyncio.Future, req: _Request) -> None:
        if fut.cancelled():
            self._cancel(req)
        elif req.stream:
            fut.exception()  # consumed through the stream; mark retrieved

    def _cancel(self, req: _Request) -> None:
        if req.done or req.cancelled:
            return
        req.cancelled = True
        self._cancel_ids.add(req.request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def _cancel_threadsafe(self, req: _Request) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            if asyncio.get_running_loop() is loop:
                self._cancel(req)
                return
        except RuntimeError:
            pass
        loop.call_soon_threadsafe(self._cancel, req)

    # ---- the step loop -------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        while True:
            plan = None
            try:
                await asyncio.sleep(0)  # let pending callbacks (cancellations, submissions) run first
                # From here to the wait below nothing yields, so no wakeup can be lost.
                if self._state != "running":
                    break
                self._apply_cancellations()
                if self._pending_config is not None and sched.num_running == 0:
                    self._apply_config()
                if not sched.num_running and not (sched.num_waiting and sched.admitting):
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                t0 = time.perf_counter()
                plan = sched.schedule()
                if plan.is_empty:  # nothing admissible (paused for a reconfiguration)
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                for r in plan.prefill:
                    self._requests[r.request_id].t_prefill_start = t0
                try:
                    result = await loop.run_in_executor(self._executor, self.runner.execute, plan)
                except Exception as e:  # noqa: BLE001 - a runner bug: fail this step's requests, keep serving
                    log.exception("engine step %d failed", plan.step)
                    result = StepResult([SequenceOutput(r.request_id, error=e) for r in plan.prefill + plan.decode])
                self._update(plan, result, t0)
            except Exception as e:  # noqa: BLE001 - never let the loop die; fail what this step touched
                log.exception("engine loop error")
                for r in (plan.prefill + plan.decode) if plan is not None else ():
                    req = self._requests.get(r.request_id)
                    if req is not None and not req.done:
                        self._finish(req, error=EngineError(f"engine step failed: {e!r}"))
                await asyncio.sleep(0.01)

    def _apply_cancellations(self) -> None:
        while self._cancel_ids:
            req = self._requests.get(self._cancel_ids.pop())
            if req is not None and not req.done:
                self._finish(req, cancelled=True)

    def _apply_config(self) -> None:
        config, fut = self._pending_config
        self._pending_config = None
        try:
            self._build(config)
            self._fail_unfit()
        except Exception as e:  # noqa: BLE001
            if not fut.done():
                fut.set_exception(e)
        else:
            if not fut.done():
                fut.set_result(None)
        finally:
            self.scheduler.admitting = True

    def _update(self, plan, result: StepResult, t0: float) -> None:
        now = time.perf_counter()
        prefilled = {r.request_id for r in plan.prefill}
        for r in plan.prefill + plan.decode:
            req = self._requests.get(r.request_id)
            if req is None:
                continue
            req.num_steps += 1
            if r.request_id in prefilled:
                req.prefill_s, req.t_first_token = result.prefill_s, now
        finished = 0
        for o in result.outputs:
            req = self._requests.get(o.request_id)
            if req is None or req.done or req.cancelled:
                continue
            if o.new_tokens and req.queue is not None:
                for t in o.new_tokens:
                    req.queue.put_nowait(t)
            if o.error is not None:
                finished += 1
                err = o.error if isinstance(o.error, EngineError) else EngineError(f"translation failed: {o.error!r}")
                if err is not o.error:
                    err.__cause__ = o.error
                log.warning("request %d failed: %r", o.request_id, o.error)
                self._finish(req, error=err)
            elif o.hypotheses is not None:
                finished += 1
                self._finish(req, hypotheses=o.hypotheses)
        if self.on_step is not None:
            s = self.scheduler
            stats = StepStats(step=plan.step, num_prefill_requests=len(plan.prefill),
                              num_prefill_tokens=plan.num_prefill_tokens,
                              num_prefill_padded_tokens=plan.num_prefill_padded, num_decode_requests=len(plan.decode),
                              num_decode_seqs=result.num_decode_seqs, num_scored_rows=result.num_decode_seqs,
                              num_finished=finished, prefill_s=result.prefill_s, decode_s=result.decode_s,
                              update_s=result.update_s, duration_s=time.perf_counter() - t0,
                              running_requests=s.num_running, running_sequences=s.num_running_seqs,
                              waiting_requests=s.num_waiting, kv_cache_usage=s.usage,
                              num_preempted=len(plan.preempted))
            self._callback(self.on_step, stats)

    def _finish(self, req: _Request, hypotheses: Optional[list[Hypothesis]] = None,
                error: Optional[BaseException] = None, cancelled: bool = False) -> None:
        """Resolve a request exactly once and give back its slots."""
        if req.done:
            return
        req.done = True
        self.scheduler.finish(req.request_id)
        self.runner.release(req.request_id)
        self._requests.pop(req.request_id, None)
        now = time.perf_counter()
        status = "cancelled" if cancelled else "error" if error is not None else "ok"
        st = RequestStats(req.request_id, status, status, len(req.src_ids), req.options.beam_size,
                          num_steps=req.num_steps, total_s=now - req.t_submit)
        if math.isnan(req.t_prefill_start):
            st.queue_wait_s = st.total_s if status != "ok" else 0.0
        else:
            st.queue_wait_s = req.t_prefill_start - req.t_submit
            st.prefill_s = req.prefill_s
            st.time_to_first_token_s = req.t_first_token - req.t_submit
            st.decode_s = now - req.t_first_token
        if hypotheses:
            best = hypotheses[0]
            st.finish_reason = best.finish_reason
            st.generated_tokens = len(best.tokens) + (best.finish_reason == "eos")
        if status == "ok":
            res = TranslationResult(hypotheses, st)
            if req.queue is not None:
                req.queue.put_nowait(res)
            if not req.future.done():
                req.future.set_result(res)
        elif status == "error":
            if req.queue is not None:
                req.queue.put_nowait(error)
            if not req.future.done():
                req.future.set_exception(error)
        else:
            if req.queue is not None:
                req.queue.put_nowait(EngineError("request cancelled"))
            if not req.future.done():
                req.future.cancel()
        if self.on_finish is not None:
            self._callback(self.on_finish, st)

    @staticmethod
    def _callback(fn, arg) -> None:
        try:
            fn(arg)
        except Exception:  # noqa: BLE001 - a metrics hook must not break serving
            log.exception("engine callback %r failed", fn)
