"""The continuous-batching engine: one step loop over a scheduler (which requests to prefill, no
torch) and a model runner (prefill, one shared decode step, every search advanced).

    config.py      EngineConfig: slots, KV blocks, token budget, queue bound, policy
    records.py     the plain records the parts hand each other
    scheduler.py   waiting/running queues, KV-block accounting, preemption, the admission policy (no torch)
    runner.py      executes a SchedulerOutput on the model and its KV cache
    engine.py      the asyncio step loop, futures, cancellation
    streams.py     a request inside the engine and its TokenStream
    validation.py  the engine's own guard on request options
    process.py     process and thread settings for serving
"""
from .config import POLICIES, EngineConfig
from .engine import Engine, TokenStream
from .errors import EngineError, EngineStoppedError, EngineValidationError, QueueFullError
from .process import torch_threads, tune_process
from .records import EngineStats, GenerationOptions, RequestStats, StepStats, TranslationResult

__all__ = ["Engine", "EngineConfig", "EngineStats", "GenerationOptions", "TranslationResult", "StepStats", "RequestStats",
           "TokenStream", "EngineError", "QueueFullError", "EngineValidationError", "EngineStoppedError",
           "POLICIES", "torch_threads", "tune_process"]
