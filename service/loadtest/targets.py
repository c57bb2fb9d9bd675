"""Where a load run's requests go: the HTTP service (HttpTarget), or the continuous-batching
engine in this process (EngineTarget), the baseline for the cost of HTTP and Ray Serve."""
from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Optional, Protocol

import aiohttp

from .config import LoadConfig, RequestSpec, check_url


@dataclass
class Reply:
    """What a target observed for one request."""
    status: Optional[int]                  # HTTP status (200 for the in-process engine); None: no response
    error: Optional[str] = None            # None on success; else the status code or a failure kind
    generated_tokens: int = 0              # usage.generated_tokens of a successful response
    first_token_at: Optional[float] = None  # time.perf_counter() of the first streamed token
    response_bytes: int = 0                # size of the response body


class Target(Protocol):
    """What run_load sends requests to: one reply per request spec; aclose() ends its resources."""
    async def send(self, spec: RequestSpec) -> Reply: ...
    async def aclose(self) -> None: ...


class HttpTarget:
    """Sends requests to the service through one shared aiohttp session (a keep-alive pool of
    ``max_connections``).

    aiohttp, not httpx: the load generator shares the machine with the service it measures, so its
    own CPU per request counts against the figures. At 32 closed-loop users against a trivial local
    server, httpx's AsyncClient spent about 2.9 ms of CPU per request and topped out near 340
    requests/s, aiohttp about 0.12 ms (measured 2026-12-02 against the echo app of service/loadtest/echo.py).
    """

    def __init__(self, cfg: LoadConfig, max_connections: int):
        check_url(cfg.url, cfg.allow_remote)
        self.cfg = cfg
        self.max_connections = max_connections
        self.endpoint = cfg.url.rstrip("/") + "/" + cfg.path.lstrip("/")   # a base URL's own path is kept
        self._session: Optional[aiohttp.ClientSession] = None
        self._ids = 0

    @property
    def session(self) -> aiohttp.ClientSession:
        """Made on first use, inside the running event loop (aiohttp binds a session to its loop).
        trust_env=False (aiohttp's default): no proxy from the environment may redirect the load."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                trust_env=False, timeout=aiohttp.ClientTimeout(total=self.cfg.timeout),
                connector=aiohttp.TCPConnector(limit=self.max_connections))
        return self._session

    async def send(self, spec: RequestSpec) -> Reply:
        self._ids += 1
        headers = {"X-Request-ID": f"loadtest-{os.getpid()}-{self._ids}"}
        body = spec.body(self.cfg)
        async with self.session.post(self.endpoint, json=body, headers=headers) as r:
            if r.status == 200 and spec.stream:
                return await self._read_events(r, len(spec.texts))
            content = await r.read()   # read whole, so that the connection goes back to the pool
            if r.status != 200:
                return Reply(r.status, error=str(r.status))
            reply = self._parse_final(r.status, json.loads(content), len(spec.texts))
            reply.response_bytes = len(content)
            return reply

    async def _read_events(self, r: aiohttp.ClientResponse, n_texts: int) -> Reply:
        """Reads Server-Sent Events: token events, then one final event with the whole response."""
        first_token_at, event, final, nbytes = None, "message", None, 0
        async for raw in r.content:               # one line at a time, its line break included
            nbytes += len(raw)
            line = raw.decode("utf-8").rstrip("\r\n")
            if line.startswith("event:"):
                event = line[6:].strip()
            elif line.startswith("data:"):
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if event == "error" or (isinstance(payload, dict) and "error" in payload and "usage" not in payload):
                    return Reply(r.status, error="stream_error")
                if isinstance(payload, dict) and "usage" in payload:
                    final = payload
                elif first_token_at is None:
                    first_token_at = time.perf_counter()
            elif not line:
                event = "message"
        if final is None:
            return Reply(r.status, error="incomplete_stream")
        reply = self._parse_final(r.status, final, n_texts)
        reply.first_token_at = first_token_at or time.perf_counter()  # no token event: output was empty
        reply.response_bytes = nbytes
        return reply

    @staticmethod
    def _parse_final(status: int, data: Any, n_texts: int) -> Reply:
        try:
            if len(data["translations"]) != n_texts:
                return Reply(status, error="invalid_response")
            return Reply(status, generated_tokens=int(data["usage"]["generated_tokens"]))
        except (KeyError, TypeError, ValueError):
            return Reply(status, error="invalid_response")

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


class EngineTarget:
    """The continuous-batching engine in this process, without HTTP or Ray Serve: the baseline for
    their overhead. Sentences are encoded as the service does (model.translate.encode_source)."""

    def __init__(self, cfg: LoadConfig, checkpoint: str | os.PathLike, engine_config: Optional[dict] = None,
                 threads: Optional[int] = None):
        import torch
        from model.load import load_model
        from service.engine import Engine, EngineConfig
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.model, self.tok, _ = load_model(checkpoint)
        if torch.cuda.is_available():
            self.model = self.model.cuda()
        self.engine = Engine(self.model, EngineConfig.from_dict(engine_config))
        self._started = False

    async def _ensure_started(self) -> None:
        if not self._started:
            await self.engine.start()
            self._started = True

    def _options(self, spec: RequestSpec):
        from service.engine import GenerationOptions
        kwargs: dict[str, Any] = {"beam_size": spec.beam_size,
                                  "attention_kinds": ("cross",) if spec.return_attention else ()}
        if self.cfg.max_new_tokens is not None:
            kwargs["max_new_tokens"] = self.cfg.max_new_tokens
        return GenerationOptions(**kwargs)

    async def send(self, spec: RequestSpec) -> Reply:
        """Like the service: QueueFullError is a 503, EngineValidationError a 422, other EngineErrors a 500."""
        from service.engine import EngineError, EngineValidationError, QueueFullError
        try:
            return await self._send(spec)
        except QueueFullError:
            return Reply(503, error="503")
        except EngineValidationError:
            return Reply(422, error="422")
        except EngineError:
            return Reply(500, error="500")

    async def _send(self, spec: RequestSpec) -> Reply:
        from model.tokenizer import encode_source
        await self._ensure_started()
        options = self._options(spec)
        srcs = [encode_source(self.tok, text, self.model.cfg.max_len) for text in spec.texts]
        if not spec.stream:
            results = await asyncio.gather(*(self.engine.translate(s, options) for s in srcs))
            return Reply(200, generated_tokens=sum(len(r.hypotheses[0].tokens) for r in results))
        first: list[Optional[float]] = [None]

        async def one(src: list[int]) -> int:
            async for item in self.engine.stream(src, options):
                if isinstance(item, int):
                    first[0] = first[0] or time.perf_counter()
                else:
                    return len(item.hypotheses[0].tokens)
            return 0
        tokens = sum(await asyncio.gather(*(one(s) for s in srcs)))
        return Reply(200, generated_tokens=tokens, first_token_at=first[0] or time.perf_counter())

    async def aclose(self) -> None:
        if self._started:
            await self.engine.stop()
