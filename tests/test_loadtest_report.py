"""service/loadtest/markdown.py and cli.py: the report's section of docs/performance.md (no service)."""
from __future__ import annotations

import re

from conftest import ROOT
from service.loadtest import (DOCS_PERFORMANCE, SECTION_END, SECTION_MARKER, build_report_parser, report_markdown,
                              update_section)


def test_update_section_replaces_only_its_section(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text(f"# T\n\n<!-- section: api (service) -->\napi text\n\n{SECTION_MARKER}\n\n<!-- section: x -->\nx\n")
    update_section(doc, "## Performance\nfirst\n")
    update_section(doc, "## Performance\nsecond\n")
    text = doc.read_text()
    assert text == (f"# T\n\n<!-- section: api (service) -->\napi text\n\n{SECTION_MARKER}\n## Performance\nsecond\n"
                    f"{SECTION_END}\n\n<!-- section: x -->\nx\n")


def test_the_report_writes_docs_performance_by_default():
    assert DOCS_PERFORMANCE == ROOT / "docs" / "performance.md"
    assert build_report_parser().parse_args([]).docs == str(DOCS_PERFORMANCE)
    assert build_report_parser().parse_args(["--readme", "X.md"]).docs == "X.md"   # the former flag
    assert build_report_parser().parse_args(["--no-docs"]).docs is None
    text = DOCS_PERFORMANCE.read_text()
    assert text.count(SECTION_MARKER) == 1 and text.count(SECTION_END) == 1
    assert text.index(SECTION_MARKER) < text.index(SECTION_END)


def test_markdown_carries_the_date_and_commands_not_commit_hashes(tmp_path):
    machine = {"cpus": 2, "cuda": False, "load_average_at_start": [0.5, 0.4, 0.3], "date": "2026-01-02 03:04 UTC",
               "checkpoint": str(tmp_path / "ckpt"), "model": {"d_model": 256, "n_heads": 8}}
    cmd = "python -m service.loadtest --url $URL -c 1 -d 10 --beam-size 1 --warmup 2 --timeout 30 --seed 1"
    data = {"machine": machine, "elapsed_s": 90.0, "skipped": [], "shortened": [],
            "service": {"num_cpus_per_replica": 0.8, "torch_threads_per_replica": 1},
            "commands": {"attention/off_1": cmd}}
    command = "python -m service.loadtest report --scale 0.3"
    text = report_markdown(data, tmp_path, tmp_path, command)
    assert "2026-01-02 03:04 UTC" in text and f"```bash\n{command}\n```" in text and cmd in text
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)   # no commit hash
    assert not re.search(r"\bcommit\b", text, re.IGNORECASE)
