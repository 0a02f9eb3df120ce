// geoloco status page: polls /api/status and redraws. No dependencies, nothing fetched from
// elsewhere; every value from the server goes into the page as text (never as HTML).
"use strict";

const POLL_MS = 1000;
const MAX_BARS = 60;
const token = new URLSearchParams(location.hash.slice(1)).get("token");

function el(tag, text, attrs) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  return node;
}

function fmtBytes(n) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(n) >= 1000 && i < units.length - 1) { n /= 1000; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
}

function fmtRate(bps) {
  const units = ["bit/s", "kbit/s", "Mbit/s", "Gbit/s"];
  let i = 0;
  while (bps >= 1000 && i < units.length - 1) { bps /= 1000; i++; }
  return bps.toFixed(bps < 10 && i > 0 ? 2 : 0) + " " + units[i];
}

function fmtAgo(s) {
  if (s < 1) return "just now";
  if (s < 120) return s.toFixed(0) + " s ago";
  if (s < 7200) return (s / 60).toFixed(0) + " min ago";
  return (s / 3600).toFixed(1) + " h ago";
}

function fmtClock(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour12: false });
}

function describeDeadline(cfg) {
  if (cfg.adaptive_deadline) {
    return "adaptive, " + cfg.adaptive_deadline.min_s + "–" + cfg.adaptive_deadline.max_s + " s";
  }
  return cfg.round_deadline_s === null || cfg.round_deadline_s === undefined ? "none" : cfg.round_deadline_s + " s";
}

function describePrivacy(p) {
  if (!p) return "off";
  const parts = [p.secure_aggregation ? "secure aggregation" : "no secure aggregation", "DP " + p.dp];
  if (p.dp !== "off") parts.push("noise ×" + p.noise_multiplier + ", δ = " + p.delta);
  if (p.epsilon_budget !== null && p.epsilon_budget !== undefined) parts.push("ε budget " + p.epsilon_budget);
  return parts.join(" · ");
}

let streamingOn = false;

function renderConfig(cfg) {
  streamingOn = Boolean(cfg.streaming);
  const dl = document.getElementById("config");
  const rows = [
    ["algorithm", cfg.algorithm + (cfg.round_time_budget_s ? " (" + cfg.round_time_budget_s + " s of training per round)" : " (H = " + cfg.inner_steps + ")")],
    ["codecs", "up " + cfg.uplink_codec + " · down " + cfg.downlink_codec],
    ["outer optimizer", (cfg.outer_optimizer && cfg.outer_optimizer.name) || "the algorithm's default"],
    ["rounds", cfg.total_rounds === 0 ? "until stopped" : cfg.total_rounds],
    cfg.asynchronous
      ? ["asynchronous merges", "at least " + cfg.asynchronous.min_quorum + (cfg.asynchronous.min_quorum === 1 ? " update" : " updates")
          + ", grace " + cfg.asynchronous.grace + ", max staleness " + (cfg.asynchronous.max_staleness === null ? "none" : cfg.asynchronous.max_staleness)
          + ", discount " + cfg.asynchronous.discount_per_version + (cfg.asynchronous.dynamic_local_updates ? ", dynamic local updates" : "")]
      : ["quorum / deadline", cfg.min_sites + (cfg.min_sites === 1 ? " site / " : " sites / ") + describeDeadline(cfg)],
    ["weighting / late updates", (cfg.weighting || "uniform") + " / " + (cfg.late_updates || "drop")],
    ["streaming", cfg.streaming ? cfg.streaming.fragments + " fragments, overlap " + cfg.streaming.overlap_steps + " steps, mix " + cfg.streaming.mix : "off"],
    ["privacy", describePrivacy(cfg.privacy)],
    ["heartbeat", cfg.heartbeat_interval_s + " s (timeout " + cfg.heartbeat_timeout_s + " s)"],
    ["parameters", Number(cfg.parameters).toLocaleString()],
    ["transport", cfg.transport],
    ["workload", cfg.workload && cfg.workload.name ? cfg.workload.name : "(python API)"],
  ];
  dl.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", k), el("dd", v)]));
  document.getElementById("config-full").textContent = JSON.stringify(cfg.full, null, 2);
}

