"""Fold sampled Python stacks (py-spy's ``--format raw``) into the stages of the request path.

A raw line is ``frame;frame;...;frame COUNT``, root first, each frame ``function (path:line)``.
A stack's stage is that of the frame nearest its leaf that names one (``RULES``, first match per
frame): a millisecond spent in ``re`` or ``asyncio`` called by the splitter is the splitter's.
Frames of the event loop, threads and small stdlib helpers (``GENERIC``) name a stage only when no
other frame does. A stack under a response-encoding function (``ENCODING_FUNCS``) is encoding
wherever its leaf is (FastAPI serializes its answer with pydantic, which would otherwise read as
validation).
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Iterable, Optional

ROOT = str(Path(__file__).resolve().parents[2])

PARSING = "body parsing and validation"
ENCODING = "response encoding"
# (module path prefix, function name or None, stage), checked in order for each frame
RULES: list[tuple[str, Optional[str], str]] = [
    ("service/api/middleware/body.py", None, PARSING),
    ("service/api/schemas.py", None, PARSING),
    ("service/api/libre_schemas.py", None, PARSING),
    ("pydantic/", None, PARSING), ("pydantic_core/", None, PARSING),
    ("fastapi/dependencies/", None, PARSING), ("starlette/requests.py", None, PARSING),
    ("json/decoder.py", None, PARSING), ("json/__init__.py", "loads", PARSING),
    ("json/encoder.py", None, ENCODING), ("json/__init__.py", "dumps", ENCODING),
    ("orjson", None, ENCODING), ("starlette/responses.py", None, ENCODING),
    ("fastapi/encoders.py", None, ENCODING),
    ("logging/", None, "logging"),
    ("prometheus_client/", None, "metrics"), ("service/metrics.py", None, "metrics"),
    ("ray/util/metrics.py", None, "metrics"),
    ("service/api/middleware/", None, "middleware"), ("starlette/middleware/", None, "middleware"),
    ("fastapi/middleware/", None, "middleware"),
    ("service/api/", None, "routes and API glue (service/api)"),
    ("starlette/", None, "framework routing (starlette, fastapi)"),
    ("fastapi/", None, "framework routing (starlette, fastapi)"),
    ("uvicorn/", None, "ASGI server (uvicorn, h11, httptools)"),
    ("h11/", None, "ASGI server (uvicorn, h11, httptools)"),
    ("httptools/", None, "ASGI server (uvicorn, h11, httptools)"),
    ("service/translator/text.py", None, "text: sentence splitting"),
    ("service/translator/protect.py", None, "text: protected spans"),
    ("service/translator/spans.py", None, "text: protected spans"),
    ("service/translator/placement.py", None, "text: protected spans"),
    ("service/translator/truecase.py", None, "text: casing"),
    ("service/translator/memory.py", None, "text: memory lookup"),
    ("service/translator/fuzzy.py", None, "text: memory lookup"),
    ("service/translator/langid.py", None, "language detection"),
    ("service/pipeline/autodetect.py", None, "language detection"),
    ("model/tokenizer.py", None, "tokenizing (SentencePiece)"), ("sentencepiece/", None, "tokenizing (SentencePiece)"),
    ("service/translator/", None, "translator: sources, options, assembly"),
    ("service/pipeline/", None, "pipeline (service/pipeline)"),
    ("service/engine/runner.py", None, "engine: model step"), ("model/", None, "engine: model step"),
    ("torch/", None, "engine: model step"),
    ("service/engine/", None, "engine: step loop, scheduler"),
    ("ray/serve/", None, "Ray Serve"),
    ("ray/", None, "Ray core, gRPC"), ("grpc/", None, "Ray core, gRPC"), ("google/protobuf", None, "Ray core, gRPC"),
]
GENERIC = ("asyncio/", "uvloop/", "anyio/", "concurrent/", "threading.py", "selectors.py", "contextlib.py",
           "contextvars", "functools.py", "typing.py", "weakref.py", "queue.py", "socket.py", "ssl.py")
EVENT_LOOP = "event loop, threads"
WAITING = "waiting"
# leaves where a thread waits in C (uvloop's loop, a pool's queue, Ray's task loop, a lock): py-spy
# takes a thread in state R for active, and on a loaded machine a woken thread waits there for a CPU
WAIT_LEAVES = {("Thread.run", "threading.py"), ("_worker", "concurrent/futures/thread.py"),
               ("Worker.main_loop", "ray/_private/worker.py"), ("Condition.wait", "threading.py"),
               ("Event.wait", "threading.py"), ("select", "selectors.py")}
# with --native, a wait is a C call among the last frames (libc's own may show as bare addresses)
_NATIVE_WAIT = re.compile(r"^(epoll_wait|epoll_pwait|__?poll|poll|select|pthread_cond_(timed)?wait|futex_wait|"
                          r"__futex_abstimed_wait|nanosleep|clock_nanosleep|sem_(timed)?wait|"
                          r"PyThread_acquire_lock|take_gil)")
OTHER = "other"
ENCODING_FUNCS = {"serialize_response", "jsonable_encoder", "render"}

_FRAME = re.compile(r"^(?P<func>.*) \((?P<path>[^()]*?)(?::\d+)?\)$")


def module_path(path: str) -> str:
    """``/repo/service/api/x.py`` -> ``service/api/x.py``; ``.../site-packages/h11/_c.py`` ->
    ``h11/_c.py``; ``/usr/lib/python3.11/json/encoder.py`` -> ``json/encoder.py``."""
    path = path.replace("\\", "/")
    if path.startswith(ROOT + "/"):
        return path[len(ROOT) + 1:]
    for marker in ("site-packages/", "dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    m = re.search(r"/lib/python3\.\d+/(.*)$", path)
    if m:
        return m.group(1)
    for top in ("/service/", "/model/"):   # another checkout of this project (a worktree)
        if top in path:
            return top[1:] + path.rsplit(top, 1)[1]
    return path


def parse_frame(frame: str) -> tuple[str, str]:
    """``render (/x/starlette/responses.py:42)`` -> (``render``, ``starlette/responses.py``)."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip(), ""
    return m.group("func"), module_path(m.group("path"))


