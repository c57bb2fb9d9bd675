"""StreamState (service/translator/streaming.py): per-sentence token ids, arriving out of order,
become in-order text deltas per text, with the shipped tokenizer; no model, no engine."""
from __future__ import annotations

import asyncio

import pytest

from service.translator.streaming import StreamState, merge_streams
from service.translator.text import Piece, Split


# text 0: two sentences with whitespace around; text 1: no visible text; text 2: one sentence with an
# emoji (byte-fallback pieces) and trailing whitespace.
SPLITS = [Split(["s1", "s2"], ["  ", " ", "\n"]), None, Split(["s3"], ["", " "])]
TARGETS = ["A dog runs.", "Two cats sleep in the sun.", "A dog 🐶 runs."]


def pieces(tok) -> tuple[list[Piece], list[list[int]]]:
    ps = [Piece(0, 0, [5, 3]), Piece(0, 1, [6, 3]), Piece(2, 0, [7, 3])]
    return ps, [tok.encode(t) for t in TARGETS]


def final_texts(tok, targets) -> dict[int, str]:
    return {0: SPLITS[0].join([tok.decode(targets[0]), tok.decode(targets[1])]),
            2: SPLITS[2].join([tok.decode(targets[2])])}


def run(state: StreamState, schedule: list[tuple[int, int]], targets: list[list[int]]) -> list:
    """Feed (piece, how many more tokens; 0 = finish) steps; return every event."""
    fed = state.fed = getattr(state, "fed", [0] * len(targets))     # tokens fed so far, per piece
    events = []
    for k, n in schedule:
        if n == 0:
            events += state.finish(k, targets[k])
        else:
            for t in targets[k][fed[k]:fed[k] + n]:
                events += state.token(k, t)
            fed[k] += n
    return events


def check_events(tok, events, targets) -> None:
    want = final_texts(tok, targets)
    got: dict[int, str] = {}
    for ev in events:
        got[ev.index] = got.get(ev.index, "") + ev.text
        assert want[ev.index].startswith(got[ev.index]), (ev, got[ev.index])   # order kept, nothing twice
        assert "\ufffd" not in ev.text                                         # no half characters
    assert got == want                                                         # all of it, once
    for i in want:   # the whitespace after the last sentence comes last, alone
        assert [ev.text for ev in events if ev.index == i][-1] == SPLITS[i].glue[-1]
    # the whitespace before a sentence goes out with its first token, never alone (text 2's emoji
    # follows a lone "▁" piece, a whitespace-only token of its own)
    deltas = [ev.text for ev in events if ev.index == 0]
    assert all(d.strip() for d in deltas[:-1]), deltas
    assert 1 not in {ev.index for ev in events}


def test_out_of_order_sentences_stream_in_order(tok):
    ps, targets = pieces(tok)
    state = StreamState(tok, SPLITS, ps)
    # sentence 2 of text 0 runs ahead and finishes first; text 2 streams meanwhile; sentence 1 last
    schedule = [(1, 3), (2, 2), (0, 1), (1, 100), (1, 0), (2, 3), (0, 100), (2, 100), (0, 0), (2, 0)]
    events = run(state, schedule, targets)
    check_events(tok, events, targets)
    first_of_text0 = next(ev for ev in events if ev.index == 0)
    assert first_of_text0.text.startswith("  A") and first_of_text0.token == tok.pieces(targets[0][:1])[0]


def test_a_sentence_that_waits_catches_up_when_its_turn_comes(tok):
    ps, targets = pieces(tok)
    state = StreamState(tok, SPLITS, ps)
    assert run(state, [(1, 4)], targets) == []              # held back: sentence 1 is not done
    events = run(state, [(0, 100), (0, 0)], targets)
    text = "".join(ev.text for ev in events)
    assert text == "  " + tok.decode(targets[0]) + " " + tok.decode(targets[1][:4])   # glue once, caught up


def test_incomplete_multibyte_pieces_are_held_back(tok):
    ps, targets = pieces(tok)
    emoji = targets[2]
    pieces_ = tok.pieces(emoji)
    first, last = pieces_.index("<0xF0>"), pieces_.index("<0xB6>")
    state = StreamState(tok, SPLITS, ps)
    events = run(state, [(2, first)], targets)
    for _ in range(first, last):     # the first three bytes of the emoji: nothing to show yet
        assert run(state, [(2, 1)], targets) == []
    [ev] = run(state, [(2, 1)], targets)
    assert ev.text == "🐶" and ev.token == "<0xB6>"
    events += [ev] + run(state, [(2, 100), (2, 0), (0, 100), (0, 0), (1, 100), (1, 0)], targets)
    check_events(tok, events, targets)


def test_beam_results_arrive_only_at_the_end(tok):
    ps, targets = pieces(tok)
    state = StreamState(tok, SPLITS, ps)
    events = run(state, [(2, 0), (1, 0), (0, 0)], targets)      # no token events before finish
    check_events(tok, events, targets)
    assert all(ev.token is None for ev in events)


def test_merge_streams_tags_items_and_raises_the_first_error():
    class Stream:
        def __init__(self, items):
            self.items, self.cancelled = list(items), False

        def __aiter__(self):
            return self

        async def __anext__(self):
            await asyncio.sleep(0)
            if not self.items:
                raise StopAsyncIteration
            item = self.items.pop(0)
            if isinstance(item, Exception):
                raise item
            return item

        def cancel(self):
            self.cancelled = True

    async def collect(streams):
        return [x async for x in merge_streams(streams)]

    out = asyncio.run(collect([Stream([1, 2, "done-a"]), Stream([7, "done-b"])]))
    assert sorted(out, key=str) == sorted([(0, 1), (0, 2), (0, "done-a"), (1, 7), (1, "done-b")], key=str)
    assert [x for x in out if x[0] == 0] == [(0, 1), (0, 2), (0, "done-a")]
    streams = [Stream([1, ValueError("boom")]), Stream([5, 6, 7, 8, "done"])]
    with pytest.raises(ValueError, match="boom"):
        asyncio.run(collect(streams))
    assert all(s.cancelled for s in streams)