function renderSites(sites) {
  const body = document.querySelector("#sites tbody");
  body.replaceChildren(...sites.map((s) => {
    const tr = el("tr", null, { "data-site": s.name, "data-state": s.state });
    tr.append(
      el("td", s.name),
      (() => { const td = el("td"); td.append(el("span", s.state, { class: "state", "data-state": s.state })); return td; })(),
      el("td", fmtAgo(s.last_seen_s)),
      el("td", s.rounds_joined, { class: "num" }),
      el("td", fmtBytes(s.bytes_up), { class: "num" }),
      el("td", fmtBytes(s.bytes_down), { class: "num" }),
      el("td", fmtRate(s.rate_up_bps) + " / " + fmtRate(s.rate_down_bps), { class: "num" }),
    );
    return tr;
  }));
}

// Which page of the site table the page asks for; the server counts every site by state.
const sitePage = { offset: 0, limit: 100, name: "", state: "" };

// The rounds seen so far in this session: each poll asks only for the ones after them.
let session = null, rounds = [];
const MAX_ROUNDS = 5000;

function statusQuery() {
  const q = new URLSearchParams({ site_offset: sitePage.offset, site_limit: sitePage.limit });
  if (sitePage.name) q.set("site_name", sitePage.name);
  if (sitePage.state) q.set("site_state", sitePage.state);
  if (session !== null && rounds.length) q.set("rounds_after", rounds[rounds.length - 1].round);
  return q.toString();
}

function takeRounds(s) {
  // A new session (a restarted coordinator) starts the list again; its answer to a query made
  // for the old one may lack rounds, so ask again at once.
  if (session !== s.session_id) {
    const partial = s.rounds_after !== null && s.rounds_after !== undefined;
    session = s.session_id; rounds = [];
    if (partial) { again = true; return false; }
  }
  rounds = rounds.concat(s.rounds).slice(-MAX_ROUNDS);
  return true;
}

function renderSitePage(page, states) {
  if (page.offset > 0 && page.offset >= page.matched) {
    // Sites left or the filter narrowed: show the last page there is, at once.
    sitePage.offset = Math.max(0, Math.floor((page.matched - 1) / page.limit) * page.limit);
    again = true;
  }
  const total = page.total;
  const counts = Object.entries(states).map(([state, n]) => n.toLocaleString() + " " + state);
  document.getElementById("site-states").textContent =
    total.toLocaleString() + (total === 1 ? " site" : " sites") + (counts.length ? ": " + counts.join(" · ") : "");
  const select = document.getElementById("site-state");
  const wanted = ["", ...Object.keys(states)];
  if (sitePage.state && !wanted.includes(sitePage.state)) wanted.push(sitePage.state);
  if ([...select.options].map((o) => o.value).join() !== wanted.join()) {
    select.replaceChildren(...wanted.map((v) => el("option", v || "any state", { value: v })));
    select.value = sitePage.state;
  }
  const first = page.matched ? page.offset + 1 : 0, last = Math.min(page.offset + page.limit, page.matched);
  document.getElementById("site-range").textContent =
    first.toLocaleString() + "–" + last.toLocaleString() + " of " + page.matched.toLocaleString();
  document.getElementById("site-prev").disabled = page.offset === 0;
  document.getElementById("site-next").disabled = page.offset + page.limit >= page.matched;
}

function renderTree(tree) {
  const card = document.getElementById("tree-card");
  const relays = (tree && tree.relays) || [];
  card.hidden = relays.length === 0;
  const states = (tree && tree.states) || {};
  const siteItem = (name) => {
    const state = states[name];
    const li = el("li", null, { "data-site": name, "data-state": state || "unseen" });
    li.append(el("span", name, { class: "name" }), el("span", state || "not seen yet", { class: "state", "data-state": state || "" }));
    return li;
  };
  const root = el("li", null, { "data-node": "coordinator" });
  root.append(el("span", "coordinator", { class: "name" }));
  const children = el("ul");
  for (const r of relays) {
    const li = el("li", null, { "data-relay": r.name });
    li.append(
      el("span", "relay " + r.name, { class: "name" }),
      el("span", "link ↑ " + fmtBytes(r.bytes_up) + " ↓ " + fmtBytes(r.bytes_down) + " (" + fmtRate(r.rate_up_bps) + " / " + fmtRate(r.rate_down_bps) + ")", { class: "link", "data-link": r.link }),
    );
    const below = el("ul");
    below.append(...r.sites.map(siteItem));
    li.append(below);
    children.append(li);
  }
  children.append(...((tree && tree.direct) || []).map(siteItem));
  root.append(children);
  document.getElementById("tree").replaceChildren(root);
}

