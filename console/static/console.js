// tiermesh admin console: one page, fed by /api/stream (server-sent events) and a few JSON endpoints.
// No framework: each view is redrawn from the latest snapshot; text goes in with textContent, never as HTML.
"use strict";

const S = { snap: null, land: null, selected: null, tab: "map", charts: {}, topologyDigest: undefined };
const $ = (sel) => document.querySelector(sel);
const COLORS = ["#4aa3ff", "#2fb36b", "#e6a700", "#c678dd", "#f06a1d", "#56b6c2"];

function el(tag, attrs, ...kids) {
  const isSvg = ["svg", "g", "circle", "line", "path", "text", "title", "rect"].includes(tag);
  const n = isSvg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === undefined || v === null) continue;
    if (k === "on") for (const [ev, fn] of Object.entries(v)) n.addEventListener(ev, fn);
    else if (k === "text") n.textContent = v;
    else n.setAttribute(k, v);
  }
  for (const k of kids.flat()) if (k !== null && k !== undefined) n.append(k instanceof Node ? k : String(k));
  return n;
}
const fmt = (v, d = 1) => (v === null || v === undefined || Number.isNaN(v)) ? "–" : Number(v).toFixed(d);
const pct = (v) => (v === null || v === undefined) ? "no data" : (100 * v).toFixed(1) + "%";
const mib = (b) => (b === null || b === undefined) ? "–" : (b / 1048576).toFixed(1) + " MiB";
const when = (ts) => ts ? new Date(ts * 1000).toLocaleTimeString() : "–";

// -- tabs ------------------------------------------------------------------------------------
function showTab(name) {
  S.tab = name;
  for (const a of document.querySelectorAll("#tabs a")) a.classList.toggle("active", a.dataset.tab === name);
  for (const sec of document.querySelectorAll(".tab")) sec.hidden = sec.id !== "tab-" + name;
  if (name === "topology") loadTopology();
  if (name === "traces") loadRecentTraces();
  if (name === "jobs") loadJobs();
  if (name === "builds") loadBuilds();
  if (name === "cascades") loadCascades();
  if (name === "versions") loadVersions();
  render();
}
window.addEventListener("hashchange", () => showTab((location.hash || "#map").slice(1)));

// -- map -------------------------------------------------------------------------------------
function projectionFor(sites) {
  const proj = d3.geoNaturalEarth1();
  if (!sites.length) return proj.fitSize([960, 540], { type: "Sphere" });
  // frame the sites with a margin of a few degrees around each (every corner, so a curved projection keeps
  // them all inside), so that sites of one metro do not sit on one pixel and none falls off the edge
  const pad = 8, pts = [];
  for (const s of sites) for (const [dx, dy] of [[-pad, -pad], [pad, -pad], [-pad, pad], [pad, pad]])
    pts.push([Math.max(-180, Math.min(180, s.lon + dx)), Math.max(-85, Math.min(85, s.lat + dy))]);
  return proj.fitExtent([[30, 30], [930, 510]], { type: "MultiPoint", coordinates: pts });
}

// Sites of one metro (an edge beside its core) project onto nearly one point: push apart any two closer than
// MIN_GAP pixels, a few rounds, so each stays clickable. Links follow the displaced positions.
const MIN_GAP = 40;
function spread(at) {
  const names = Object.keys(at).sort();
  for (let round = 0; round < 30; round++) {
    let moved = false;
    for (let i = 0; i < names.length; i++) for (let j = i + 1; j < names.length; j++) {
      const a = at[names[i]], b = at[names[j]];
      let dx = b[0] - a[0], dy = b[1] - a[1];
      let d = Math.hypot(dx, dy);
      if (d >= MIN_GAP) continue;
      if (d < 0.01) { dx = 1; dy = 0.5; d = Math.hypot(dx, dy); }
      const push = (MIN_GAP - d) / 2 + 0.5;
      a[0] -= (dx / d) * push; a[1] -= (dy / d) * push; b[0] += (dx / d) * push; b[1] += (dy / d) * push;
      moved = true;
    }
    if (!moved) break;
  }
  return at;
}

