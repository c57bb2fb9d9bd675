"""``service.bench.families`` on tiny shapes: the random models are written in the published layouts,
imported by our importer and converted by CTranslate2's; both systems generate exactly ``--tokens``
tokens per sentence (NLLB's forced target token first); the table carries ratios, memory and the
share of equal outputs; the profile splits the engine's time into its parts."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("ctranslate2")
pytest.importorskip("transformers")

from service.bench.families import NLLB_LANGS, PartTimer, build, main, sources  # noqa: E402
from service.bench.same_weights import rss_mb, run_rounds  # noqa: E402


@pytest.mark.parametrize("shape, beams", [("nllb-tiny", [1, 2]), ("madlad-tiny", [2])])
def test_both_systems_generate_exactly_the_fixed_tokens(shape, beams, tmp_path):
    info = build(shape, tmp_path)
    srcs = sources(info, 5)
    first, n = info["pieces"]
    assert len(srcs) == 5 and all(first <= i < first + n for s in srcs for i in s[1:-1])
    assert all(s[0] == info["source_start"][0] and s[-1] == info["eos"] for s in srcs)
    hf_tok = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    if shape.startswith("nllb"):
        added = {t["content"]: t["id"] for t in hf_tok["added_tokens"]}
        assert info["prefix"] == [added["fra_Latn"]] and info["source_start"] == [added[NLLB_LANGS[0]]]
    else:
        from safetensors.torch import load_file
        assert info["prefix"] == []
        w = load_file(str(tmp_path / "hf" / "model.safetensors"))     # one embedding matrix, an lm_head of its own
        assert all(torch.equal(w[k], w["shared.weight"]) for k in w if k.endswith("embed_tokens.weight"))
        assert not torch.equal(w["lm_head.weight"], w["shared.weight"])
    common = {"checkpoint": str(tmp_path / "ckpt"), "ct2": str(tmp_path / "ct2"), "slots": 16, "eos": info["eos"],
              "pad": info["pad"], "max_len": 64, "tokens": 6, "prefix": info["prefix"]}
    rounds = run_rounds(common, srcs, ["engine int8", "CTranslate2 int8"], ["1x1"], beams, 1)
    assert sorted(rounds) == sorted((s, "1x1", b) for s in ("engine int8", "CTranslate2 int8") for b in beams)
    for (system, _, beam), (run,) in rounds.items():
        assert run.tokens == 5 * 6, system
        assert [len(o) for o in run.outputs] == [6] * 5, system
        assert all(o[: len(info["prefix"])] == info["prefix"] for o in run.outputs), system
        assert info["eos"] not in [t for o in run.outputs for t in o], system
        assert all(m > 0 for m in run.profile["rss_mb"]), system


def test_table_json_has_ratios_memory_and_agreement(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["--shape", "nllb-tiny", "--dir", str(tmp_path / "m"), "--rounds", "1", "--beams", "1",
                 "--layouts", "1x1", "--limit", "4", "--tokens", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["system"] for r in rows] == ["engine int8", "CTranslate2 int8"]
    assert [r["generated_tokens"] for r in rows] == [16, 16]
    assert rows[1]["ratio_to_CTranslate2_int8"] == 1.0
    assert rows[0]["ratio_to_CTranslate2_int8"] == round(rows[0]["tokens_per_s"] / rows[1]["tokens_per_s"], 3)
    assert 0.0 <= rows[0]["same_as_CTranslate2"] <= 1.0 and rows[1]["same_as_CTranslate2"] is None
    assert all(r["loaded_mib"] > 0 for r in rows)
    assert "loaded MiB" in capsys.readouterr().out


def test_rss_grows_by_what_is_allocated():
    before = rss_mb()
    x = torch.ones(64 * 2**20 // 4)            # 64 MiB, touched
    assert rss_mb() - before >= 60
    del x


def test_profile_splits_the_engine_time(tmp_path, capsys):
    assert main(["--shape", "nllb-tiny", "--dir", str(tmp_path), "--profile", "--beams", "2", "--limit", "4",
                 "--tokens", "5", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    for part in ("output projection", "log-softmax + top-k", "beam ranking", "decoder layers", "prefill"):
        assert part in out
    line = next(x for x in out.splitlines() if x.strip().startswith("output projection"))
    assert "ms/call" in line, out


def test_part_timer_restores_what_it_wrapped():
    import types
    mod = types.SimpleNamespace(f=lambda x: x + 1)
    inner = mod.f
    timer = PartTimer()
    timer.wrap(mod, "f", "f")
    assert mod.f(1) == 2 and mod.f(2) == 3
    assert timer.calls == {"f": 2} and timer.seconds["f"] >= 0
    timer.close()
    assert mod.f is inner


def test_bad_arguments_are_one_line(capsys):
    for argv, word in ((["--shape", "nllb-tiny", "--systems", "transformers"], "--systems"),
                       (["--shape", "nllb-tiny", "--beams", "x"], "--beams"),
                       (["--shape", "nllb-tiny", "--tokens", "1"], "--tokens")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and word in capsys.readouterr().err
