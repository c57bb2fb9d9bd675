"""Translate text with a checkpoint: a library function and ``python -m model.translate``.

    python -m model.translate --checkpoint DIR [--beam-size N] < input.de > output.en

One output line per input line; empty (or whitespace-only) lines stay empty. Input is read and
translated in chunks of 1,024 lines, and each chunk's output is written before the next is read, so
output starts before a long pipe has been read to its end.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from typing import Sequence

import torch

from .decoding import generate
from .tokenizer import Tokenizer
from .transformer import Transformer


def encode_source(tok: Tokenizer, text: str, max_len: int) -> list[int]:
    """Piece ids of text plus EOS, truncated to max_len ids in all."""
    ids = tok.encode(text)[: max_len - 1]
    return ids + [tok.eos_id]


def default_max_new_tokens(src_len: int, max_len: int) -> int:
    """A generous target budget for a source of src_len ids: 2·src_len + 10, capped by the model."""
    return min(max_len - 1, 2 * src_len + 10)


def translate_lines(model: Transformer, tok: Tokenizer, lines: Sequence[str], beam_size: int = 1,
                    batch_size: int = 64, length_penalty: float = 1.0, progress=None) -> list[str]:
    """Translate lines in length-sorted batches; returns one string per line, in order."""
    cfg = model.cfg
    out = [""] * len(lines)
    todo = [i for i, line in enumerate(lines) if line.strip()]
    encoded = {i: encode_source(tok, lines[i], cfg.max_len) for i in todo}
    todo.sort(key=lambda i: len(encoded[i]))
    for start in range(0, len(todo), batch_size):
        idx = todo[start: start + batch_size]
        srcs = [encoded[i] for i in idx]
        max_new = [default_max_new_tokens(len(s), cfg.max_len) for s in srcs]
        hyps = generate(model, srcs, beam_size=beam_size, max_new_tokens=max_new, length_penalty=length_penalty)
        for i, h in zip(idx, hyps):
            out[i] = tok.decode(h[0].tokens)
        if progress is not None:
            progress(len(idx))
    return out


def load_for_cli(ap: argparse.ArgumentParser, args: argparse.Namespace):
    """The checks ``model.translate`` and ``model.evaluate`` share (MT_LINEAR_DTYPE, --beam-size),
    then ``load_checkpoint(args.checkpoint)``; errors exit through ``ap.error``.
    Returns (model, tokenizer, metadata)."""
    from .checkpoint import load_checkpoint
    from .linear import default_dtype
    try:
        default_dtype()
    except ValueError as e:
        ap.error(str(e))
    if args.beam_size < 1:
        ap.error("--beam-size must be >= 1")
    try:
        return load_checkpoint(args.checkpoint)
    except (FileNotFoundError, ValueError) as e:
        ap.error(f"--checkpoint {args.checkpoint}: {e}")


def main(argv=None) -> None:
    from .checkpoint import DEFAULT_CHECKPOINT
    ap = argparse.ArgumentParser(prog="python -m model.translate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", default=str(DEFAULT_CHECKPOINT), help="checkpoint directory")
    ap.add_argument("--beam-size", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--length-penalty", type=float, default=1.0)
    args = ap.parse_args(argv)
    model, tok, _ = load_for_cli(ap, args)
    chunk = 1024
    lines = (line.rstrip("\n") for line in sys.stdin)
    while batch := list(itertools.islice(lines, chunk)):
        for line in translate_lines(model, tok, batch, args.beam_size, args.batch_size, args.length_penalty):
            sys.stdout.write(line + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
