"""`pagedlm top`: what /dashboard shows, in a terminal (rich), refreshed from
/dashboard/state.

    pagedlm top [URL] [--api-key KEY] [--interval 0.5] [--once]
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from collections import Counter

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

STATE_STYLES = ("grey50", "sky_blue2", "green3", "orange1", "red3", "grey19")  # core order
SPARK = "▁▂▃▄▅▆▇█"


def fetch_state(url: str, api_key: str | None, timeout: float = 10.0) -> dict:
    request = urllib.request.Request(url.rstrip("/") + "/dashboard/state")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.load(response)
    except urllib.error.HTTPError as e:
        try:
            message = json.load(e)["error"]["message"]
        except Exception:  # noqa: BLE001 - not the server's JSON error: say the status
            message = e.reason
        raise RuntimeError(f"{url}: HTTP {e.code}: {message}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise RuntimeError(f"cannot reach {url} ({reason}): is `pagedlm serve` running "
                           f"there?") from None


def _secs(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def sparkline(values: list[float | None], width: int) -> str:
    values = [v or 0.0 for v in values[-width:]]
    top = max(values, default=0.0)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1) + 0.5))]
                   for v in values)


def block_map(states: bytes, names: list[str], width: int, rows: int = 3) -> Text:
    """Blocks folded into width x rows characters: each shows its blocks' commonest state."""
    n = len(states)
    cells = min(n, width * rows) or 1
    text = Text()
    for c in range(cells):
        chunk = states[c * n // cells:(c + 1) * n // cells]
        state = Counter(b & 7 for b in chunk).most_common(1)[0][0] if chunk else 0
        text.append("█", style=STATE_STYLES[state])
        if (c + 1) % width == 0 and c + 1 < cells:
            text.append("\n")
    return text


def render(state: dict, width: int = 100) -> Group:
    info, snap, history = state["info"], state["snapshot"], state["history"]
    stats, counts = snap["stats"], snap["counts"]
    last = history[-1] if history else {}
    head = Text()
    head.append(f"pagedlm · {info['model']} · {info['device']}   ", style="bold")
    head.append(f"running {stats['num_requests_running']}  waiting "
                f"{stats['num_requests_waiting']}  output {last.get('output_tokens_per_s', 0):.0f}"
                f" tok/s  KV {_pct(stats['kv_cache_usage'])}  prefix hits "
                f"{_pct(stats['prefix_cache_hit_rate'])}  preemptions {stats['num_preemptions']}")
    names = snap["state_names"]
    legend = Text()
    for i, name in enumerate(names):
        legend.append("█ ", style=STATE_STYLES[i])
        legend.append(f"{name} {counts[name]}   ")
    legend.append(f"prefix-cache entries {counts['prefix_cache_entries']}")
    states = base64.b64decode(snap["block_states"])
    spark = Text(f"output tok/s  {sparkline([p['output_tokens_per_s'] for p in history], width - 16)}")
    latency = Text(f"TTFT p50/p99 {_secs(last.get('ttft_p50'))} / {_secs(last.get('ttft_p99'))}"
                   f"   inter-token p50/p99 {_secs(last.get('itl_p50'))} / "
                   f"{_secs(last.get('itl_p99'))}")
    if stats.get("spec_num_draft_tokens"):
        latency.append(f"   drafts accepted {_pct(stats['spec_acceptance_rate'])} "
                       f"({stats['spec_mean_acceptance_length']:.2f} tokens per verification)")
    table = Table(box=None, pad_edge=False, header_style="dim")
    for column in ("sequence", "state", "prompt done (cached)", "generated", "TTFT", "age",
                   "preempted", "blocks"):
        table.add_column(column)
    order = {"running": 0, "paused": 1, "preempted": 2, "waiting": 3}
    rows = sorted(snap["sequences"], key=lambda r: (order.get(r["state"], 4), -r["age_s"]))
    for r in rows[:20]:
        done = min(r["computed_tokens"], r["prompt_tokens"])
        table.add_row(r["seq_id"][:40], r["state"],
                      f"{done}/{r['prompt_tokens']} ({r['cached_prompt_tokens']})",
                      str(r["output_tokens"]), _secs(r["ttft_s"]), _secs(r["age_s"]),
                      str(r["preemptions"]), str(len(r["block_ids"])))
    more = Text(f"… and {len(rows) - 20} more sequences", style="dim") if len(rows) > 20 else Text("")
    caption = Text(f"{len(states)} KV blocks of {snap['block_size']} tokens, step {snap['step']}",
                   style="dim")
    return Group(head, caption, block_map(states, names, width), legend, spark, latency,
                 Text(""), table, more)


def run_top(url: str, api_key: str | None, interval: float, once: bool) -> int:
    console = Console()
    if once:
        try:
            console.print(render(fetch_state(url, api_key), console.width))
        except RuntimeError as e:
            console.print(f"error: {e}", style="red", highlight=False)
            return 1
        return 0
    with Live(console=console, auto_refresh=False, screen=False) as live:
        while True:
            try:
                live.update(render(fetch_state(url, api_key), console.width), refresh=True)
            except RuntimeError as e:
                live.update(Text(f"{e} (retrying)", style="red"), refresh=True)
            time.sleep(interval)