def frame_stage(func: str, mod: str) -> Optional[str]:
    for prefix, name, stage in RULES:
        if mod.startswith(prefix) and (name is None or func == name):
            return stage
    return None


def stack_stage(frames: list[tuple[str, str]]) -> str:
    """The stage of one stack (root first)."""
    if frames and (frames[-1] in WAIT_LEAVES or any(_NATIVE_WAIT.search(f) for f, _ in frames[-3:])):
        return WAITING
    for func, mod in frames:
        if func in ENCODING_FUNCS and (mod.startswith(("fastapi/", "starlette/")) or func != "render"):
            return ENCODING
    for func, mod in reversed(frames):
        stage = frame_stage(func, mod)
        if stage:
            return stage
    if any(mod.startswith(GENERIC) for _, mod in frames):
        return EVENT_LOOP
    return OTHER


_THREAD = re.compile(r"^thread \((?:0x)?(\d+)\)")


def fold_threads(lines: Iterable[str]) -> dict[int, Counter]:
    """Samples per stage per thread of py-spy raw lines (``--threads``: a first frame
    ``thread (TID): name``, TID the OS thread id; 0 for lines without one)."""
    out: dict[int, Counter] = {}
    for line in lines:
        line = line.rstrip("\n")
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        m = _THREAD.match(parts[0])
        tid = int(m.group(1)) if m else 0
        frames = [parse_frame(f) for f in parts if f and not f.startswith(("thread (", "process "))]
        out.setdefault(tid, Counter())[stack_stage(frames)] += int(count)
    return out


def fold(lines: Iterable[str]) -> Counter:
    """Samples per stage of py-spy raw lines, all threads together."""
    out: Counter = Counter()
    for counts in fold_threads(lines).values():
        out.update(counts)
    return out


NATIVE = "native threads (no Python frame: Ray core, gRPC, OpenMP)"


def weigh(samples: dict[int, Counter], cpu_s: dict[int, float]) -> dict[str, float]:
    """CPU seconds per stage: each thread's CPU time (``cpu_s``, from /proc) shared among the stages
    of its samples but ``WAITING`` ones (all of it to ``EVENT_LOOP`` when it has only those); a thread
    that used CPU but was never sampled (no Python frame) goes to ``NATIVE``. py-spy's idle test
    misses waits (a thread parked in C), so its sample counts alone would overstate them: the
    thread's real CPU time bounds what its samples get."""
    out: dict[str, float] = {}
    for tid, seconds in cpu_s.items():
        counts = samples.get(tid)
        if not counts or not sum(counts.values()):
            out[NATIVE] = out.get(NATIVE, 0.0) + seconds
            continue
        counts = Counter({k: v for k, v in counts.items() if k != WAITING}) or Counter({EVENT_LOOP: 1})
        total = sum(counts.values())
        for stage, n in counts.items():
            out[stage] = out.get(stage, 0.0) + seconds * n / total
    return out