function renderLive(rounds) {
  // What the latest aggregated round says about the run now: the deadline in force, the
  // privacy spent, the fragment synced. Empty (and hidden) before the first round.
  const pill = document.getElementById("live");
  const last = rounds.length ? rounds[rounds.length - 1] : null;
  const parts = [];
  if (last && last.deadline_s !== null && last.deadline_s !== undefined) parts.push("deadline " + last.deadline_s.toPrecision(3) + " s");
  if (last && last.epsilon !== null && last.epsilon !== undefined) parts.push("ε " + last.epsilon.toPrecision(3));
  if (streamingOn && last && last.fragment !== null && last.fragment !== undefined) parts.push("fragment " + last.fragment);
  pill.textContent = parts.join(" · ");
  pill.hidden = parts.length === 0;
}

function renderEvents(events) {
  const list = document.getElementById("events");
  list.replaceChildren(...events.slice(0, 100).map((e) => {
    const li = el("li", null, { "data-kind": e.kind });
    const text = e.count > 1 ? e.text + " (x" + e.count + ")" : e.text;
    li.append(el("time", fmtClock(e.time)), el("span", e.kind, { class: "kind" }), el("span", text));
    return li;
  }));
}

// -- charts -----------------------------------------------------------------------------------

function setupCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = Math.round(w * 260 / 560);
  if (canvas.width !== Math.round(w * ratio)) { canvas.width = Math.round(w * ratio); canvas.height = Math.round(h * ratio); }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  return { ctx, w, h, pad: { l: 62, r: 12, t: 10, b: 28 } };
}

function niceTicks(lo, hi, n) {
  if (!(hi > lo)) { hi = lo + 1; }
  const step0 = (hi - lo) / n, mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= step0);
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-12; v += step) ticks.push(v);
  return ticks;
}

function axes(c, xlo, xhi, ylo, yhi, yfmt) {
  const { ctx, w, h, pad } = c;
  ctx.strokeStyle = "#e3e6eb"; ctx.fillStyle = "#6b7280"; ctx.font = "11px system-ui, sans-serif"; ctx.lineWidth = 1;
  const X = (x) => pad.l + (x - xlo) / ((xhi - xlo) || 1) * (w - pad.l - pad.r);
  const Y = (y) => h - pad.b - (y - ylo) / ((yhi - ylo) || 1) * (h - pad.t - pad.b);
  ctx.textAlign = "right"; ctx.textBaseline = "middle";
  for (const t of niceTicks(ylo, yhi, 4)) {
    ctx.beginPath(); ctx.moveTo(pad.l, Y(t)); ctx.lineTo(w - pad.r, Y(t)); ctx.stroke();
    ctx.fillText(yfmt(t), pad.l - 6, Y(t));
  }
  ctx.textAlign = "center"; ctx.textBaseline = "top";
  for (const t of niceTicks(xlo, xhi, 6).filter((t) => Number.isInteger(t))) ctx.fillText(String(t), X(t), h - pad.b + 6);
  ctx.fillText("round", w - pad.r - 16, h - 12);
  return { X, Y };
}

function drawLoss(canvas, rounds) {
  const c = setupCanvas(canvas);
  const series = [["eval_loss", "#2563eb"], ["train_loss", "#f59e0b"]]
    .map(([key, color]) => ({ color, pts: rounds.filter((r) => r[key] !== null).map((r) => [r.round, r[key]]) }));
  const all = series.flatMap((s) => s.pts);
  canvas.setAttribute("data-points", String(all.length));
  if (all.length === 0) { c.ctx.fillStyle = "#6b7280"; c.ctx.fillText("waiting for the first round…", c.w / 2 - 70, c.h / 2); return; }
  const xs = all.map((p) => p[0]), ys = all.map((p) => p[1]);
  let ylo = Math.min(...ys), yhi = Math.max(...ys);
  const margin = (yhi - ylo) * 0.08 || Math.abs(yhi) * 0.1 || 1;
  ylo -= margin; yhi += margin;
  const { X, Y } = axes(c, Math.min(...xs), Math.max(...xs, Math.min(...xs) + 1), ylo, yhi, (v) => v.toPrecision(3));
  for (const s of series) {
    const ctx = c.ctx;
    ctx.strokeStyle = s.color; ctx.fillStyle = s.color; ctx.lineWidth = 2;
    ctx.beginPath();
    s.pts.forEach(([x, y], i) => (i ? ctx.lineTo(X(x), Y(y)) : ctx.moveTo(X(x), Y(y))));
    ctx.stroke();
    for (const [x, y] of s.pts) { ctx.beginPath(); ctx.arc(X(x), Y(y), 2.5, 0, 2 * Math.PI); ctx.fill(); }
  }
}

