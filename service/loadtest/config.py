"""What a load run asks for: the run's bounds and target (LoadConfig), the request mix (Mix), the
source sentences, and the requests drawn from them (RequestMaker -> RequestSpec)."""
from __future__ import annotations

import gzip
import ipaddress
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_SENTENCES = Path(__file__).resolve().parents[2] / "model" / "data" / "multi30k" / "test_2016_flickr.de.gz"
REJECTED_STATUSES = (429, 503)   # load shedding: counted apart from failures
KEEPS_UP = 0.95                  # a run keeps up when achieved_rate >= KEEPS_UP * offered_rate


@dataclass(frozen=True)
class Mix:
    """A discrete distribution over ints, written ``"VALUE[:WEIGHT],..."`` (weights are relative).

    ``Mix.parse("1:3,4:1")`` draws 1 three times as often as 4. Raises ValueError on bad syntax,
    values below 1 or weights that are not positive.
    """
    values: tuple[int, ...]
    weights: tuple[float, ...]

    @classmethod
    def parse(cls, text: str, name: str = "mix") -> "Mix":
        values, weights = [], []
        for part in str(text).split(","):
            value, _, weight = part.strip().partition(":")
            try:
                v, w = int(value), float(weight) if weight else 1.0
            except ValueError:
                raise ValueError(f"{name}: expected VALUE[:WEIGHT],... got {text!r}") from None
            if v < 1 or not (w > 0 and math.isfinite(w)):
                raise ValueError(f"{name}: values must be >= 1 and weights > 0, got {part.strip()!r}")
            values.append(v)
            weights.append(w)
        return cls(tuple(values), tuple(weights))

    def sample(self, rng: random.Random) -> int:
        return self.values[0] if len(self.values) == 1 else rng.choices(self.values, self.weights)[0]

    def __str__(self) -> str:
        return ",".join(f"{v}:{w:g}" for v, w in zip(self.values, self.weights))


@dataclass
class LoadConfig:
    """One load run. Exactly one of concurrency (closed loop) or rate (open loop); at least one of
    requests or duration bounds it."""
    url: str = DEFAULT_URL                 # service base URL; only this host is ever contacted
    path: str = "/v1/translate"            # endpoint that receives the requests
    concurrency: Optional[int] = None      # closed loop: simulated users, one request in flight each
    rate: Optional[float] = None           # open loop: mean Poisson arrival rate, requests/s
    requests: Optional[int] = None         # stop issuing after this many requests
    duration: Optional[float] = None       # stop issuing after this many seconds
    sentences: str = str(DEFAULT_SENTENCES)  # source sentences, one per line, plain or .gz
    texts: str = "1"                       # Mix of texts per request ("1:3,4:1")
    beam_size: str = "4"                   # Mix of beam sizes (the API's default is 4)
    attention: float = 0.0                 # fraction of requests with return_attention
    stream: bool = False                   # Server-Sent Events; measures time to first token
    max_new_tokens: Optional[int] = None   # sent when set; the service's default otherwise
    source_lang: str = "de"
    target_lang: str = "en"
    model: Optional[str] = None            # "model" field of the request, when set
    timeout: float = 60.0                  # total seconds per request, streaming included
    max_inflight: int = 1024               # open loop: arrivals beyond this many in flight are dropped (reported)
    warmup: int = 0                        # requests sent one by one before the run, not counted
    seed: int = 0                          # seeds arrivals, sentences and the mix
    allow_remote: bool = False             # permit a URL that is not a loopback address

    def validate(self) -> None:
        """Raises ValueError naming the field when the run would be unbounded or ill-formed."""
        if (self.concurrency is None) == (self.rate is None):
            raise ValueError("give exactly one of concurrency (closed loop) or rate (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.requests is None and self.duration is None:
            raise ValueError("a run needs a bound: requests and/or duration")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.duration is not None and not (self.duration > 0 and math.isfinite(self.duration)):
            raise ValueError(f"duration must be > 0 s, got {self.duration}")
        if not 0.0 <= self.attention <= 1.0:
            raise ValueError(f"attention must be a fraction in [0, 1], got {self.attention}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 s, got {self.timeout}")
        if self.max_inflight < 1 or self.warmup < 0:
            raise ValueError("max_inflight must be >= 1 and warmup >= 0")
        Mix.parse(self.texts, "texts")
        Mix.parse(self.beam_size, "beam_size")
        check_url(self.url, self.allow_remote)

    @property
    def loop(self) -> str:
        return "closed" if self.concurrency is not None else "open"


def check_url(url: str, allow_remote: bool = False) -> None:
    """Raises ValueError unless url is http(s) on a loopback host (or allow_remote is set)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"url must be http(s)://HOST[:PORT], got {url!r}")
    if allow_remote:
        return
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise ValueError(f"refusing to load {host}: not a loopback address (pass --allow-remote to load it)")


def load_sentences(path: str | os.PathLike) -> list[str]:
    """Non-empty lines of a UTF-8 text file, plain or gzipped (by the .gz suffix).

    Raises FileNotFoundError, or ValueError when the file holds no non-empty line."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = [line.strip() for line in f if line.strip()]
    if not lines:
        raise ValueError(f"{path}: no sentences")
    return lines


@dataclass
class RequestSpec:
    """What one request asks for."""
    texts: list[str]           # 1 or more source sentences
    beam_size: int
    return_attention: bool
    stream: bool

    def body(self, cfg: LoadConfig) -> dict[str, Any]:
        """The JSON body for POST /v1/translate."""
        body: dict[str, Any] = {
            "text": self.texts[0] if len(self.texts) == 1 else self.texts,
            "source_lang": cfg.source_lang, "target_lang": cfg.target_lang,
            "beam_size": self.beam_size, "return_attention": self.return_attention, "stream": self.stream,
        }
        if cfg.max_new_tokens is not None:
            body["max_new_tokens"] = cfg.max_new_tokens
        if cfg.model is not None:
            body["model"] = cfg.model
        return body


class RequestMaker:
    """Draws requests from the sentences and the configured mix, reproducibly from the seed."""

    def __init__(self, cfg: LoadConfig, sentences: Sequence[str], rng: random.Random):
        self.cfg, self.sentences, self.rng = cfg, list(sentences), rng
        self.texts, self.beams = Mix.parse(cfg.texts, "texts"), Mix.parse(cfg.beam_size, "beam_size")

    def __call__(self) -> RequestSpec:
        n = self.texts.sample(self.rng)
        return RequestSpec(texts=[self.rng.choice(self.sentences) for _ in range(n)],
                           beam_size=self.beams.sample(self.rng),
                           return_attention=self.rng.random() < self.cfg.attention, stream=self.cfg.stream)
