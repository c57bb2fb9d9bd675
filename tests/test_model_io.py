"""Checkpoints, the translate / evaluate command lines and the shipped model's quality."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch

from model.checkpoint import DEFAULT_CHECKPOINT, save_checkpoint
from model.load import load_model
from model.config import ModelConfig
from model.inference.generate import generate
from model.tokenizer import Tokenizer, read_lines
from model.tokenizer import encode_source
from model.inference.generate import translate_lines
from model.transformer import Transformer

ROOT = Path(__file__).resolve().parent.parent
# The command lines run as new processes with one OpenMP thread, as the tests in this process run
# (conftest's one_torch_thread): on a busy 2-core machine two threads made each run ~2.5 times slower.
CLI_ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
DATA = ROOT / "model" / "data" / "multi30k"
# Greedy BLEU of the shipped model on the first 100 val sentences was measured at MEASURED_VAL100
# (see the checkpoint's metadata.json); the test floor is that minus 3, never below 25.
MEASURED_VAL100 = 39.99


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ckpt")
    lines = read_lines(DATA / "val.de.gz")[:400] + read_lines(DATA / "val.en.gz")[:400]
    tok = Tokenizer.train(lines, d / "spm", vocab_size=600)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_name("tiny", vocab_size=tok.vocab_size))
    save_checkpoint(d / "ckpt", model, d / "spm.model", {"source_lang": "de", "target_lang": "en"}, dtype="float32")
    return d / "ckpt"


def test_checkpoint_round_trip(tiny_checkpoint, tmp_path):
    model, tok, meta = load_model(tiny_checkpoint)
    assert meta["source_lang"] == "de" and model.cfg.vocab_size == tok.vocab_size
    src = [encode_source(tok, "Ein Mann fährt Fahrrad.", model.cfg.max_len)]
    before = generate(model, src, beam_size=2, max_new_tokens=10)[0][0]
    save_checkpoint(tmp_path / "copy", model, tok.model_file, meta, dtype="float32")
    model2, _, meta2 = load_model(tmp_path / "copy")
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    after = generate(model2, src, beam_size=2, max_new_tokens=10)[0][0]
    assert before.tokens == after.tokens and before.log_prob == after.log_prob
    # fp16 storage: weights are upcast to fp32 at load and differ by at most fp16 rounding
    save_checkpoint(tmp_path / "half", model, tok.model_file, meta, dtype="float16")
    model3, _, _ = load_model(tmp_path / "half")
    p = next(model3.parameters())
    assert p.dtype == torch.float32
    torch.testing.assert_close(model3.state_dict()["decoder.0.ffn.w1.weight"],
                               model.state_dict()["decoder.0.ffn.w1.weight"], atol=1e-3, rtol=1e-3)


def test_checkpoint_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_translate_cli_keeps_empty_lines(tiny_checkpoint, monkeypatch, capsys):
    """``model.translate``'s main() in this process (stdin and stdout as the command line has them; the
    command itself runs in a new process in test_translate_cli_writes_each_chunk_before_reading_the_next)."""
    from model import translate
    text = "Ein Hund rennt.\n\n   \nZwei Kinder spielen im Park.\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    capsys.readouterr()
    translate.main(["--checkpoint", str(tiny_checkpoint), "--beam-size", "2"])
    lines = capsys.readouterr().out.split("\n")
    assert len(lines) == 5 and lines[4] == ""  # 4 output lines plus the final newline
    assert lines[1] == "" and lines[2] == ""
    model, tok, _ = load_model(tiny_checkpoint)
    assert lines[0] == translate_lines(model, tok, ["Ein Hund rennt."], beam_size=2)[0]


def test_translate_cli_writes_each_chunk_before_reading_the_next(tiny_checkpoint):
    """The first 1,024 lines are translated and written while stdin is still open."""
    import queue
    import threading
    proc = subprocess.Popen([sys.executable, "-m", "model.translate", "--checkpoint", str(tiny_checkpoint),
                             "--beam-size", "1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=ROOT, env=CLI_ENV)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    try:
        proc.stdin.write("Ein Hund rennt.\n" + "\n" * 1023)   # one chunk; empty lines stay empty
        proc.stdin.flush()
        first = [lines.get(timeout=120) for _ in range(1024)]   # stdin still open
        assert first[0].strip() and all(x == "\n" for x in first[1:])
        proc.stdin.write("Zwei Kinder spielen.\n")
        proc.stdin.close()
        assert lines.get(timeout=120).strip() and proc.wait(timeout=120) == 0
    finally:
        proc.kill()


def cli_exit(main, argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of a command line's main(argv) run in this process that exits through
    argparse's error (an uncaught exception, a traceback on the command line, fails the test)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err


def test_cli_rejects_an_unknown_linear_dtype(tiny_checkpoint, monkeypatch, capsys):
    """MT_LINEAR_DTYPE as a new process reads it (the settings read once from the environment)."""
    from model import evaluate, translate
    from model.inference import settings
    monkeypatch.setenv("MT_LINEAR_DTYPE", "int4")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    for main, extra in ((translate.main, []), (evaluate.main, ["--src", "a.de", "--ref", "a.en"])):
        monkeypatch.setattr(settings, "_current", None)
        code, err = cli_exit(main, ["--checkpoint", str(tiny_checkpoint), *extra], capsys)
        assert code == 2 and "MT_LINEAR_DTYPE must be float32, bfloat16 or int8, got 'int4'" in err, err
        assert "Traceback" not in err


@pytest.mark.parametrize("extra, words", [
    (["--batch-size", "0"], "--batch-size: must be an integer >= 1, got 0"),
    (["--limit", "-5"], "--limit: must be 0 (all) or a number of sentences, got -5"),
    (["--length-penalty", "nan"], "--length-penalty: must be a finite number, got nan"),
    (["--src", "/no/such/file"], "/no/such/file: No such file or directory"),
])
def test_evaluate_cli_bad_arguments_are_one_line(tiny_checkpoint, tmp_path, capsys, extra, words):
    """``model.evaluate``'s main() in this process (the command itself runs in a new process in
    test_evaluate_cli_json, marked slow)."""
    from model import evaluate
    src = tmp_path / "a.de"
    src.write_text("Ein Hund.\n")
    args = ["--src", str(src), "--ref", str(src), *extra]
    code, err = cli_exit(evaluate.main, ["--checkpoint", str(tiny_checkpoint), *args], capsys)
    assert code == 2 and words in err and "Traceback" not in err, err[-1500:]


def evaluation_files(tmp_path) -> list[str]:
    """--src and --ref of five val sentences."""
    src, ref = tmp_path / "src.de", tmp_path / "ref.en"
    src.write_text("\n".join(read_lines(DATA / "val.de.gz")[:5]) + "\n")
    ref.write_text("\n".join(read_lines(DATA / "val.en.gz")[:5]) + "\n")
    return ["--src", str(src), "--ref", str(ref)]


def assert_evaluation_json(stdout: str) -> None:
    result = json.loads(stdout.strip().splitlines()[-1])
    assert result["sentences"] == 5 and {"bleu", "chrf", "seconds"} <= set(result)
    assert 0.0 <= result["bleu"] <= 100.0


# slow (make test runs it, the quick loop does not): a new Python process that imports torch, ~2.5 s of
# CPU; the quick loop runs main() in this process (below) and ``python -m model.translate`` as a new
# process (test_translate_cli_writes_each_chunk_before_reading_the_next)
@pytest.mark.slow
def test_evaluate_cli_json(tiny_checkpoint, tmp_path):
    out = subprocess.run([sys.executable, "-m", "model.evaluate", "--checkpoint", str(tiny_checkpoint),
                          *evaluation_files(tmp_path), "--beam-size", "1", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, env=CLI_ENV)
    assert out.returncode == 0, out.stderr
    assert_evaluation_json(out.stdout)


def test_evaluate_main_json(tiny_checkpoint, tmp_path, capsys):
    """``model.evaluate``'s main() in this process: the last stdout line is the JSON object."""
    from model import evaluate
    capsys.readouterr()
    evaluate.main(["--checkpoint", str(tiny_checkpoint), *evaluation_files(tmp_path), "--beam-size", "1", "--json"])
    assert_evaluation_json(capsys.readouterr().out)


