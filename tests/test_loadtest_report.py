"""service/loadtest/markdown.py, report.py's machine facts and cli.py's report parser (no service)."""
from __future__ import annotations

import re

from service.loadtest import build_report_parser, cpu_facts, report_markdown

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16

processor\t: 1
model name\t: another
flags\t\t: fpu
"""


def _data(tmp_path, **machine):
    machine = {"cpus": 2, "cuda": False, "load_average_at_start": [0.5, 0.4, 0.3], "date": "2026-01-02 03:04 UTC",
               "checkpoint": str(tmp_path / "ckpt"), "model": {"d_model": 256, "n_heads": 8}, **machine}
    cmd = "python -m service.loadtest --url $URL -c 1 -d 10 --beam-size 1 --warmup 2 --timeout 30 --seed 1"
    return cmd, {"machine": machine, "elapsed_s": 90.0, "skipped": [], "shortened": [],
                 "service": {"num_cpus_per_replica": 0.8, "torch_threads_per_replica": 1},
                 "commands": {"attention/off_1": cmd}}


def test_the_report_is_written_only_into_its_out_directory():
    args = build_report_parser().parse_args([])
    assert args.out == "deploy/performance"
    assert not hasattr(args, "docs")     # docs/performance.md links to the report; no tool rewrites it


def test_markdown_carries_the_date_and_commands_not_commit_hashes(tmp_path):
    cmd, data = _data(tmp_path)
    command = "python -m service.loadtest report --scale 0.3"
    text = report_markdown(data, command)
    assert text.startswith("# Load-test report\n")
    assert "2026-01-02 03:04 UTC" in text and f"```bash\n{command}\n```" in text and cmd in text
    assert not re.search(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b", text)   # no commit hash
    assert not re.search(r"\bcommit\b", text, re.IGNORECASE)


def test_markdown_names_the_cpu_and_links_plots_beside_it(tmp_path):
    _, data = _data(tmp_path, **cpu_facts(CPUINFO))
    point = {"achieved_rate": 9.5, "offered_rate": 10.0}
    data["batching_greedy"] = {"title": "continuous batching, greedy", "points": [point], "rates": [10.0],
                               "saturation": None, "plot": str(tmp_path / "out" / "sweep_batching_greedy.png")}
    text = report_markdown(data, "python -m service.loadtest report")
    assert "on 2 CPU cores (AMD EPYC 9R14; AVX-512 VNNI, AVX512-BF16, AVX2, FMA), no GPU" in text
    assert "](sweep_batching_greedy.png)" in text


def test_cpu_facts_reads_the_first_processor():
    assert cpu_facts(CPUINFO) == {"cpu_model": "AMD EPYC 9R14",
                                  "cpu_flags": ["AVX-512 VNNI", "AVX512-BF16", "AVX2", "FMA"]}
    assert cpu_facts("processor\t: 0\nflags\t: fpu sse2\n") == {"cpu_flags": []}
    assert cpu_facts("") == {"cpu_flags": []}
