"""Model runner: owns the model, the paged KV cache and the batch tensors, and executes what
the scheduler decided for one step, KV blocks included: it applies the block-table changes the
scheduler hands it (``SchedulerOutput.blocks``) and writes only there, never allocating.

All model math and search are ``model/``'s, the functions offline ``generate`` uses
(``encode_into_cache`` in ``model/inference/prefill.py``, ``decode_step`` in ``model/inference/step.py``,
which chooses the step's variant, ``search_step`` in ``model/inference/search.py``), so serving and
offline decoding share one implementation; the runner hands them its engine's compute switches.
One step = (1) prefill of the newly admitted requests: encoder pass and cross-attention K/V for
every decoder layer (in a few length-sorted groups when that saves padding); (2) ONE
``decode_step`` over every running hypothesis of every running request, greedy and beam alike, each
at its own position, plus the first (BOS) step of the requests just prefilled, which completes their
prefill: the first step rides in the shared forward instead of paying a small forward of its own;
(3) ``search_step``: one top-k over all rows, each request's ``BeamSearch.step`` and one batched
cache reorder for all beams; then the step's outputs (finished, failed, streamed tokens).

Runs in the engine's single worker thread; nothing here touches asyncio.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from model.inference import prefill, settings, step
from model.inference.beam import BeamSearch
from model.inference.constraints import ConstrainedBeamSearch
from model.inference.cuda_graphs import DecodeGraphs
from model.inference.generate import length_groups, pad_batch
from model.inference.logits import RepetitionControls
from model.inference.paged_cache import PagedKVCache
from model.inference.search import ActiveSearch, decode_inputs, search_step
from model.inference.step import StepOutput

from .records import ScheduledRequest, SchedulerOutput, SequenceOutput, StepResult


@dataclass(eq=False, kw_only=True)
class _Sequence(ActiveSearch):
    """Runner-side state of one running request: its search in flight, plus what the engine needs."""
    request_id: int
    src_ids: list[int]                       # source ids, EOS included
    stream: bool = False                     # report tokens as they become final
    emitted: int = 0                         # tokens already reported (streaming)


_Part = tuple[StepOutput, list[_Sequence]]   # one decode forward and the sequences whose rows it holds


class ModelRunner:
    """Executes ``SchedulerOutput``s on a model with a ``PagedKVCache`` (``num_blocks`` blocks of
    ``block_size`` positions; default ``model.inference.paged_cache.default_num_blocks``). ``dtype``: the model is
    cast to it (in place) first; ``cuda_graphs``: on CUDA, replay decode steps from CUDA graphs;
    ``cpu_kernels`` / ``fused_step``: the engine's compute switches (``EngineConfig``), handed to every
    prefill, decode step and search step (the model was packed with the same ``cpu_kernels``). The cache's ``BlockPool`` (``cache.slots``) is for the scheduler: the runner never touches it.

    Each ``ScheduledRequest`` carries its ``src_ids`` (EOS-terminated) and ``options``
    (``GenerationOptions``, already validated by the engine, max_new_tokens resolved).
    """

    def __init__(self, model, num_slots: int, max_src_len: Optional[int] = None, max_tgt_len: Optional[int] = None,
                 num_blocks: Optional[int] = None, block_size: int = 16, dtype: Optional[torch.dtype] = None,
                 cuda_graphs: bool = True, cpu_kernels: Optional[bool] = None, fused_step: Optional[bool] = None):
        self.device = next(model.parameters()).device
        if dtype is not None and next(model.parameters()).dtype != dtype:
            model.to(dtype)   # in place: weights and buffers; the KV cache below follows the weights' dtype
        self.model = model.eval()
        self.cfg = model.cfg
        # A paged cache: K/V in the blocks the scheduler assigns; beam reorders move slot ids, not K/V.
        self.cache = PagedKVCache.for_model(model, num_slots, max_tgt_len=max_tgt_len, max_src_len=max_src_len,
                                            num_blocks=num_blocks, block_size=block_size, cpu_kernels=cpu_kernels)
        self.cache.kernel_ok()  # build/load the compiled decode attention now, not at the first request
        self.fused_step: bool = settings.or_default("fused_step", fused_step)
        # On CUDA, decode steps replay captured graphs where they fit (model/inference/cuda_graphs.py).
        self.graphs = DecodeGraphs(model, self.cache, num_slots) if (
            cuda_graphs and self.device.type == "cuda") else None
        self.seqs: dict[int, _Sequence] = {}
        self._emitted: dict[int, int] = {}   # preempted streaming requests: tokens already reported
        # The fixed cost of one prefill call, in source tokens: prefill groups trade padding for calls.
        self.prefill_call_tokens = 96 if self.device.type == "cpu" else 1024

    # ---- bookkeeping ---------------------------------------------------------------------------
    def release(self, request_id: int) -> None:
        """Forget a request's search state (its slots are freed by the scheduler)."""
        self.seqs.pop(request_id, None)
        self._emitted.pop(request_id, None)

    def preempt(self, request_id: int) -> None:
        """Drop a preempted request's search state (the scheduler freed its slots and blocks); it is
        decoded again from its prefill, and tokens it already streamed are not reported twice."""
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self._emitted[request_id] = max(seq.emitted, self._emitted.get(request_id, 0))

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Apply the step's block-table changes (``plan.blocks``), prefill ``plan.prefill`` (encoder
        and cross K/V), then run ONE decode step over every hypothesis of ``plan.decode`` plus the
        first (BOS) step of the newly prefilled requests, then advance every search. A failure
        confined to one request fails only that request."""
        outputs: dict[int, SequenceOutput] = {}
        result = StepResult([])
        if plan.blocks:
            self.cache.assign_blocks(plan.blocks)
        for r in plan.preempted:
            self.preempt(r.request_id)
        t0 = time.perf_counter()
        new: list[_Sequence] = []
        if plan.prefill:
            # a packed encoder pass (compiled kernel) has no padding to save: one call for all
            lengths = [len(r.src_ids) for r in plan.prefill]
            groups = [list(range(len(lengths)))] if self.cache.kernel_ok() else length_groups(lengths, self.prefill_call_tokens)
            for group in groups:
                started = self._start([plan.prefill[i] for i in group], outputs)
                new += [s for done in self._isolated(self._encode, started, outputs) for s in done]
        t1 = time.perf_counter()
        decode = [self.seqs[r.request_id] for r in plan.decode if r.request_id in self.seqs] + new
        parts: list[_Part] = []
        if decode:
            decode.sort(key=lambda s: s.slots[0])  # ascending slots: often one contiguous block
            parts = self._isolated(self._decode, decode, outputs)
            result.num_decode_seqs = sum(out.num_rows for out, _ in parts)
        t2 = time.perf_counter()
        if parts:
            self._update(parts, outputs)
        result.prefill_s, result.decode_s, result.update_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        result.outputs = list(outputs.values())
        for o in result.outputs:
            if o.finished:
                self.seqs.pop(o.request_id, None)
        return result

    def _start(self, reqs: Sequence[ScheduledRequest], outputs: dict) -> list[_Sequence]:
        seqs = []
        for r in reqs:
            try:
                o = r.options
                kinds = tuple(o.attention_kinds)
                forced = len(o.target_prefix)        # max_new_tokens and min_new_tokens count after the prefix
                args = (o.beam_size, self.cfg.eos_id, forced + o.max_new_tokens, o.n_best, o.length_penalty, kinds,
                        len(r.src_ids))
                kw = dict(forced_eos=self.cfg.forced_eos, early_stopping=self.cfg.early_stopping)
                if o.constraints:                    # glossary terms
                    search = ConstrainedBeamSearch(*args, constraints=o.constraints, ends=o.sentence_ends,
                                                   prefix=tuple(o.target_prefix), free_prefix=o.free_prefix, **kw)
                else:
                    search = BeamSearch(*args, prefix=tuple(o.target_prefix), free_prefix=o.free_prefix, **kw)
                controls = RepetitionControls(o.repetition_penalty, o.no_repeat_ngram_size)
                seq = _Sequence(search, list(r.slots), [self.cfg.bos_id], min_new_tokens=forced + o.min_new_tokens,
                                controls=controls if controls.active else None,
                                request_id=r.request_id, src_ids=list(r.src_ids), stream=r.stream,
                                emitted=self._emitted.pop(r.request_id, 0))
                self.seqs[r.request_id] = seq
                seqs.append(seq)
            except Exception as e:  # noqa: BLE001 - a bad request fails alone
                outputs[r.request_id] = SequenceOutput(r.request_id, error=e)
        return seqs

    def _isolated(self, fn, seqs: list[_Sequence], outputs: dict) -> list:
        """[fn(seqs)] for the whole batch; if it raises, fn on each sequence alone, so that only the
        requests that fail by themselves are failed (their outputs carry the error)."""
        if not seqs:
            return []
        try:
            return [fn(seqs)]
        except Exception as e:  # noqa: BLE001
            if len(seqs) == 1:
                outputs[seqs[0].request_id] = SequenceOutput(seqs[0].request_id, error=e)
                return []
        parts = []
        for s in seqs:
            try:
                parts.append(fn([s]))
            except Exception as e:  # noqa: BLE001
                outputs[s.request_id] = SequenceOutput(s.request_id, error=e)
        return parts

    def _encode(self, seqs: list[_Sequence]) -> list[_Sequence]:
        """The encoder half of prefill for seqs: encoder pass and cross K/V into all of each one's
        slots. Their first decoder step (BOS) runs in this step's shared decode forward."""
        dev = self.device
        src = pad_batch([s.src_ids for s in seqs], self.cfg.pad_id, dev)
        lengths = torch.tensor([len(s.src_ids) for s in seqs], device=dev)
        need = any("encoder" in s.search.attention_kinds for s in seqs)
        enc_w = prefill.encode_into_cache(self.model, self.cache, [s.slots for s in seqs], src, lengths, need,
                                          fused_step=self.fused_step)
        for i, s in enumerate(seqs):
            s.search.keep_encoder_attention(enc_w, i)
        return seqs

    def _decode(self, seqs: list[_Sequence]) -> _Part:
        """One decode_step over every alive hypothesis of seqs (``decode_step`` chooses its variant)."""
        slots, tokens, positions = decode_inputs(seqs)
        dev = self.device
        slots_t, tokens_t, positions_t = (torch.tensor(x, device=dev) for x in (slots, tokens, positions))
        out = step.decode_step(self.model, self.cache, slots_t, tokens_t, positions_t,
                               need_weights=any(s.search.attention_kinds for s in seqs),
                               self_weights=any("decoder" in s.search.attention_kinds for s in seqs),
                               need_logits=any(s.controls is not None for s in seqs),   # repetition controls
                               fused_step=self.fused_step, graphs=self.graphs, max_target=max(positions) + 1,
                               max_source=max(len(s.src_ids) for s in seqs))
        return out, seqs

    def _update(self, parts: list[_Part], outputs: dict) -> None:
        """``search_step`` over all rows, then each request's output: its hypotheses when done, its
        error when its step failed, the tokens that became final when it streams."""
        update = search_step(self.cache, parts)
        for _, seqs in parts:
            for s in seqs:
                rid = s.request_id
                if s in update.failed:
                    outputs[rid] = SequenceOutput(rid, error=update.failed[s])
                elif s.search.done:
                    hyps = s.search.results()
                    new = list(hyps[0].tokens[s.emitted:]) if s.stream else []
                    outputs[rid] = SequenceOutput(rid, hypotheses=hyps, new_tokens=new)
                elif s.stream and s.search.beam_size == 1:  # greedy: its one prefix is final
                    new = list(s.search.alive[0].tokens[s.emitted:])
                    s.emitted += len(new)
                    outputs[rid] = SequenceOutput(rid, new_tokens=new)