function linkLabel(l) {
  const rtt = `RTT ${fmt(l.declared_rtt_ms, 0)} ms` + (l.measured_rtt_ms !== null ? ` (meas ${fmt(l.measured_rtt_ms, 1)})` : "");
  return rtt + (l.traffic_qps ? ` · ${fmt(l.traffic_qps, 1)} q/s` : "");
}

// The map is drawn once per set of sites and links (the shape), then updated in place every snapshot, so a
// click or a hover is never lost to a redraw.
function renderMap() {
  const svg = $("#map");
  const snap = S.snap;
  if (!snap) return;
  const shape = JSON.stringify([snap.sites.map((s) => [s.name, s.lat, s.lon]), snap.links.map((l) => [l.a, l.b]), !!S.land]);
  if (shape !== S.mapShape) {
    S.mapShape = shape;
    svg.replaceChildren();
    const proj = projectionFor(snap.sites);
    const path = d3.geoPath(proj);
    svg.append(el("path", { class: "graticule", d: path(d3.geoGraticule10()) }));
    if (S.land) svg.append(el("path", { class: "land", d: path(S.land) }));
    const at = {};
    for (const s of snap.sites) at[s.name] = proj([s.lon, s.lat]);
    spread(at);
    const gl = el("g", { id: "links" });
    for (const l of snap.links) {
      const a = at[l.a], b = at[l.b];
      if (!a || !b) continue;
      const long = Math.hypot(b[0] - a[0], b[1] - a[1]) > 110;  // short links: the label is in the hover title
      gl.append(el("line", { class: "link", x1: a[0], y1: a[1], x2: b[0], y2: b[1], "data-link": `${l.a}|${l.b}` }, el("title")),
                el("text", { class: "link-label", x: (a[0] + b[0]) / 2, y: (a[1] + b[1]) / 2 - 3, "text-anchor": "middle",
                             "data-link-label": `${l.a}|${l.b}`, visibility: long ? "visible" : "hidden" }));
    }
    svg.append(gl);
    const gs = el("g", { id: "sites" });
    for (const s of snap.sites) {
      const p = at[s.name];
      // the label goes on the side away from the nearest other site
      let near = null, best = Infinity;
      for (const o of snap.sites) {
        const d = o.name === s.name ? Infinity : Math.hypot(at[o.name][0] - p[0], at[o.name][1] - p[1]);
        if (d < best) { best = d; near = at[o.name]; }
      }
      const left = near && best < 140 && near[0] > p[0];
      gs.append(el("g", { class: "site", "data-site": s.name, transform: `translate(${p[0]},${p[1]})`,
                          "data-label-side": left ? "left" : "right", on: { click: () => { S.selected = s.name; render(); } } },
        el("circle", { r: 7 }), el("title"), el("text", { x: 12, y: 4, "text-anchor": left ? "end" : "start", text: s.name })));
    }
    svg.append(gs);
  }
  for (const l of snap.links) {
    const key = `${l.a}|${l.b}`;
    const line = svg.querySelector(`line[data-link="${CSS.escape(key)}"]`);
    const label = svg.querySelector(`text[data-link-label="${CSS.escape(key)}"]`);
    if (!line || !label) continue;
    line.setAttribute("stroke-width", 1 + Math.min(6, Math.log2(1 + (l.traffic_qps || 0))));
    line.firstChild.textContent = `${l.a} – ${l.b}: ${linkLabel(l)}`;
    label.textContent = linkLabel(l);
  }
  for (const s of snap.sites) {
    const g = svg.querySelector(`g.site[data-site="${CSS.escape(s.name)}"]`);
    if (!g) continue;
    const r = 7 + 11 * Math.min(1, s.load || 0);
    g.setAttribute("class", `site health-${s.health}` + (S.selected === s.name ? " selected" : ""));
    g.dataset.health = s.health;
    g.querySelector("circle").setAttribute("r", r);
    g.querySelector("circle").setAttribute("class", `health-${s.health}`);
    g.querySelector("title").textContent = `${s.name} (${s.tier}): ${s.health}${s.why ? " — " + s.why : ""}`;
    g.querySelector("text").setAttribute("x", g.dataset.labelSide === "left" ? -(r + 3) : r + 3);
  }
  renderSitePanel();
}

