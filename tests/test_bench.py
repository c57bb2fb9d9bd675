"""service/bench/: the engine benchmark's runs on a tiny random model (figures are not checked, only
that every sentence is counted and timed), and its command line."""
from __future__ import annotations

import asyncio

import pytest
import torch

from service.bench.engine import Run, median_run, poisson_arrivals, run_engine, run_static
from service.bench_engine import build_parser, main
from tiny_model import make_model, rand_source


@pytest.fixture(scope="module")
def model():
    return make_model(torch.float32)


SRCS = [rand_source(n, seed) for seed, n in enumerate((5, 9, 3, 12, 7, 4))]


def test_static_and_engine_runs_count_every_sentence(model):
    static = run_static(model, SRCS, beam=1, batch_size=4, max_new=5)
    assert (static.part, static.sentences, len(static.latencies)) == ("(b)", 6, 6)
    assert 6 <= static.tokens <= 6 * 6 and static.wall_s > 0
    # Length-sorted batches submitted at t=0: the first batch's sentences end no later than the rest.
    assert len(set(static.latencies)) == 2
    # Exactly fixed_len tokens each (EOS masked by min_new_tokens), beam 2, 8 slots (4 sentences at once).
    cont = asyncio.run(run_engine(model, SRCS, 2, num_seqs=8, fixed_len=5, warmup=False))
    assert (cont.part, cont.sentences, cont.tokens, len(cont.latencies)) == ("(c)", 6, 30, 6)
    p = cont.profile
    assert p["steps"] >= 5 and p["prefill_batches"] >= 2 and p["wall_s"] == cont.wall_s
    arrivals = poisson_arrivals(6, 200.0, seed=1)
    assert arrivals == sorted(arrivals) and arrivals == poisson_arrivals(6, 200.0, seed=1)
    timed = asyncio.run(run_engine(model, SRCS, 1, num_seqs=4, arrivals=arrivals, fixed_len=3, part="(d)"))
    assert (timed.part, timed.sentences, timed.tokens) == ("(d)", 6, 18)


def test_median_and_percentiles():
    runs = [Run("(b)", "s", 1, 10, tokens, 1.0, [0.1 * i for i in range(11)]) for tokens in (30, 10, 20)]
    assert median_run(runs).tokens == 20
    assert runs[0].pct(0.5) == pytest.approx(0.5) and runs[0].pct(0.99) == pytest.approx(1.0)
    assert runs[0].sentences_per_s == 10 and runs[0].tokens_per_s == 30


def test_cli_flags():
    args = build_parser().parse_args(["--parts", "b", "--rounds", "1", "--limit", "50"])
    assert (args.parts, args.rounds, args.limit, args.beams, args.threads) == ("b", 1, 50, "1,4", 2)
    with pytest.raises(SystemExit) as e:
        main(["--parts", "x"])
    assert e.value.code == 2


def test_same_weights_table_ratios_bleu_and_json(tmp_path, capsys):
    """Part (f)'s report: ratios to CTranslate2 of the same layout and beam, BLEU of each run's outputs,
    the JSON rows with the documented keys (runs made up here; the workers are exercised by the command)."""
    import json
    from service.bench.same_weights import report
    refs = ["a man rides a bike .", "two dogs play in the snow ."]
    words = sorted({w for r in refs for w in r.split()})
    exact = [[words.index(w) for w in r.split()] for r in refs]
    runs = [Run("(f)", system, beam, 2, tokens, wall, [], layout, outputs=outputs)
            for system, layout, beam, tokens, wall, outputs in [
                ("engine", "2x1", 1, 300, 1.0, exact),
                ("CTranslate2 float32", "2x1", 1, 200, 1.0, exact),
                ("CTranslate2 int8", "2x1", 1, 600, 2.0, exact[:1] + [exact[1][:3]]),
                ("engine", "1x2", 4, 100, 2.0, exact)]]
    out = tmp_path / "f.json"
    rows = report(runs, lambda ids: " ".join(words[i] for i in ids), refs, out)
    assert json.loads(out.read_text()) == rows
    assert {"system", "layout", "beam_size", "tokens_per_s", "sentences_per_s", "bleu"} <= set(rows[0])
    engine = rows[0]
    assert (engine["tokens_per_s"], engine["sentences_per_s"], engine["bleu"]) == (300.0, 2.0, 100.0)
    assert engine["ratio_to_CTranslate2_float32"] == 1.5 and engine["ratio_to_CTranslate2_int8"] == 1.0
    assert 0 < rows[2]["bleu"] < 100
    assert rows[3]["ratio_to_CTranslate2_float32"] is None          # no CTranslate2 run at beam 4
    printed = capsys.readouterr().out
    assert "1.50x" in printed and f"wrote {out}" in printed


