// tiermesh console: the Builds, Cascades & pipelines and Versions tabs (issues 34 and 33). Loaded before console.js; uses its helpers
// ($, el, S, fmt, pct, when) only when a tab is shown, so the order of definition does not matter.
"use strict";

// -- builds ----------------------------------------------------------------------------------
const kib = (b) => (b === null || b === undefined) ? "–" : (b / 1024).toFixed(1) + " KiB";
const p50Text = (m) => Object.entries(m || {}).map(([hw, ms]) => `${hw} ${fmt(ms, 2)} ms`).join(", ") || "no latency yet";

function buildVariants(b) {
  if (!b.variants.length) return el("span", { class: "muted", text: b.state === "done" ? "none built" : "–" });
  return el("ul", {}, b.variants.map((v) => el("li", { "data-variant": v.variant,
    text: `${v.variant}: ${pct(v.accuracy)} · ${kib(v.size_bytes)} · ${p50Text(v.p50_ms)}` })),
    b.skipped.map((k) => el("li", { class: "muted", text: `${k.kind} skipped: ${k.reason}` })));
}

async function loadBuilds() {
  const resp = await fetch("/api/builds").catch(() => null);
  const body = resp && resp.ok ? await resp.json() : { tenants: [] };
  const tenants = body.tenants || [];
  $("#build-tenants tbody").replaceChildren(...tenants.map((t) => el("tr", { "data-tenant": t.tenant }, el("td", { text: t.tenant }),
    ...["queued", "running", "done", "failed"].map((s) => el("td", { text: String(t.counts[s] || 0) })))));
  const rows = tenants.flatMap((t) => t.builds.map((b) => el("tr", { "data-build": b.id, class: `build-${b.state}` },
    el("td", { text: t.tenant }), el("td", { text: b.id.slice(0, 12), title: b.id }), el("td", { text: b.task }),
    el("td", { text: b.family }),
    el("td", { text: b.state + (b.stage && b.state === "running" ? ` (${b.stage})` : "") +
      (b.error ? `: ${b.error}` : "") + (b.reason ? ` [${b.reason}]` : "") }),
    el("td", { text: pct(b.progress) }), el("td", {}, buildVariants(b)), el("td", { text: when(b.updated) }))));
  const tb = $("#build-table tbody");
  tb.replaceChildren(...rows);
  if (!tb.children.length) tb.append(el("tr", {}, el("td", { colspan: 8, class: "muted", text: "no builds" })));
  clearTimeout(S.buildsTimer);  // one refresh chain, however often the tab is shown
  if (S.tab === "builds") S.buildsTimer = setTimeout(() => { if (S.tab === "builds") loadBuilds(); }, 2000);
}

// -- cascades --------------------------------------------------------------------------------
async function loadCascades() {
  const resp = await fetch("/api/cascades").catch(() => null);
  const body = resp && resp.ok ? await resp.json() : { tasks: [], broken: [], scrape_errors: {} };
  const tasks = body.tasks || [];
  const broken = body.broken || [];
  $("#cascade-broken").hidden = !broken.length;
  $("#cascade-broken").replaceChildren(...(broken.length ? [el("b", { text: `${broken.length} broken cascade entries (skipped by every reader)` }),
    el("ul", {}, broken.map((b) => el("li", { "data-key": b.key, text: `${b.key}: ${b.reason}` })))] : []));
  const errs = Object.entries(body.scrape_errors || {});
  $("#cascade-errors").hidden = !errs.length;
  $("#cascade-errors").textContent = errs.length ? "no counters from: " + errs.map(([s, e]) => `${s} (${e})`).join(", ") : "";
  const crow = tasks.flatMap((t) => t.cascades.map((c) => el("tr", { "data-cascade": c.id, "data-task": t.task },
    el("td", { text: t.task }), el("td", { text: c.id }), el("td", { text: c.stages.join(" → ") }),
    el("td", { text: `${c.rule} ≥ ${c.thresholds.map((x) => fmt(x, 3)).join(", ")}` }),
    el("td", { text: `${pct(c.accuracy)} (${pct(c.target_accuracy)}) on ${c.heldout_rows} rows` }),
    el("td", { text: c.escalation.map(pct).join(", ") }))));
  const tb = $("#cascade-table tbody");
  tb.replaceChildren(...crow);
  if (!tb.children.length) tb.append(el("tr", {}, el("td", { colspan: 6, class: "muted", text: "no cascades catalogued" })));
  const srow = tasks.flatMap((t) => t.sites.map((s) => el("tr", { "data-site": s.site, "data-task": t.task },
    el("td", { text: t.task }), el("td", { text: s.site }), el("td", { text: String(s.local) }), el("td", { text: String(s.escalated) }),
    el("td", { text: pct(s.escalation_rate), "data-rate": s.escalation_rate === null ? "" : String(s.escalation_rate) }),
    el("td", { text: Object.entries(s.rows || {}).map(([st, n]) => `stage ${st}: ${n}`).join(", ") || "–" }))));
  const sb = $("#cascade-sites tbody");
  sb.replaceChildren(...srow);
  if (!sb.children.length) sb.append(el("tr", {}, el("td", { colspan: 6, class: "muted", text: "no data: no door has answered by a cascade yet" })));
  await loadPipelines().catch(() => null);  // its own failure must not stop the refresh chain
  clearTimeout(S.cascadesTimer);  // one refresh chain, however often the tab is shown
  if (S.tab === "cascades") S.cascadesTimer = setTimeout(() => { if (S.tab === "cascades") loadCascades(); }, 2000);
}

