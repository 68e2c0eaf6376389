"""`pagedlm bench plot`: PNG charts from benchmark result JSONs (matplotlib, Agg canvas).

    throughput  bars of tokens/s and requests/s, one per engine run (throughput JSONs, or
                any JSON whose "results" maps run names to throughput figures; serving
                JSONs add one bar each, labelled "<label> (served)")
    latency     TTFT / TPOT / ITL / E2E percentiles against the request rate (serving JSONs,
                one per rate; runs are grouped into lines by their label)
    kv-usage    KV slots allocated vs tokens held over time (one kv-waste JSON)

Figures are drawn on ``matplotlib.figure.Figure`` directly, never through pyplot, so no
global backend state is touched and nothing tries to open a window.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedlm.benchmarks.common import read_json
from pagedlm.benchmarks.kv_usage import RESERVE_MAX, RESERVE_ORACLE

_LATENCY_METRICS = (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token"),
                    ("itl_ms", "inter-token latency"), ("e2el_ms", "end-to-end latency"))


def _figure(nrows: int, ncols: int, size: tuple[float, float]) -> tuple[Any, Any]:
    from matplotlib.figure import Figure  # the bench extra

    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _subtitle(report: dict[str, Any]) -> str:
    machine = report.get("machine") or {}
    parts = [str(report.get("model") or ""), str(report.get("dataset") or ""),
             str(machine.get("cpu_model") or "")]
    if machine.get("threads"):
        parts.append(f"{machine['threads']} threads")
    return " | ".join(p for p in parts if p)


def _as_float(value: Any) -> float:
    """A number from a result JSON, where non-finite floats are written as strings."""
    return float(value) if value is not None else math.nan


def throughput_runs(reports: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[str, dict]]:
    """(label, figures) for every run in the reports; labels made unique with the file name."""
    runs: list[tuple[str, dict]] = []
    for name, report in reports:
        if report.get("benchmark") == "serving":
            runs.append(_serving_run(name, report))
            continue
        results = report.get("results")
        if not isinstance(results, dict):
            raise ValueError(f"{name}: no 'results' object; is it a throughput result?")
        for label, figures in results.items():
            if not isinstance(figures, dict) or "output_tokens_per_s" not in figures:
                raise ValueError(f"{name}: results[{label!r}] has no output_tokens_per_s; "
                                 "is it a throughput result?")
            runs.append((_pagedlm_label(label, figures), figures))
    labels = [label for label, _ in runs]
    if len(set(labels)) < len(labels):
        runs = []
        for name, report in reports:
            if report.get("benchmark") == "serving":
                label, figs = _serving_run(name, report)
                runs.append((f"{label} ({Path(name).stem})", figs))
                continue
            runs += [(f"{_pagedlm_label(label, figs)} ({Path(name).stem})", figs)
                     for label, figs in report["results"].items()]
    return runs


def _pagedlm_label(label: str, figures: dict[str, Any]) -> str:
    """An unlabelled pagedlm run names its weight dtype when it is not the default."""
    weight_dtype = (figures.get("engine_args") or {}).get("weight_dtype", "auto")
    return f"{label} {weight_dtype}" if label == "pagedlm" and weight_dtype not in ("auto", None) else label


def _serving_run(name: str, report: dict[str, Any]) -> tuple[str, dict]:
    """A `pagedlm bench serving` result as one bar: its label (or server URL), served."""
    results = report.get("results")
    if not isinstance(results, dict) or "output_throughput" not in results:
        raise ValueError(f"{name}: a serving result without results.output_throughput")
    label = report.get("label") or report.get("base_url") or Path(name).stem
    return f"{label} (served)", {
        "output_tokens_per_s": results["output_throughput"],
        "total_tokens_per_s": results.get("total_token_throughput"),
        "requests_per_s": results.get("request_throughput"),
    }


def plot_throughput(reports: Sequence[tuple[str, dict[str, Any]]], output: str | Path) -> Path:
    """Bars of output and total tokens/s (left) and requests/s (right) per run."""
    runs = throughput_runs(reports)
    labels = [label for label, _ in runs]
    fig, axes = _figure(1, 2, (max(8.0, 1.6 * len(runs) + 5), 4.5))
    ax, ax_req = axes[0]
    width = 0.4
    xs = list(range(len(runs)))
    for offset, key, title in ((-width / 2, "output_tokens_per_s", "output tokens/s"),
                               (width / 2, "total_tokens_per_s", "total tokens/s")):
        values = [_as_float(f.get(key)) for _, f in runs]
        bars = ax.bar([x + offset for x in xs], values, width, label=title)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(xs, labels, rotation=15)
    ax.set_ylabel("tokens / s")
    ax.set_title("token throughput")
    ax.legend()
    bars = ax_req.bar(xs, [_as_float(f.get("requests_per_s")) for _, f in runs], 0.6,
                      color="tab:green")
    ax_req.bar_label(bars, fmt="%.2f", fontsize=8)
    ax_req.set_xticks(xs, labels, rotation=15)
    ax_req.set_ylabel("requests / s")
    ax_req.set_title("request throughput")
    served = any(r.get("benchmark") == "serving" for _, r in reports)
    title = "offline and served (HTTP) throughput" if served else "offline throughput"
    fig.suptitle(f"{title}\n{_subtitle(reports[0][1])}", fontsize=10)
    return _save(fig, output)


def _rate_positions(rates: Sequence[float]) -> dict[float, float]:
    """x position per request rate: finite rates as they are, inf one step beyond them."""
    finite = sorted({r for r in rates if math.isfinite(r)})
    top = finite[-1] if finite else 0.0
    step = (finite[-1] - finite[0]) / max(1, len(finite) - 1) if len(finite) > 1 else 1.0
    return {r: (r if math.isfinite(r) else top + step) for r in rates}


def plot_latency(reports: Sequence[tuple[str, dict[str, Any]]], output: str | Path) -> Path:
    """Median (solid), p99 (dashed) and mean (dotted) of each latency against the rate."""
    groups: dict[str, list[tuple[float, dict]]] = {}
    for name, report in reports:
        results = report.get("results")
        if report.get("benchmark") != "serving" or not isinstance(results, dict):
            raise ValueError(f"{name} is not a `pagedlm bench serving` result")
        label = str(report.get("label") or report.get("model") or Path(name).stem)
        groups.setdefault(label, []).append((_as_float(report.get("request_rate")), results))
    positions = _rate_positions([rate for runs in groups.values() for rate, _ in runs])
    fig, axes = _figure(2, 2, (11.0, 8.0))
    colors = [f"C{i}" for i in range(10)]
    for (label, runs), color in zip(sorted(groups.items()), colors * 10):
        runs.sort(key=lambda r: positions[r[0]])
        xs = [positions[rate] for rate, _ in runs]
        for ax, (key, title) in zip(axes.flat, _LATENCY_METRICS):
            for stat, style in (("median", "-"), ("p99", "--"), ("mean", ":")):
                ys = [_as_float(res.get(key, {}).get(stat)) for _, res in runs]
                ax.plot(xs, ys, style, marker="o", color=color, label=f"{label} {stat}")
            ax.set_title(title)
            ax.set_ylabel("ms")
            ax.set_xlabel("request rate (req/s)")
    ticks = sorted(set(positions.values()))
    names = {positions[r]: ("inf" if math.isinf(r) else f"{r:g}") for r in positions}
    for ax in axes.flat:
        ax.set_xticks(ticks, [names[t] for t in ticks])
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"serving latency vs request rate\n{_subtitle(reports[0][1])}", fontsize=10)
    return _save(fig, output)


def plot_kv_usage(reports: Sequence[tuple[str, dict[str, Any]]], output: str | Path) -> Path:
    """KV slots over time: the simulation's schemes and, if recorded, the engine's."""
    if len(reports) != 1:
        raise ValueError("plot kv-usage takes one kv-waste JSON")
    name, report = reports[0]
    results = report.get("results") or {}
    sim = results.get("simulated")
    measured = results.get("measured") or {}
    if report.get("benchmark") != "kv-waste" or sim is None:
        raise ValueError(f"{name} is not a `pagedlm bench kv-waste` result")
    fig, axes = _figure(1, 2 if measured else 1, (13.0 if measured else 7.0, 4.5))
    ax = axes[0][0]
    series = sim["series"]
    for key, values in series.items():
        if key in ("step", "num_running", "tokens_held"):
            continue
        waste = sim["waste"][key]
        label = {RESERVE_MAX: "reserve max_model_len", RESERVE_ORACLE: "reserve prompt+output"
                 }.get(key, key.replace("paged_bs", "paged, block "))
        ax.plot(series["step"], values, label=f"{label} ({_as_float(waste):.1%} waste)")
    ax.plot(series["step"], series["tokens_held"], "k--", linewidth=1.2, label="tokens held")
    ax.set_title(f"simulated, {sim['num_requests']} requests, "
                 f"max {sim['max_num_seqs']} running")
    ax.set_xlabel("step")
    ax.set_ylabel("KV slots")
    ax.legend(fontsize=8)
    if measured:
        ax_m = axes[0][1]
        for i, (bs, m) in enumerate(measured.items()):
            s = m["series"]
            ax_m.plot(s["step"], s["allocated_slots"], color=f"C{i}",
                      label=f"allocated, block {bs} ({_as_float(m['waste']):.1%} waste)")
            ax_m.plot(s["step"], s["tokens_held"], ":", color=f"C{i}",
                      label=f"tokens held, block {bs}")
        ax_m.set_title("measured engine (record_kv_usage)")
        ax_m.set_xlabel("engine step")
        ax_m.set_ylabel("KV slots")
        ax_m.legend(fontsize=8)
    fig.suptitle(f"KV cache usage over time\n{_subtitle(report)}", fontsize=10)
    return _save(fig, output)


def _save(fig: Any, output: str | Path) -> Path:
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


PLOTTERS = {"throughput": plot_throughput, "latency": plot_latency, "kv-usage": plot_kv_usage}


def default_output(first_input: str | Path, kind: str) -> Path:
    """``results/run.json`` -> ``results/run_<kind>.png``: next to the JSON."""
    path = Path(first_input)
    return path.with_name(f"{path.stem}_{kind.replace('-', '_')}.png")


def main(args: argparse.Namespace) -> int:
    """Run `pagedlm bench plot`; returns the exit status."""
    reports = [(name, read_json(name)) for name in args.inputs]
    output = args.output or default_output(args.inputs[0], args.kind)
    print(f"wrote {PLOTTERS[args.kind](reports, output)}")
    return 0
