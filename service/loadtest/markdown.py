"""The load-test report as markdown: ``performance.md`` beside ``report.json`` and the plots (by
default in deploy/performance/), with the date and machine of the run and the exact commands that
repeat each figure. It is the only copy: docs/performance.md links to it, so no tool rewrites docs."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

def _ms(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f} ms"


def _describe_model(m: dict[str, Any]) -> str:
    from model.checkpoint import DEFAULT_CHECKPOINT
    c = m.get("model", {})
    what = "the shipped model" if Path(m["checkpoint"]).resolve() == DEFAULT_CHECKPOINT.resolve() else f"`{m['checkpoint']}`"
    if not c:
        return what
    return (f"{what} (d_model {c.get('d_model')}, {c.get('n_heads')} heads, d_ff {c.get('d_ff')}, "
            f"{c.get('n_encoder_layers')}+{c.get('n_decoder_layers')} layers, vocabulary {c.get('vocab_size')})")


def _describe_cpu(m: dict[str, Any]) -> str:
    """The cores, the CPU model and its vector extensions (they decide which int8 kernel runs)."""
    what = [m["cpu_model"]] if m.get("cpu_model") else []
    if m.get("cpu_flags"):
        what.append(", ".join(m["cpu_flags"]))
    return f"{m['cpus']} CPU cores" + (f" ({'; '.join(what)})" if what else "")


def report_markdown(data: dict[str, Any], command: str) -> str:
    """The report for report data, to be written beside its plots (linked by file name): the date
    and machine of the run, the command that produced it, and the commands that repeat each figure
    against a running service. Phases missing from data (out of time) are left out and named at the end."""
    m, svc = data["machine"], data["service"]
    lines = ["# Load-test report", ""]
    lines += [f"Measured on {m.get('date', 'an unrecorded date')} with the load generator (`python -m service.loadtest`) "
              f"on {_describe_cpu(m)}, {'a GPU' if m.get('cuda') else 'no GPU'}, load average "
              f"{m.get('load_average_at_start')} when the run started, serving {_describe_model(m)}, with sentences "
              f"from test_2016_flickr (German). The service ran its default deployment: the HTTP ingress and one "
              f"translator replica with {svc['num_cpus_per_replica']} CPU ({svc['torch_threads_per_replica']} torch "
              "thread). One command produced every figure below. It starts the service on a free 127.0.0.1 port, "
              "runs each measurement within fixed bounds, and writes the plots and `report.json`:", "",
              "```bash", command, "```", "",
              "Saturation is the highest offered Poisson rate that is still achieved at ≥ 95%. Achieved and offered "
              "rates are least-squares slopes of completions and arrivals over time. Latencies are measured from the "
              "scheduled arrival, so queueing in front of the service counts. The load generator shares the cores "
              "with the service, like a client on the same host."]

    sweeps = [(k, label) for k, label in (("batching_greedy", "continuous batching, greedy"),
                                          ("no_batching_greedy", "batching off (`max_running_requests` = 1), greedy"),
                                          ("batching_beam4", "continuous batching, beam 4"))
              if data.get(k, {}).get("points")]
    if sweeps:
        lines += ["", "## Continuous batching against batching off, greedy against beam 4", "",
                  "| service | saturation (offered req/s) | achieved there | peak achieved | "
                  "p50 / p99 at 50% of saturation |", "|---|---|---|---|---|"]
        for k, label in sweeps:
            e = data[k]
            sat, lat = e.get("saturation"), (e.get("half") or {}).get("latency_s", {})
            peak = max(p["achieved_rate"] for p in e["points"])
            if sat is None:
                lines.append(f"| {label} | none of {e['rates']} kept up | | {peak:.2f} req/s | |")
            else:
                lines.append(f"| {label} | {sat['rate']:g} | {sat['achieved_rate']:.2f} req/s, "
                             f"{sat['generated_tokens_per_s']:.0f} tokens/s | {peak:.2f} req/s | "
                             f"{_ms(lat.get('p50'))} / {_ms(lat.get('p99'))} |")
        g, n, b = (data.get(k, {}).get("saturation") for k in ("batching_greedy", "no_batching_greedy", "batching_beam4"))
        lines.append("")
        if g and n:
            lines.append(f"Continuous batching sustains {g['achieved_rate'] / n['achieved_rate']:.1f}× the request "
                         "rate of the same service with batching switched off.")
        if g and b:
            lines.append(f"Beam 4 saturates at {b['achieved_rate'] / g['achieved_rate']:.2f}× the greedy request rate "
                         f"({b['generated_tokens_per_s']:.0f} against {g['generated_tokens_per_s']:.0f} returned "
                         "tokens/s): each beam-4 sentence keeps four hypotheses in the batch.")
        lines += ["", " ".join(f"![{data[k]['title']}]({Path(data[k]['plot']).name})"
                               for k, _ in sweeps), "",
                  "Each row is a closed-loop capacity probe, a Poisson sweep around it, and a run at half the "
                  "saturation rate. Against a running service at $URL the same runs are:", "", "```bash"]
        for k, _ in sweeps:
            lines += [f"# {data[k]['title']}"] + [data[k]["commands"][c] for c in ("probe", "sweep", "half")
                                                  if c in data[k].get("commands", {})]
        lines += ["```", "Batching off is the same deployment with the engine setting `max_running_requests: 1` "
                         "(`build_app` args `engine`, applied to the replica through `user_config`)."]
    s = data.get("stream_greedy_half", {}).get("stream")
    if s and s.get("ttft_s"):
        lines += ["", f"Streaming (SSE) greedy requests at {s['rate']:g} req/s (half the greedy saturation): time to "
                      f"first token p50 {_ms(s['ttft_s']['p50'])}, p99 {_ms(s['ttft_s']['p99'])}; whole response p50 "
                      f"{_ms(s['latency_s']['p50'])}, p99 {_ms(s['latency_s']['p99'])}."]
    a = data.get("attention", {})
    if all(k in a for k in ("off_1", "on_1", "off_n", "on_n")):
        n_users = a["off_n"]["concurrency"]
        lines += ["", "## The cost of `return_attention`", "",
                  "Greedy, closed loop; attention on returns the cross-attention of every layer and head.", "",
                  "| users | attention | latency p50 | latency p99 | requests/s | mean response size |",
                  "|---|---|---|---|---|---|"]
        for k in ("off_1", "on_1", "off_n", "on_n"):
            r = a[k]
            lines.append(f"| {r['concurrency']} | {k[:-2]} | {_ms(r['latency_s']['p50'])} | {_ms(r['latency_s']['p99'])} "
                         f"| {r['requests_per_s']:.2f} | {(r['response_bytes_mean'] or 0) / 1024:.1f} KiB |")
        lines += ["", f"With attention, {n_users} users get {a['on_n']['requests_per_s'] / a['off_n']['requests_per_s']:.2f}× "
                      f"the throughput, and one user's p50 latency is "
                      f"{a['on_1']['latency_s']['p50'] / a['off_1']['latency_s']['p50']:.2f}× that without."]
    o = data.get("overhead", {})
    if all(k in o for k in ("engine_1", "engine_n")) and all(k in a for k in ("off_1", "off_n")):
        lines += ["", "## HTTP and Ray Serve overhead: the engine alone against the same engine through HTTP", "",
                  "The engine alone runs inside the load generator's process (`--engine`): same checkpoint, same "
                  "torch thread count as a replica, default engine settings. The HTTP rows are the attention-off "
                  "runs above.", "",
                  "| greedy, closed loop | latency p50 | latency p99 | requests/s | tokens/s |", "|---|---|---|---|---|"]
        for label, r in (("engine alone, 1 user", o["engine_1"]), ("HTTP + Ray Serve, 1 user", a["off_1"]),
                         (f"engine alone, {o['engine_n']['concurrency']} users", o["engine_n"]),
                         (f"HTTP + Ray Serve, {a['off_n']['concurrency']} users", a["off_n"])):
            lines.append(f"| {label} | {_ms(r['latency_s']['p50'])} | {_ms(r['latency_s']['p99'])} | "
                         f"{r['requests_per_s']:.2f} | {r['generated_tokens_per_s']:.0f} |")
        d1 = a["off_1"]["latency_s"]["p50"] - o["engine_1"]["latency_s"]["p50"]
        lines += ["", f"HTTP and Ray Serve add {d1 * 1000:.0f} ms to one user's p50 latency. Under load the service "
                      f"answers {a['off_n']['requests_per_s'] / o['engine_n']['requests_per_s']:.2f}× the requests/s of "
                      f"the engine alone ({o['engine_n']['requests_per_s']:.2f} → {a['off_n']['requests_per_s']:.2f}); "
                      "on two cores the proxy, the ingress and the client take CPU time from the engine."]
    cmds = data.get("commands", {})
    if cmds:
        lines += ["", "The comparison runs, against a running service at $URL (or the engine alone, with $CHECKPOINT "
                      "and a replica's $THREADS):", "", "```bash", *cmds.values(), "```"]
    if data.get("skipped") or data.get("shortened"):
        lines += ["", f"Out of the time budget: skipped {data.get('skipped') or 'nothing'}, shortened "
                      f"{data.get('shortened') or 'nothing'}."]
    lines += ["", f"The whole report took {data['elapsed_s'] / 60:.1f} minutes."]
    return "\n".join(lines) + "\n"

