// Pagoda engine dashboard: reads /v1/engine/stats/stream (Server-Sent Events over
// fetch, with the API key when one is set) and shows the engine now (tiles), the last
// five minutes (canvas charts) and the latest finished requests (a table). The server
// samples once for every connected dashboard; this page only draws.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const HISTORY_S = 300;
  const MAX_RECENT = 50;
  const RETRY_MS = 2000;
  const history = []; // one entry per stats event, oldest first
  let recent = []; // newest first
  let aborter = null;
  let retryTimer = null;

  // ---------------------------------------------------------------- the stream

  function setConnection(state, text) {
    const badge = $("conn-state");
    badge.dataset.state = state;
    badge.textContent = text;
  }

  async function connect() {
    clearTimeout(retryTimer);
    if (aborter) aborter.abort();
    const ctrl = aborter = new AbortController();
    setConnection("connecting", "connecting");
    try {
      const response = await Pagoda.apiFetch("/v1/engine/stats/stream", { signal: ctrl.signal });
      if (!response.ok) throw new Error(await Pagoda.errorMessage(response));
      setConnection("live", "live");
      await Pagoda.readEvents(response, onEvent);
      if (ctrl.signal.aborted) return;
      setConnection("closed", "stream ended; reconnecting");
    } catch (e) {
      if (ctrl.signal.aborted) return;
      if (e instanceof Pagoda.AuthError) {
        setConnection("error", "API key refused");
        return; // the API key button reconnects
      }
      setConnection("error", "disconnected; retrying");
    }
    retryTimer = setTimeout(connect, RETRY_MS);
  }

  function onEvent(name, data) {
    const value = JSON.parse(data);
    if (name === "info") showInfo(value);
    else if (name === "stats") showStats(value);
    else if (name === "requests") addRequests(value);
  }

  function showInfo(info) {
    const context = info.max_model_len ? " \u00b7 context " + Pagoda.formatNumber(info.max_model_len, 0) : "";
    $("model-info").textContent = info.model + context;
    $("window-label").textContent = "last " + Math.round(info.window_s / 60) + " min";
  }

  // ---------------------------------------------------------------- tiles

  function text(id, value) {
    $(id).textContent = value;
  }

  function percent(value) {
    return value === null || value === undefined ? "–" : Pagoda.formatNumber(value * 100, 1);
  }

  function showStats(s) {
    if (s.state !== "ready") setConnection("warn", "engine " + s.state);
    else if ($("conn-state").dataset.state !== "live") setConnection("live", "live");
    history.push(s);
    while (history.length && history[0].t < s.t - HISTORY_S) history.shift();
    if (s.state === "ready") {
      text("running", s.running);
      text("waiting", s.waiting);
      text("preempted", s.preempted);
      text("max-num-seqs", s.max_num_seqs || "–");
      text("preemptions-total", s.preemptions_total);
      text("tokens-per-step", Pagoda.formatNumber(s.tokens_per_step, 1));
      text("token-budget", Pagoda.formatNumber(s.token_budget, 0));
      $("budget-meter").value = s.tokens_per_step && s.token_budget ? Math.min(1, s.tokens_per_step / s.token_budget) : 0;
      text("steps-per-s", Pagoda.formatNumber(s.steps_per_s, 1));
      text("kv-usage", percent(s.kv_usage));
      $("kv-meter").value = s.kv_usage;
      text("kv-blocks", Pagoda.formatNumber(s.num_blocks, 0));
      text("block-size", s.block_size || "–");
      text("prefix-hit-rate", percent(s.prefix_hit_rate));
      text("prefix-hit-rate-total", percent(s.prefix_hit_rate_total));
      text("output-tok-s", Pagoda.formatNumber(s.output_tok_s, 1));
      text("prompt-tok-s", Pagoda.formatNumber(s.prompt_tok_s, 1));
      text("generation-total", Pagoda.formatNumber(s.generation_tokens_total, 0));
      showSpec(s.spec);
    }
    showLatency(s.latency);
    text("finished-total", Pagoda.formatNumber(s.finished_total, 0));
    const reasons = Object.entries(s.finished_by_reason || {}).map(([k, v]) => v + " " + k);
    text("finished-by-reason", reasons.length ? reasons.join(" \u00b7 ") : "none yet");
    drawCharts();
    renderRecent();
  }

  function showSpec(spec) {
    $("spec-tile").hidden = !spec;
    if (!spec) return;
    text("spec-acceptance", percent(spec.acceptance_rate));
    text("spec-acceptance-total", percent(spec.acceptance_rate_total));
    text("spec-drafts", Pagoda.formatNumber(spec.draft_tokens_total, 0));
  }

  function showLatency(latency) {
    if (!latency) return;
    for (const metric of ["ttft", "itl", "e2e"]) {
      for (const p of ["p50", "p90", "p99"]) {
        const summary = latency[metric];
        text(metric + "-" + p, summary ? Pagoda.formatSeconds(summary[p]) : "–");
      }
    }
  }

  // ---------------------------------------------------------------- recent requests

  function addRequests(list) {
    const now = Date.now() / 1000;
    for (const r of list) recent.unshift(Object.assign({ finishedAt: now - r.finished_ago_s }, r));
    recent = recent.slice(0, MAX_RECENT);
    renderRecent();
  }

  function renderRecent() {
    const now = Date.now() / 1000;
    const rows = recent.map((r) => {
      const row = document.createElement("tr");
      const cells = [r.id, Math.max(0, Math.round(now - r.finishedAt)) + " s ago", r.prompt_tokens,
                     r.output_tokens, Pagoda.formatSeconds(r.queue_s), Pagoda.formatSeconds(r.ttft_s),
                     Pagoda.formatSeconds(r.itl_mean_s), Pagoda.formatSeconds(r.e2e_s), r.finish_reason];
      for (const value of cells) {
        const cell = document.createElement("td");
        cell.textContent = value;
        row.append(cell);
      }
      row.lastChild.className = "reason " + r.finish_reason;
      row.firstChild.title = r.id;
      return row;
    });
    $("recent-body").replaceChildren(...rows);
  }

  // ---------------------------------------------------------------- charts

  function colors() {
    const style = getComputedStyle(document.body);
    return { series: ["--s0", "--s1", "--s2"].map((v) => style.getPropertyValue(v).trim()),
             grid: style.getPropertyValue("--grid").trim(), muted: style.getPropertyValue("--muted").trim() };
  }

  function ms(summary, key) {
    return summary ? summary[key] * 1000 : null;
  }

  function drawCharts() {
    const c = colors();
    const ready = (f) => (s) => (s.state === "ready" ? f(s) : null);
    drawChart("chart-throughput", c, [ready((s) => s.output_tok_s)]);
    drawChart("chart-requests", c, [ready((s) => s.running), ready((s) => s.waiting), ready((s) => s.preempted)]);
    drawChart("chart-usage", c, [ready((s) => s.kv_usage * 100),
                                 ready((s) => (s.token_budget && s.tokens_per_step !== null
                                   ? 100 * s.tokens_per_step / s.token_budget : null))], 100);
    for (const name of ["ttft", "itl"]) {
      drawChart("chart-" + name, c, ["p50", "p90", "p99"].map((p) => (s) => ms(s.latency && s.latency[name], p)));
    }
  }

  // Lines of the given series over the recent past (see span); y from 0 to the
  // largest value (or fixedMax); a null value breaks its line.
  function drawChart(id, c, series, fixedMax) {
    const canvas = $(id);
    const dpr = window.devicePixelRatio || 1;
    const width = Math.max(1, Math.round(canvas.clientWidth * dpr));
    const height = Math.max(1, Math.round(canvas.clientHeight * dpr));
    if (canvas.width !== width || canvas.height !== height) {
      canvas.width = width;
      canvas.height = height;
    }
    const g = canvas.getContext("2d");
    g.clearRect(0, 0, width, height);
    if (!history.length) return;
    const end = history[history.length - 1].t;
    const values = series.map((f) => history.map(f));
    let max = fixedMax || 0;
    if (!fixedMax) for (const list of values) for (const v of list) if (v !== null && v > max) max = v;
    max = max > 0 ? niceCeiling(max) : 1;
    const pad = { left: 4 * dpr, right: 44 * dpr, top: 6 * dpr, bottom: 4 * dpr };
    const plotW = width - pad.left - pad.right;
    const plotH = height - pad.top - pad.bottom;
    // The last minute at least, the last HISTORY_S at most: a dashboard just opened
    // is not one sliver at the right edge.
    const span = Math.min(HISTORY_S, Math.max(60, end - history[0].t));
    const x = (t) => pad.left + plotW * (1 - (end - t) / span);
    const y = (v) => pad.top + plotH * (1 - v / max);
    g.font = 11 * dpr + "px system-ui, sans-serif";
    g.textBaseline = "middle";
    g.lineWidth = 1;
    for (const fraction of [0, 0.5, 1]) {
      g.strokeStyle = c.grid;
      g.beginPath();
      g.moveTo(pad.left, y(max * fraction));
      g.lineTo(pad.left + plotW, y(max * fraction));
      g.stroke();
      g.fillStyle = c.muted;
      g.fillText(Pagoda.formatNumber(max * fraction, max * fraction < 10 ? 1 : 0), pad.left + plotW + 4 * dpr,
                 Math.min(Math.max(y(max * fraction), 6 * dpr), height - 6 * dpr));
    }
    g.lineWidth = 1.5 * dpr;
    values.forEach((list, i) => {
      g.strokeStyle = c.series[i % c.series.length];
      g.beginPath();
      let drawing = false;
      list.forEach((v, j) => {
        if (v === null || v === undefined || Number.isNaN(v)) { drawing = false; return; }
        const px = x(history[j].t);
        const py = y(Math.min(v, max));
        if (drawing) g.lineTo(px, py); else g.moveTo(px, py);
        drawing = true;
      });
      g.stroke();
    });
  }

  function niceCeiling(value) {
    const power = Math.pow(10, Math.floor(Math.log10(value)));
    for (const step of [1, 2, 2.5, 5, 10]) if (step * power >= value) return step * power;
    return 10 * power;
  }

  // ---------------------------------------------------------------- start

  Pagoda.wireKeyButton(connect);
  window.addEventListener("resize", drawCharts);
  connect();
})();
