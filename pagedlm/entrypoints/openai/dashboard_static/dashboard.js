// pagedlm's live dashboard: block map, requests, charts. Fed by /dashboard/events (SSE).
// window.pagedlmDashboard exposes what is drawn, for scripts and the browser test.
(() => {
  "use strict";
  const key = new URLSearchParams(location.search).get("api_key");
  const query = key ? "?api_key=" + encodeURIComponent(key) : "";
  const STATES = ["free", "evictable", "owned", "shared", "copying", "reserved"];
  const COLORS = ["#e5e7eb", "#93c5fd", "#22c55e", "#f59e0b", "#ef4444", "#1f2937"];
  const CACHED_FLAG = 8;
  const $ = (id) => document.getElementById(id);

  const view = {
    info: null, snapshot: null, states: new Uint8Array(0), refs: new Uint8Array(0),
    owners: new Map(), history: [], updates: 0, cell: 8, cols: 1, lastCounts: null,
  };

  function decode(b64) {
    const bin = atob(b64);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }
  const fmt = (x, digits = 0) => (x === null || x === undefined || Number.isNaN(x)) ? "–"
    : Number(x).toLocaleString(undefined, {maximumFractionDigits: digits, minimumFractionDigits: digits});
  const secs = (x) => (x === null || x === undefined) ? "–"
    : x < 1 ? (x * 1000).toFixed(0) + " ms" : x.toFixed(x < 10 ? 2 : 1) + " s";
  const pct = (x) => (x === null || x === undefined) ? "–" : (100 * x).toFixed(1) + "%";
  function esc(s) {
    return String(s).replace(/[&<>"]/g, (c) => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]));
  }

  // ----- the block map: one cell per block, drawn into an ImageData ----------------------

  function sharedColor(refs) {  // amber, darker as more sequences share the block
    const t = Math.min(1, (refs - 2) / 6);
    return [Math.round(251 - t * 131), Math.round(191 - t * 138), Math.round(36 - t * 27)];
  }
  const RGB = COLORS.map((c) => [1, 3, 5].map((i) => parseInt(c.slice(i, i + 2), 16)));

  function layout(n) {
    const canvas = $("blockmap");
    const width = Math.max(200, canvas.parentElement.clientWidth);
    const maxHeight = Math.max(160, Math.min(520, window.innerHeight * 0.5));
    let cell = Math.floor(Math.sqrt((width * maxHeight) / Math.max(1, n)));
    cell = Math.max(1, Math.min(16, cell));
    const cols = Math.max(1, Math.floor(width / cell));
    const rows = Math.ceil(n / cols);
    view.cell = cell; view.cols = cols;
    if (canvas.width !== cols * cell || canvas.height !== rows * cell) {
      canvas.width = cols * cell; canvas.height = Math.max(1, rows * cell);
      canvas.style.width = canvas.width + "px";
      canvas.style.height = canvas.height + "px";
    }
    return canvas;
  }

  function drawMap() {
    const n = view.states.length;
    const canvas = layout(n);
    const ctx = canvas.getContext("2d");
    const img = ctx.createImageData(canvas.width, canvas.height);
    const data = img.data, W = canvas.width, cell = view.cell, cols = view.cols;
    const gap = cell >= 4 ? 1 : 0;
    for (let b = 0; b < n; b++) {
      const s = view.states[b] & 7;
      const rgb = s === 3 ? sharedColor(view.refs[b]) : RGB[s];
      const x0 = (b % cols) * cell, y0 = Math.floor(b / cols) * cell;
      for (let y = y0; y < y0 + cell - gap; y++) {
        let p = (y * W + x0) * 4;
        for (let x = 0; x < cell - gap; x++, p += 4) {
          data[p] = rgb[0]; data[p + 1] = rgb[1]; data[p + 2] = rgb[2]; data[p + 3] = 255;
        }
      }
      if ((view.states[b] & CACHED_FLAG) && cell >= 6) {  // a prefix-cache entry: a dot
        const p = ((y0 + 1) * W + x0 + 1) * 4;
        data[p] = data[p + 1] = data[p + 2] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
  }

  function blockInfo(id) {
    const snap = view.snapshot;
    if (!snap || id < 0 || id >= view.states.length) return null;
    const owners = view.owners.get(id) || [];
    let tokens = 0;
    for (const o of owners) {
      tokens = Math.max(tokens, Math.min(snap.block_size,
        Math.max(0, o.row.computed_tokens - o.index * snap.block_size)));
    }
    return {
      id, state: STATES[view.states[id] & 7], refCount: view.refs[id],
      prefixCacheEntry: (view.states[id] & CACHED_FLAG) !== 0,
      owners: owners.map((o) => o.row.seq_id), tokensHeld: tokens,
    };
  }

  function onHover(ev) {
    const tip = $("tooltip");
    const rect = ev.target.getBoundingClientRect();
    const x = ev.clientX - rect.left, y = ev.clientY - rect.top;
    const id = Math.floor(y / view.cell) * view.cols + Math.floor(x / view.cell);
    const info = Math.floor(x / view.cell) < view.cols ? blockInfo(id) : null;
    if (!info) { tip.hidden = true; return; }
    const owners = info.owners.length > 6
      ? info.owners.slice(0, 6).join(", ") + ` … (+${info.owners.length - 6})`
      : info.owners.join(", ") || "none";
    tip.textContent = `block ${info.id}: ${info.state}\nref count ${info.refCount}` +
      `\ntokens held ${info.tokensHeld} / ${view.snapshot.block_size}` +
      `\nprefix-cache entry: ${info.prefixCacheEntry ? "yes" : "no"}\nowners: ${owners}`;
    tip.hidden = false;
    tip.style.left = Math.min(x + 14, rect.width - 240) + "px";
    tip.style.top = (y + 14) + "px";
  }

  function drawLegend(counts) {
    $("legend").innerHTML = STATES.map((s, i) =>
      `<span data-state="${s}"><i class="sw" style="background:${COLORS[i]}"></i>${s} ` +
      `<b>${fmt(counts[s])}</b></span>`).join("") +
      `<span data-state="prefix_cache_entries">prefix-cache entries <b>${fmt(counts.prefix_cache_entries)}</b></span>`;
  }

  // ----- requests: sequences grouped under their request ---------------------------------

  function drawRequests(rows) {
    const groups = new Map();
    for (const r of rows) {
      if (!groups.has(r.request_id)) groups.set(r.request_id, []);
      groups.get(r.request_id).push(r);
    }
    const order = {running: 0, paused: 1, preempted: 2, waiting: 3};
    const sorted = [...groups.entries()].sort((a, b) =>
      Math.min(...a[1].map((r) => order[r.state])) - Math.min(...b[1].map((r) => order[r.state])) ||
      Math.max(...b[1].map((r) => r.age_s)) - Math.max(...a[1].map((r) => r.age_s)));
    const html = [];
    const shown = sorted.slice(0, 200);
    for (const [id, seqs] of shown) {
      if (seqs.length > 1) {
        html.push(`<tr class="group" data-request="${esc(id)}"><td colspan="9">${esc(id)} · ` +
          `${seqs.length} ${seqs[0].kind === "beam" ? "beams" : "samples"}</td></tr>`);
      }
      for (const r of seqs) html.push(rowHtml(r, seqs.length > 1));
    }
    $("requests").tBodies[0].innerHTML = html.join("");
    const waiting = rows.filter((r) => r.state !== "running").length;
    $("req-caption").textContent = `${rows.length - waiting} running, ${waiting} waiting` +
      (sorted.length > shown.length ? ` (first ${shown.length} requests shown)` : "");
  }

  function rowHtml(r, child) {
    // Of the prompt now in the cache: what the prefix cache gave, and all that is computed
    // (after a preemption both start again from zero).
    const p = Math.max(1, r.prompt_tokens), computed = Math.min(r.computed_tokens, r.prompt_tokens);
    const cached = Math.min(r.cached_prompt_tokens, computed);
    const done = computed / p, hit = cached / p;
    return `<tr class="${child ? "child" : "single"}" data-seq="${esc(r.seq_id)}" data-state="${r.state}">` +
      `<td>${esc(r.seq_id)}</td><td><span class="state ${r.state}">${r.state}</span></td>` +
      `<td><span class="bar"><i class="done" style="width:${(100 * done).toFixed(1)}%"></i>` +
      `<i class="hit" style="width:${(100 * hit).toFixed(1)}%"></i></span>` +
      `${fmt(cached)} / ${fmt(computed)} / ${fmt(r.prompt_tokens)}</td>` +
      `<td>${fmt(r.output_tokens)}</td><td>${secs(r.queue_s)}</td><td>${secs(r.ttft_s)}</td>` +
      `<td>${secs(r.age_s)}</td><td>${r.preemptions}</td><td>${r.block_ids.length}</td></tr>`;
  }

  // ----- charts over the last minutes -----------------------------------------------------

  const CHARTS = [
    {id: "tps", title: "output tokens/s", series: [["output_tokens_per_s", "#2563eb"]], f: (v) => fmt(v)},
    {id: "batch", title: "batch (running, waiting)", series: [["running", "#16a34a"], ["waiting", "#f59e0b"]], f: (v) => fmt(v)},
    {id: "kv", title: "KV cache usage", series: [["kv_usage", "#7c3aed"]], f: pct, max: 1},
    {id: "hit", title: "prefix-cache hit rate", series: [["prefix_hit_rate", "#0891b2"]], f: pct, max: 1},
    {id: "pre", title: "preemptions per sample", series: [["preemptions", "#dc2626"]], f: (v) => fmt(v)},
    {id: "ttft", title: "TTFT p50 / p99", series: [["ttft_p50", "#2563eb"], ["ttft_p99", "#93c5fd"]], f: secs},
    {id: "itl", title: "inter-token latency p50 / p99", series: [["itl_p50", "#16a34a"], ["itl_p99", "#86efac"]], f: secs},
  ];

  function setupCharts() {
    $("charts").innerHTML = CHARTS.map((c) =>
      `<div class="chart" id="chart-${c.id}"><h3>${c.title}<span></span></h3><canvas></canvas></div>`).join("");
  }

  function drawCharts() {
    // The window grows with the history, from one minute to history_s.
    const now = Date.now() / 1000, limit = view.info ? view.info.history_s : 300;
    const first = view.history.length ? view.history[0].t : now;
    const span = Math.min(limit, Math.max(60, now - first));
    const points = view.history.filter((p) => p.t >= now - span);
    for (const c of CHARTS) {
      const box = $("chart-" + c.id), canvas = box.querySelector("canvas");
      const w = canvas.clientWidth || 320, h = canvas.clientHeight || 120, dpr = window.devicePixelRatio || 1;
      if (canvas.width !== w * dpr) { canvas.width = w * dpr; canvas.height = h * dpr; }
      const ctx = canvas.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, w, h);
      let max = c.max || 0;
      for (const p of points) for (const [k] of c.series) if (p[k] !== null && p[k] > max) max = p[k];
      max = max > 0 ? max * (c.max ? 1 : 1.1) : 1;
      ctx.strokeStyle = "#e5e7eb"; ctx.fillStyle = "#6b7280"; ctx.font = "10px system-ui";
      ctx.beginPath(); ctx.moveTo(40, 4); ctx.lineTo(40, h - 14); ctx.lineTo(w - 4, h - 14); ctx.stroke();
      ctx.fillText(c.f(max), 2, 12); ctx.fillText("0", 30, h - 16);
      ctx.fillText(span >= 120 ? `-${Math.round(span / 60)} min` : `-${Math.round(span)} s`, 42, h - 2); ctx.fillText("now", w - 24, h - 2);
      const X = (t) => 40 + ((t - (now - span)) / span) * (w - 44);
      const Y = (v) => h - 14 - (v / max) * (h - 20);
      for (const [k, color] of c.series) {
        ctx.strokeStyle = color; ctx.lineWidth = 1.5; ctx.beginPath();
        let pen = false;
        for (const p of points) {
          if (p[k] === null || p[k] === undefined) { pen = false; continue; }
          if (pen) ctx.lineTo(X(p.t), Y(p[k])); else ctx.moveTo(X(p.t), Y(p[k]));
          pen = true;
        }
        ctx.stroke();
        ctx.fillStyle = color;  // a dot per point: a lone value (one TTFT) shows too
        for (const p of points) {
          if (p[k] !== null && p[k] !== undefined) ctx.fillRect(X(p.t) - 1, Y(p[k]) - 1, 2, 2);
        }
      }
      const latest = (k) => {  // the last value shown, not the last (maybe empty) sample
        for (let i = points.length - 1; i >= 0; i--) if (points[i][k] !== null) return points[i][k];
        return null;
      };
      box.querySelector("h3 span").textContent = points.length
        ? c.series.map(([k]) => c.f(latest(k))).join(" / ") : "";
    }
  }

  // ----- updates --------------------------------------------------------------------------

  function applySnapshot(snap) {
    view.snapshot = snap;
    view.states = decode(snap.block_states);
    view.refs = decode(snap.ref_counts);
    const owners = new Map();
    for (const row of snap.sequences) {
      row.block_ids.forEach((id, index) => {
        if (!owners.has(id)) owners.set(id, []);
        owners.get(id).push({row, index});
      });
    }
    view.owners = owners;
    view.lastCounts = snap.counts;
    drawMap();
    drawLegend(snap.counts);
    drawRequests(snap.sequences);
    const st = snap.stats, n = view.states.length;
    $("map-caption").textContent = `${fmt(n)} blocks of ${snap.block_size} tokens · step ${fmt(snap.step)}` +
      ` · ${fmt(st.num_block_copies)} copy-on-write copies`;
    $("t-running").textContent = fmt(st.num_requests_running);
    $("t-waiting").textContent = fmt(st.num_requests_waiting);
    $("t-kv").textContent = pct(st.kv_cache_usage);
    $("t-hit").textContent = pct(st.prefix_cache_hit_rate);
    $("t-preempt").textContent = fmt(st.num_preemptions);
    if (st.spec_num_draft_tokens > 0) {  // speculative decoding at work
      $("tile-spec").hidden = false;
      $("t-spec").textContent = `${pct(st.spec_acceptance_rate)} (${st.spec_mean_acceptance_length.toFixed(2)})`;
    }
    $("t-cost").textContent = snap.step_seconds_total > 0
      ? (100 * snap.build_seconds_total / snap.step_seconds_total).toFixed(2) + "%" : "–";
  }

  function addPoints(points) {
    if (!points.length) return;
    view.history.push(...points);
    const span = view.info ? view.info.history_s : 300;
    const cut = Date.now() / 1000 - span;
    while (view.history.length && view.history[0].t < cut) view.history.shift();
    const last = view.history[view.history.length - 1];
    $("t-tps").textContent = fmt(last.output_tokens_per_s);
  }

  function connect() {
    const es = new EventSource("/dashboard/events" + query);
    es.addEventListener("init", (ev) => {
      const msg = JSON.parse(ev.data);
      view.info = msg.info;
      view.history = [];
      addPoints(msg.history);
      $("model").textContent = `${msg.info.model} · ${msg.info.device} · context ${fmt(msg.info.max_model_len)}`;
      $("conn").textContent = "live"; $("conn").className = "conn live";
    });
    es.addEventListener("update", (ev) => {
      const msg = JSON.parse(ev.data);
      if (msg.snapshot) applySnapshot(msg.snapshot);
      addPoints(msg.points);
      drawCharts();
      view.updates++;
    });
    es.addEventListener("dead", (ev) => {
      $("conn").textContent = "engine stopped: " + JSON.parse(ev.data).error;
      $("conn").className = "conn dead";
      es.close();
    });
    es.onerror = () => {
      if ($("conn").className !== "conn dead") {
        $("conn").textContent = "reconnecting…"; $("conn").className = "conn";
      }
    };
  }

  window.pagedlmDashboard = {
    get snapshot() { return view.snapshot; },
    get updates() { return view.updates; },
    get historyLength() { return view.history.length; },
    counts() { return view.lastCounts; },
    blockInfo,
    cellOf(id) { return {x: (id % view.cols) * view.cell, y: Math.floor(id / view.cols) * view.cell, size: view.cell}; },
  };
  $("blockmap").addEventListener("mousemove", onHover);
  $("blockmap").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  window.addEventListener("resize", () => { if (view.snapshot) drawMap(); drawCharts(); });
  setupCharts();
  connect();
})();