function drawBytes(canvas, rounds) {
  const c = setupCanvas(canvas);
  const shown = rounds.slice(-MAX_BARS);
  canvas.setAttribute("data-points", String(shown.length));
  if (shown.length === 0) { c.ctx.fillStyle = "#6b7280"; c.ctx.fillText("waiting for the first round…", c.w / 2 - 70, c.h / 2); return; }
  const yhi = Math.max(...shown.map((r) => Math.max(r.bytes_up, r.bytes_down)), 1) * 1.1;
  const xlo = shown[0].round - 0.5, xhi = shown[shown.length - 1].round + 0.5;
  const { X, Y } = axes(c, xlo, xhi, 0, yhi, fmtBytes);
  const slot = (X(xhi) - X(xlo)) / shown.length, bar = Math.max(1, slot * 0.38);
  for (const r of shown) {
    c.ctx.fillStyle = "#0d9488"; c.ctx.fillRect(X(r.round) - bar, Y(r.bytes_up), bar, Y(0) - Y(r.bytes_up));
    c.ctx.fillStyle = "#7c3aed"; c.ctx.fillRect(X(r.round), Y(r.bytes_down), bar, Y(0) - Y(r.bytes_down));
  }
}

// -- where rounds go --------------------------------------------------------------------------

const COORDINATOR_PHASES = ["receive", "verify", "add", "outer_step", "downlink_encode", "checkpoint", "broadcast"];
const SITE_PHASES = ["train", "pseudo_gradient", "encode", "upload", "wait", "download", "apply", "verify"];
const PHASE_COLORS = ["#0d9488", "#2563eb", "#7c3aed", "#f59e0b", "#db2777", "#b91c1c", "#15803d"];
const OTHER_COLOR = "#d1d5db";

function fmtSeconds(s) {
  return s === null || s === undefined ? "–" : (s < 0.01 ? s.toFixed(4) : s < 10 ? s.toFixed(3) : s.toFixed(1));
}

function otherSeconds(r) {
  if (r.round_wall_s === null || r.round_wall_s === undefined) return null;
  const used = COORDINATOR_PHASES.reduce((sum, p) => sum + (r.phases_s[p] || 0), 0);
  return Math.max(0, r.round_wall_s - used);
}

function renderPhaseLegend() {
  const legend = document.getElementById("phases-legend");
  if (legend.childElementCount) return;
  const keys = COORDINATOR_PHASES.map((p, i) => [p.replaceAll("_", " "), PHASE_COLORS[i]]).concat([["other (waiting for sites)", OTHER_COLOR]]);
  for (const [name, color] of keys) {
    const key = el("span", null, { class: "key phase" });
    key.style.background = color;
    legend.append(key, document.createTextNode(name));
  }
}

function drawPhases(canvas, rounds) {
  const c = setupCanvas(canvas);
  const shown = rounds.filter((r) => r.phases_s && Object.keys(r.phases_s).length).slice(-MAX_BARS);
  canvas.setAttribute("data-points", String(shown.length));
  if (shown.length === 0) { c.ctx.fillStyle = "#6b7280"; c.ctx.fillText("waiting for the first round…", c.w / 2 - 70, c.h / 2); return; }
  const total = (r) => COORDINATOR_PHASES.reduce((sum, p) => sum + (r.phases_s[p] || 0), 0) + (otherSeconds(r) || 0);
  const yhi = Math.max(...shown.map(total), 1e-3) * 1.1;
  const xlo = shown[0].round - 0.5, xhi = shown[shown.length - 1].round + 0.5;
  const { X, Y } = axes(c, xlo, xhi, 0, yhi, (v) => fmtSeconds(v) + " s");
  const bar = Math.max(1, (X(xhi) - X(xlo)) / shown.length * 0.7);
  for (const r of shown) {
    let base = 0;
    const parts = COORDINATOR_PHASES.map((p, i) => [r.phases_s[p] || 0, PHASE_COLORS[i]]).concat([[otherSeconds(r) || 0, OTHER_COLOR]]);
    for (const [seconds, color] of parts) {
      c.ctx.fillStyle = color;
      c.ctx.fillRect(X(r.round) - bar / 2, Y(base + seconds), bar, Y(base) - Y(base + seconds));
      base += seconds;
    }
  }
}