function renderSitePanel() {
  const panel = $("#site-panel");
  const s = S.snap && S.snap.sites.find((x) => x.name === S.selected);
  if (!s) return;
  const variants = el("table", { class: "grid compact" },
    el("thead", {}, el("tr", {}, ["variant", "task", "queue", "wait ms", "memory"].map((h) => el("th", { text: h })))),
    el("tbody", {}, (s.variants || []).map((v) => el("tr", { "data-variant": v.id },
      el("td", { text: v.id }), el("td", { text: v.task }),
      el("td", { text: v.queue_depth !== null ? fmt(v.queue_depth, 0) : String(v.queued_rows) }),
      el("td", { text: fmt(v.queue_ms, 1) }), el("td", { text: mib(v.memory_bytes) })))));
  const p99 = Object.entries(s.p99_ms || {}).map(([task, ms]) => {
    const slo = (s.slo_budget_ms || {})[task];
    const cls = slo === undefined ? "" : (ms <= slo ? "good" : "bad");
    return el("div", {}, `${task}: p99 `, el("b", { class: cls, text: `${fmt(ms, 1)} ms` }),
              slo !== undefined ? ` vs SLO ${fmt(slo, 0)} ms` : "");
  });
  panel.replaceChildren(...[
    el("h3", { text: s.name }),
    el("div", {}, el("span", { class: `badge health-${s.health}`, text: s.health }), ` ${s.tier} · ${s.region} · ${s.real_hardware_class || s.hardware_class}`),
    s.why ? el("div", { class: "warn", text: s.why }) : null,
    el("div", { text: `in flight ${s.inflight ?? "–"} / ${s.capacity ?? "–"} · ${fmt(s.qps, 1)} q/s · served ${s.served ?? "–"} · forwarded ${s.forwarded ?? "–"}` }),
    el("div", { text: `model memory ${mib(s.memory_used_bytes)} of ${mib(s.memory_budget_bytes)}` }),
    el("h4", { text: "variants loaded" }), variants,
    el("h4", { text: "latency" }), p99.length ? p99 : el("div", { class: "muted", text: "no data (no /metrics yet)" }),
    s.metrics_error ? el("div", { class: "muted", text: `metrics: ${s.metrics_error}` }) : null].flat().filter((n) => n));
}

// -- placements and events -------------------------------------------------------------------------
function renderPlacements() {
  const snap = S.snap;
  if (!snap) return;
  $("#placement-table tbody").replaceChildren(...snap.sites.map((s) => el("tr", { "data-site": s.name },
    el("td", { text: s.name }), el("td", {}, el("span", { class: `badge health-${s.health}`, text: s.health })),
    el("td", { text: (s.placement || []).join(", ") || "–" }),
    el("td", { text: (s.variants || []).map((v) => v.id).join(", ") || "–" }))));
  // catalog entries every reader skips (a duplicate id, a value that does not decode): shown until removed
  const broken = snap.catalog_broken || [];
  $("#catalog-broken").hidden = !broken.length;
  $("#catalog-broken").replaceChildren(...(broken.length ? [
    el("strong", { text: `${broken.length} broken catalog ${broken.length === 1 ? "entry" : "entries"}, skipped ` +
                         "(tiermesh variants remove takes them out):" }),
    el("ul", {}, broken.map((b) => el("li", { text: `${b.key}: ${b.reason}` })))] : []));
  const events = snap.events || [];
  $("#event-table tbody").replaceChildren(...events.slice().reverse().map((e) => el("tr", { class: `ev-${e.action}` },
    el("td", { text: when(e.ts) }), el("td", { text: e.action }), el("td", { text: e.site }),
    el("td", { text: e.variant_id }), el("td", { text: e.reason }), el("td", { text: e.leader || "" }))));
  const svg = $("#timeline");
  svg.replaceChildren();
  const stamped = events.filter((e) => e.ts);
  if (!stamped.length) { svg.append(el("text", { x: 20, y: 30, class: "link-label", text: "no placement events yet" })); return; }
  const names = snap.sites.map((s) => s.name).concat(["*"]);
  const t0 = Math.min(...stamped.map((e) => e.ts)), t1 = Math.max(...stamped.map((e) => e.ts), t0 + 1);
  const x = (t) => 130 + (800 * (t - t0)) / (t1 - t0);
  const y = (site) => 18 + (190 * Math.max(0, names.indexOf(site))) / Math.max(1, names.length - 1);
  const colour = { load: "#2fb36b", evict: "#e03131", prewarm: "#4aa3ff", replicate: "#c678dd", mode: "#8493a3" };
  names.forEach((n) => svg.append(el("text", { x: 4, y: y(n) + 4, class: "link-label", text: n }),
                                   el("line", { x1: 130, x2: 930, y1: y(n), y2: y(n), class: "graticule" })));
  for (const e of stamped) {
    svg.append(el("circle", { cx: x(e.ts), cy: y(e.site), r: 5, fill: colour[e.action] || "#e6a700" },
      el("title", { text: `${when(e.ts)} ${e.action} ${e.variant_id} at ${e.site}: ${e.reason}` })));
  }
  svg.append(el("text", { x: 130, y: 216, class: "link-label", text: when(t0) }),
             el("text", { x: 930, y: 216, class: "link-label", "text-anchor": "end", text: when(t1) }));
}