def test_same_weights_round_ratios_pair_runs_of_one_round(capsys):
    """With every round's runs, each row also gets the median over rounds of the ratio within a round,
    which differs from the ratio of the medians when the machine drifts between rounds."""
    from service.bench.same_weights import report
    refs = ["a b", "c d"]
    out = [[0, 1], [2, 3]]

    def run(system, tokens):
        return Run("(f)", system, 1, 2, tokens, 1.0, [], "2x1", outputs=out)
    # engine / CT2 int8 per round: 110/100, 55/50, 300/400 -> 1.1, 1.1, 0.75; medians 110 / 100 -> 1.1
    rounds = {("engine", "2x1", 1): [run("engine", t) for t in (110, 55, 300)],
              ("CTranslate2 int8", "2x1", 1): [run("CTranslate2 int8", t) for t in (100, 50, 400)]}
    runs = [median_run(v) for v in rounds.values()]
    rows = report(runs, lambda ids: " ".join("abcd"[i] for i in ids), refs, None, rounds)
    assert rows[0]["ratio_to_CTranslate2_int8"] == 1.1 and rows[0]["round_ratio_to_CTranslate2_int8"] == 1.1
    rounds[("engine", "2x1", 1)][1] = run("engine", 45)          # round 2 now 0.9: median of 1.1, 0.9, 0.75
    rows = report([median_run(v) for v in rounds.values()], lambda ids: " ".join("abcd"[i] for i in ids), refs,
                  None, rounds)
    assert rows[0]["round_ratio_to_CTranslate2_int8"] == 0.9 and rows[0]["ratio_to_CTranslate2_int8"] == 1.1
    assert rows[0]["round_ratio_to_CTranslate2_float32"] is None and rows[1]["round_ratio_to_CTranslate2_int8"] == 1.0
    printed = capsys.readouterr().out
    assert "rounds/int8" in printed and "0.90x" in printed


def test_same_weights_unknown_system_is_refused(capsys):
    assert main(["--parts", "f", "--f-systems", "engine,bogus", "--limit", "4"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err or "need the shipped model" in err


@pytest.mark.parametrize("args, words", [
    (["--beams", "0"], "--beams: every value must be >= 1"),
    (["--parts", "e", "--layouts", "9x"], "--layouts PROCESSESxTHREADS"),
    (["--rounds", "0"], "--rounds: every value must be >= 1"),
    (["--parts", ","], "--parts must be a non-empty subset"),
    (["--device", "foo"], "--device foo: no such device here"),
    (["--tokens", "0"], "--tokens: every value must be >= 1"),
    (["--vocab-size", "32000"], "--vocab-size applies to part (f) with --preset"),
])
def test_bench_engine_bad_arguments_are_one_line(capsys, args, words):
    with pytest.raises(SystemExit) as e:
        main(["--parts", "a", *args] if "--parts" not in args else args)
    assert e.value.code == 2 and words in capsys.readouterr().err


def test_search_step_bench_gives_the_same_hypotheses_both_ways(capsys):
    """service.bench.search_step: the batched and the per-sentence step agree (exit 0) and both print."""
    from service.bench.search_step import main as search_main
    assert search_main(["--sentences", "9", "--beam", "3", "--vocab", "64"]) == 0
    out = capsys.readouterr().out
    assert "same hypotheses: True" in out and out.count("ms per step") == 2
    with pytest.raises(SystemExit):
        search_main(["--beam", "1"])


def test_head_of_line_bench_sends_a_request_the_api_takes():
    """service.bench.head_of_line: its large request passes the API's own validation at the limits
    (MAX_TEXTS texts, MAX_BEAM_SIZE beams), texts of consecutive sentences; too few sentences is an error."""
    from service.api.schemas import TranslateRequest
    from service.protocol import MAX_BEAM_SIZE, MAX_TEXTS
    from service.bench.head_of_line import build_parser, large_request
    from service.loadtest.config import DEFAULT_SENTENCES, load_sentences
    lines = load_sentences(DEFAULT_SENTENCES)
    args = build_parser().parse_args([])
    body = large_request(lines, args.texts, args.sentences_per_text, args.min_new_tokens, args.max_new_tokens)
    req = TranslateRequest(**body)
    assert len(req.text) == MAX_TEXTS and req.beam_size == MAX_BEAM_SIZE and req.min_new_tokens == 100
    assert body["text"][1] == " ".join(lines[4:8])
    with pytest.raises(ValueError, match="need 8 sentences"):
        large_request(lines[:7], 2, 4, 0, 10)


def test_random_checkpoint_with_a_synthetic_vocabulary_loads_and_encodes_as_the_tokenizer(tmp_path):
    from model.checkpoint import DEFAULT_CHECKPOINT
    from model.load import load_model
    from model.tokenizer import Tokenizer
    from service.bench.same_weights import random_checkpoint
    spm = DEFAULT_CHECKPOINT / "tokenizer.model"
    ckpt = random_checkpoint(tmp_path / "r", "tiny", spm, vocab_size=9000, seed=3)
    model, tok, _ = load_model(ckpt, pack=False)
    real = Tokenizer(spm)
    assert model.cfg.vocab_size == 9000 and tok.vocab_size == 9000
    assert model.src_embed.tok.weight.shape[0] == 9000
    line = "Ein Mann fährt mit dem Fahrrad."
    assert tok.encode(line) == real.encode(line)            # sources use the tokenizer's own pieces
    with pytest.raises(ValueError, match="already has"):
        random_checkpoint(tmp_path / "s", "tiny", spm, vocab_size=100)