function renderPhaseTables(rounds, sitePhases) {
  const last = [...rounds].reverse().find((r) => r.phases_s && Object.keys(r.phases_s).length);
  const coordinatorBody = document.querySelector("#coordinator-phases tbody");
  const siteBody = document.querySelector("#site-phases tbody");
  siteBody.replaceChildren(...Object.entries((sitePhases && sitePhases.sites) || {}).map(([site, phases]) => {
    const tr = el("tr", null, { "data-site": site });
    tr.append(el("td", site));
    for (const p of SITE_PHASES) tr.append(el("td", fmtSeconds(phases[p]), { class: "num", "data-phase": p }));
    return tr;
  }));
  if (!last) { coordinatorBody.replaceChildren(); return; }
  const row = el("tr", null, { "data-round": last.round });
  row.append(el("td", last.round));
  for (const p of COORDINATOR_PHASES) row.append(el("td", fmtSeconds(last.phases_s[p]), { class: "num", "data-phase": p }));
  row.append(el("td", fmtSeconds(otherSeconds(last)), { class: "num" }), el("td", fmtSeconds(last.round_wall_s), { class: "num" }));
  coordinatorBody.replaceChildren(row);
}

// -- polling ----------------------------------------------------------------------------------

let configShown = null;

async function refresh() {
  const conn = document.getElementById("connection");
  try {
    const headers = token ? { Authorization: "Bearer " + token } : {};
    const response = await fetch("/api/status?" + statusQuery(), { headers, cache: "no-store" });
    if (!response.ok) throw new Error("HTTP " + response.status);
    const s = await response.json();
    if (!takeRounds(s)) return;
    document.getElementById("round").textContent = s.run_finished ? "finished" : "round " + s.round;
    document.getElementById("phase").textContent = s.phase.replaceAll("_", " ");
    conn.textContent = "live"; conn.setAttribute("data-ok", "true");
    if (configShown !== s.session_id) { renderConfig(s.config); configShown = s.session_id; }
    renderSitePage(s.site_page, s.site_states);
    renderSites(s.sites);
    renderTree(s.tree);
    renderEvents(s.events);
    renderLive(rounds);
    drawLoss(document.getElementById("loss-chart"), rounds);
    drawBytes(document.getElementById("bytes-chart"), rounds);
    renderPhaseLegend();
    drawPhases(document.getElementById("phases-chart"), rounds);
    renderPhaseTables(rounds, s.site_phases);
  } catch (err) {
    conn.textContent = "no connection (" + err.message + ")"; conn.setAttribute("data-ok", "false");
  }
}

// One poll at a time: a change of the site page asks at once, or right after the poll in flight.
let timer = null, polling = false, again = false;

function poll() {
  clearTimeout(timer);
  if (polling) { again = true; return; }
  polling = true;
  refresh().finally(() => {
    polling = false;
    timer = setTimeout(poll, again ? 0 : POLL_MS);
    again = false;
  });
}

function showSites(change) {
  Object.assign(sitePage, change);
  poll();
}

document.getElementById("site-name").addEventListener("input", (e) => showSites({ name: e.target.value, offset: 0 }));
document.getElementById("site-state").addEventListener("change", (e) => showSites({ state: e.target.value, offset: 0 }));
document.getElementById("site-prev").addEventListener("click", () => showSites({ offset: Math.max(0, sitePage.offset - sitePage.limit) }));
document.getElementById("site-next").addEventListener("click", () => showSites({ offset: sitePage.offset + sitePage.limit }));

poll();
