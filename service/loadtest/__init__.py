"""The load generator and the performance report (``python -m service.loadtest``; flags in cli.py).

    config.py      LoadConfig (a run's target and bounds), the request Mix, sentences, RequestMaker
    targets.py     where requests go: HttpTarget (the service), EngineTarget (the engine alone)
    generator.py   the closed and open loops (run_load), sweeps (run_sweep), the progress line
    stats.py       summarize: percentiles, slope rates, keeps-up; saturation of a sweep
    plots.py       plot_sweep: latency and throughput against offered load
    serve_app.py   ServeApp: Ray + the Serve app on free 127.0.0.1 ports; free_port
    report.py      run_report: the bounded report run (ReportPlan, Report)
    markdown.py    report_markdown: the report's performance.md, written beside report.json
    cli.py         build_parser, main, report_main
"""
from .cli import build_parser, build_report_parser, config_from_args, main, report_main
from .config import (DEFAULT_SENTENCES, DEFAULT_URL, KEEPS_UP, REJECTED_STATUSES, LoadConfig, Mix, RequestMaker,
                     RequestSpec, check_url, load_sentences)
from .generator import Outcome, Progress, RunResult, run_load, run_sweep
from .markdown import report_markdown
from .plots import plot_sweep
from .report import SWEEP_FRACTIONS, Report, ReportPlan, cpu_facts, machine_facts, run_report
from .serve_app import ServeApp, free_port
from .stats import format_summary, percentiles, saturation, slope_rate, summarize
from .targets import EngineTarget, HttpTarget, Reply, Target

__all__ = ["build_parser", "build_report_parser", "config_from_args", "main", "report_main",
           "DEFAULT_SENTENCES", "DEFAULT_URL", "KEEPS_UP", "REJECTED_STATUSES", "LoadConfig", "Mix", "RequestMaker",
           "RequestSpec", "check_url", "load_sentences", "Outcome", "Progress", "RunResult", "run_load", "run_sweep",
           "report_markdown", "plot_sweep", "SWEEP_FRACTIONS", "Report", "ReportPlan", "cpu_facts",
           "machine_facts", "run_report", "ServeApp", "free_port", "format_summary", "percentiles", "saturation",
           "slope_rate", "summarize", "EngineTarget", "HttpTarget", "Reply", "Target"]