// -- tenants ---------------------------------------------------------------------------------
function renderTenants() {
  const snap = S.snap;
  if (!snap) return;
  $("#tenants-nodata").hidden = !!snap.metrics;
  $("#tenant-table tbody").replaceChildren(...snap.tenants.map((t) => {
    const classes = Object.entries(t.classes || {});
    const cells = classes.length ? classes.map(([c, v]) => el("span", { class: "cls", "data-class": c },
      `${c}: `, el("b", { class: v.attainment === null ? "" : (v.attainment >= 0.95 ? "good" : "bad"), "data-attainment": v.attainment ?? "",
                         text: pct(v.attainment) }), el("span", { class: "muted", text: ` (${v.met}/${v.met + v.missed})` })))
      : [el("span", { class: "muted", text: "no data" })];
    return el("tr", { "data-tenant": t.name }, el("td", { text: t.name }), el("td", { text: t.isolation || "–" }),
      el("td", { text: `${fmt(t.qps, 1)} (${t.quota_qps ?? "∞"})` }), el("td", { text: fmt(t.requests, 0) }),
      el("td", { class: t.rejections ? "warn" : "", text: fmt(t.rejections, 0) }), el("td", {}, cells));
  }));
  if (S.tab !== "tenants") return;
  const box = $("#tenant-charts");
  for (const t of snap.tenants) {
    const classes = Object.keys(t.series || {});
    if (!classes.length) continue;
    const xs = (t.series[classes[0]] || []).map((p) => p[0]);
    const data = [xs, ...classes.map((c) => (t.series[c] || []).map((p) => p[1] === null ? null : 100 * p[1]))];
    let chart = S.charts[t.name];
    if (chart && chart.series.length !== classes.length + 1) { chart.destroy(); chart.root.parentNode.remove(); chart = null; }
    if (!chart) {
      const holder = el("div", { class: "chart", "data-tenant": t.name }, el("h4", { text: `${t.name}: SLO attainment % (10 s window)` }));
      box.append(holder);
      chart = new uPlot({ width: 440, height: 180, scales: { y: { range: [0, 100] } },
        axes: [{ stroke: "#8493a3", grid: { stroke: "#1e2833" } }, { stroke: "#8493a3", grid: { stroke: "#1e2833" } }],
        series: [{}, ...classes.map((c, i) => ({ label: c, stroke: COLORS[i % COLORS.length], width: 2, spanGaps: false }))] },
        data, holder);
      S.charts[t.name] = chart;
    } else {
      chart.setData(data);
    }
  }
}