@pytest.mark.skipif(not (DEFAULT_CHECKPOINT / "model.safetensors").exists(), reason="no shipped checkpoint yet")
def test_shipped_model_translates_val_sentences():
    model, tok, meta = load_model()
    assert (meta["source_lang"], meta["target_lang"]) == ("de", "en")
    src = read_lines(DATA / "val.de.gz")[:100]
    ref = read_lines(DATA / "val.en.gz")[:100]
    hyps = translate_lines(model, tok, src, beam_size=1)
    bleu = sacrebleu.corpus_bleu(hyps, [ref]).score
    floor = max(25.0, MEASURED_VAL100 - 3.0)
    assert bleu >= floor, f"BLEU {bleu:.1f} below floor {floor:.1f}"


def test_shipped_en_de_model_translates_val_sentences_and_is_served_by_default():
    from model.checkpoint import SHIPPED_CHECKPOINTS
    from service.app import AppArgs
    model, tok, meta = load_model(SHIPPED_CHECKPOINTS["en-de"])
    assert (meta["source_lang"], meta["target_lang"]) == ("en", "de")
    src = read_lines(DATA / "val.en.gz")[:100]
    ref = read_lines(DATA / "val.de.gz")[:100]
    hyps = translate_lines(model, tok, src, beam_size=1)
    bleu = sacrebleu.corpus_bleu(hyps, [ref]).score
    assert bleu >= max(25.0, meta["val"]["bleu_greedy"] - 5.0), f"BLEU {bleu:.1f}"
    served = [(m.name, m.checkpoint) for m in AppArgs().models]      # de-en first, then every folder by name
    assert served[0] == ("de-en", str(DEFAULT_CHECKPOINT)) and ("en-de", str(SHIPPED_CHECKPOINTS["en-de"])) in served
    assert served[1:] == sorted((d.name, str(d)) for d in DEFAULT_CHECKPOINT.parent.iterdir()
                                if d.name != "de-en" and (d / "model.safetensors").exists())
    assert Path(SHIPPED_CHECKPOINTS["en-de"], "model.safetensors").stat().st_size <= 25 * 1024 ** 2