// -- pipelines (on the cascades tab, refreshed with it) ---------------------------------------
const outcomeText = (m) => Object.entries(m || {}).map(([k, n]) => `${k}: ${n}`).join(", ") || "–";
const msText = (v) => (v === null || v === undefined) ? "–" : fmt(v, 1) + " ms";

async function loadPipelines() {
  const resp = await fetch("/api/pipelines").catch(() => null);
  const body = resp && resp.ok ? await resp.json() : { tasks: [], scrape_errors: {} };
  const tasks = body.tasks || [];
  const errs = Object.entries(body.scrape_errors || {});
  $("#pipeline-errors").hidden = !errs.length;
  $("#pipeline-errors").textContent = errs.length ? "no pipeline counters from: " + errs.map(([s, e]) => `${s} (${e})`).join(", ") : "";
  const prow = tasks.map((t) => el("tr", { "data-task": t.task },
    el("td", { text: t.task }), el("td", { text: t.kind || "no longer declared" }),
    el("td", { text: t.declared.join(t.kind === "switch" ? " ⇒ " : " → ") || "–" }),
    el("td", { text: t.accuracy === null ? "not measured" : pct(t.accuracy) }),
    el("td", { text: String(t.queries), "data-queries": String(t.queries) }), el("td", { text: outcomeText(t.outcomes) }),
    el("td", { text: t.sites.map((s) => `${s.site}: ${outcomeText(s.outcomes)}`).join("; ") || "–" })));
  const tb = $("#pipeline-table tbody");
  tb.replaceChildren(...prow);
  if (!tb.children.length) tb.append(el("tr", {}, el("td", { colspan: 7, class: "muted", text: "no pipelines declared" })));
  const srow = tasks.flatMap((t) => t.stages.map((s) => el("tr", { "data-task": t.task, "data-stage": s.stage, "data-stage-task": s.stage_task },
    el("td", { text: t.task }), el("td", { text: s.stage }), el("td", { text: s.stage_task }), el("td", { text: String(s.count) }),
    el("td", { text: msText(s.p50_ms), "data-p50": s.p50_ms === null ? "" : String(s.p50_ms) }),
    el("td", { text: msText(s.p95_ms), "data-p95": s.p95_ms === null ? "" : String(s.p95_ms) }), el("td", { text: msText(s.mean_ms) }))));
  const sb = $("#pipeline-stages tbody");
  sb.replaceChildren(...srow);
  if (!sb.children.length) sb.append(el("tr", {}, el("td", { colspan: 7, class: "muted", text: "no data: no door has answered a pipeline yet" })));
}

// -- versions --------------------------------------------------------------------------------
async function loadVersions() {
  const resp = await fetch("/api/versions").catch(() => null);
  const body = resp && resp.ok ? await resp.json() : { tasks: [], broken: [], scrape_errors: {} };
  const tasks = body.tasks || [];
  const broken = body.broken || [];
  $("#version-broken").hidden = !broken.length;
  $("#version-broken").replaceChildren(...(broken.length ? [el("b", { text: `${broken.length} broken version records` }),
    el("ul", {}, broken.map((b) => el("li", { "data-key": b.key, text: `${b.key}: ${b.reason}` })))] : []));
  const errs = Object.entries(body.scrape_errors || {});
  $("#version-errors").hidden = !errs.length;
  $("#version-errors").textContent = errs.length ? "no counters from: " + errs.map(([s, e]) => `${s} (${e})`).join(", ") : "";
  const rows = tasks.flatMap((t) => t.versions.map((v) => el("tr", { "data-task": t.task, "data-version": String(v.version),
    class: `version-${v.state || "gone"}` },
    el("td", { text: t.owner }), el("td", { text: t.task }),
    el("td", { text: String(v.version) + (v.version === t.active ? " (active)" : "") }),
    el("td", { text: (v.state || "no record") + (v.state === "retiring" && v.retire_at ? ` until ${when(v.retire_at)}` : "") }),
    el("td", { text: v.family || "–" }), el("td", { text: v.state === "building" ? "–" : pct(v.accuracy) }),
    el("td", { text: pct(v.share), "data-share": String(v.share) }),
    el("td", { text: String(v.queries), "data-queries": String(v.queries) }),
    el("td", { text: Object.entries(v.sites || {}).map(([s, n]) => `${s}: ${n}`).join(", ") || "–" }))));
  const tb = $("#version-table tbody");
  tb.replaceChildren(...rows);
  if (!tb.children.length) tb.append(el("tr", {}, el("td", { colspan: 9, class: "muted", text: "no versioned tasks" })));
  clearTimeout(S.versionsTimer);  // one refresh chain, however often the tab is shown
  if (S.tab === "versions") S.versionsTimer = setTimeout(() => { if (S.tab === "versions") loadVersions(); }, 2000);
}