// -- traces ----------------------------------------------------------------------------------
async function lookupTrace(id) {
  const out = $("#trace-result");
  out.replaceChildren(el("p", { class: "muted", text: `looking up ${id}…` }));
  const resp = await fetch(`/api/traces/${encodeURIComponent(id)}`);
  const body = await resp.json().catch(() => ({}));
  if (!resp.ok) { out.replaceChildren(el("p", { class: "bad", id: "trace-error", text: body.error || `HTTP ${resp.status}` })); return; }
  out.replaceChildren(el("div", { id: "trace-summary" },
    el("b", { text: body.request_id }), ` · tenant ${body.tenant} · task ${body.task} · outcome ${body.outcome} · answered by ${body.answered_by}` +
      (body.trace_id ? ` · trace ${body.trace_id}` : "")),
    ...(body.hops || []).map((h, i) => {
      const chosen = h.choice || null;
      const rows = (h.candidates || []).map((c) => {
        const isChoice = chosen && c.site === chosen.site && c.variant === chosen.variant;
        return el("tr", { class: isChoice ? "chosen" : (c.feasible ? "feasible" : "rejected"), "data-feasible": String(!!c.feasible) },
          el("td", { text: c.site }), el("td", { text: c.variant }), el("td", { text: fmt(c.network_ms, 1) }),
          el("td", { text: fmt(c.queue_ms, 1) }), el("td", { text: fmt(c.compute_ms, 1) }), el("td", { text: fmt(c.load_ms, 1) }),
          el("td", { text: c.latency_ms === undefined ? "–" : fmt(c.latency_ms, 1) }),
          el("td", { text: c.cost === null || c.cost === undefined ? "–" : (Math.abs(c.cost) < 0.01 && c.cost !== 0 ? Number(c.cost).toExponential(2) : fmt(c.cost, 4)) }), el("td", { text: c.feasible ? (isChoice ? "chosen" : "feasible") : (c.why_not || "rejected") }));
      });
      const tm = h.timings_ms || {};
      return el("div", { class: "hop", "data-hop": i, "data-site": h.site },
        el("div", {}, el("b", { text: `hop ${i + 1}: ${h.site}` }), ` (${h.role}) at ${when(h.at_unix)}`),
        el("div", { text: chosen ? `choice: ${chosen.variant} at ${chosen.site} — ${chosen.reason}` : "no choice at this hop" }),
        el("div", { class: "muted", text: `network ${fmt(tm.network, 1)} · queue ${fmt(tm.queue, 1)} · compute ${fmt(tm.compute, 1)} · total ${fmt(tm.total, 1)} ms` }),
        rows.length ? el("table", { class: "grid candidates" },
          el("thead", {}, el("tr", {}, ["site", "variant", "net ms", "queue ms", "compute ms", "load ms", "latency ms", "cost $", "verdict"].map((x) => el("th", { text: x })))),
          el("tbody", {}, rows)) : null);
    }));
}

async function loadRecentTraces() {
  const resp = await fetch("/api/traces?limit=20").catch(() => null);
  const body = resp && resp.ok ? await resp.json() : { traces: [] };
  const tb = $("#recent-traces tbody");
  tb.replaceChildren(...(body.traces || []).map((t) => el("tr", {},
    el("td", {}, el("a", { href: "#traces", text: t.request_id, on: { click: () => { $("#trace-id").value = t.request_id; lookupTrace(t.request_id); } } })),
    el("td", { text: t.site }), el("td", { text: t.tenant || "" }), el("td", { text: t.task || "" }), el("td", { text: t.outcome || "" }))));
  if (!tb.children.length) tb.append(el("tr", {}, el("td", { colspan: 5, class: "muted", text: "no data: no agent lists traces" })));
}

// -- jobs ------------------------------------------------------------------------------------
const sitesText = (m) => Object.entries(m || {}).map(([s, n]) => `${s} (${n})`).join(", ") || "–";

async function loadJobs() {
  const resp = await fetch("/api/jobs").catch(() => null);
  const body = resp && resp.ok ? await resp.json() : { tenants: [] };
  const tenants = body.tenants || [];
  $("#job-tenants tbody").replaceChildren(...tenants.map((t) => el("tr", {}, el("td", { text: t.tenant }),
    ...["queued", "running", "done", "failed", "cancelled"].map((s) => el("td", { text: String(t.counts[s] || 0) })),
    el("td", { text: `${t.rows_done} / ${t.rows}` }))));
  const rows = tenants.flatMap((t) => t.jobs.map((j) => el("tr", { class: j.late ? "late" : null },
    el("td", { text: t.tenant }), el("td", { text: j.id.slice(0, 12), title: j.id }), el("td", { text: j.task }),
    el("td", { text: j.state + (j.error ? `: ${j.error}` : "") }), el("td", { text: `${j.chunks_done} / ${j.chunks}` }),
    el("td", { text: `${j.rows_done} / ${j.rows} (${pct(j.progress)})` }), el("td", { text: sitesText(j.working) }),
    el("td", { text: sitesText(j.ran) }), el("td", { text: when(j.deadline) + (j.late ? " (late)" : "") }))));
  const tb = $("#job-table tbody");
  tb.replaceChildren(...rows);
  if (!tb.children.length) tb.append(el("tr", {}, el("td", { colspan: 9, class: "muted", text: "no jobs" })));
  clearTimeout(S.jobsTimer);  // one refresh chain, however often the tab is shown
  if (S.tab === "jobs") S.jobsTimer = setTimeout(() => { if (S.tab === "jobs") loadJobs(); }, 2000);
}

// -- topology --------------------------------------------------------------------------------
function diffList(title, cls, obj) {
  const keys = Object.keys(obj || {});
  if (!keys.length) return null;
  return el("div", { class: cls }, el("b", { text: `${title} (${keys.length})` }),
    el("ul", {}, keys.map((k) => el("li", { text: cls === "diff-changed" ? `${k}: ${JSON.stringify(obj[k].old)} → ${JSON.stringify(obj[k].new)}` : `${k}: ${JSON.stringify(obj[k])}` }))));
}

async function loadTopology() {
  const resp = await fetch("/api/topology").catch(() => null);
  if (!resp || !resp.ok) return;
  const body = await resp.json();
  const la = body.last_apply;
  $("#last-apply").replaceChildren(...(la ? [
    el("div", { text: `${new Date(la.ts * 1000).toLocaleString()}: ${la.summary} (digest ${String(la.digest).slice(0, 12)})` }),
    diffList("added", "diff-added", la.added), diffList("changed", "diff-changed", la.changed),
    diffList("removed", "diff-removed", la.removed)] : [el("span", { text: "no apply recorded" })]).filter((n) => n));
  $("#topology-yaml").textContent = (la && la.source) || body.yaml || "no topology applied";
}

// -- live updates ----------------------------------------------------------------------------
function render() {
  if (!S.snap) return;
  if (S.tab === "map") renderMap();
  renderPlacements();
  renderTenants();
  const snap = S.snap;
  $("#status-text").textContent = `live · etcd rev ${snap.revision}${snap.etcd_connected ? "" : " (etcd lost)"} · ` +
    `${snap.sites.filter((s) => s.health === "up").length}/${snap.sites.length} sites up` + (snap.metrics ? "" : " · no metrics") +
    ((snap.catalog_broken || []).length ? ` · ${snap.catalog_broken.length} broken catalog entries` : "");
  if (S.tab === "topology" && snap.topology_digest !== S.topologyDigest) { S.topologyDigest = snap.topology_digest; loadTopology(); }
}

function connect() {
  const es = new EventSource("/api/stream");
  es.addEventListener("state", (ev) => {
    S.snap = JSON.parse(ev.data);
    $("#live-dot").className = "dot on";
    document.body.dataset.version = S.snap.version;
    render();
  });
  es.onerror = () => { $("#live-dot").className = "dot off"; $("#status-text").textContent = "disconnected, retrying…"; };
}

async function main() {
  $("#trace-form").addEventListener("submit", (ev) => { ev.preventDefault(); const id = $("#trace-id").value.trim(); if (id) lookupTrace(id); });
  showTab((location.hash || "#map").slice(1));
  connect();
  try {
    const topo = await (await fetch("/static/vendor/land-110m.json")).json();
    S.land = topojson.feature(topo, topo.objects.land);
    render();
  } catch (e) { S.land = null; }
}
main();
