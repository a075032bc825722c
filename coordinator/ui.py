"""The status page (``GET /ui``): one self-contained, read-only HTML page, and the summary it reads.

The page is static — inline CSS and JavaScript, no external asset, no font, no CDN — and holds
no data: its script fetches the admin API (``/v1/summary``, ``/v1/workers``, ``/v1/pools``,
``/v1/events``) every :data:`REFRESH_MS` and renders the answers. So the API's rules are the
page's: a bearer token when one is configured (the page asks for it and keeps it in
``sessionStorage``; ``/ui#token=…`` hands it over once, in a fragment no server or proxy logs),
loopback clients only when none is (``admin.auth_middleware`` applies that to ``/ui`` too).

Everything shown comes from the network, so nothing is parsed as HTML: the script builds the
DOM with ``createElement`` and text nodes only, and the Content-Security-Policy admits the
page's own script and style (by hash), requests to its own origin, and nothing else.

Hit and validated-hit rates and fallbacks come from the workers: only a worker knows what it
looked up, what passed validation and why it recomputed. Each heartbeat carries its counters
since its process started (:class:`shared.messages.CacheCounters`), which the ledger keeps in
memory like the load (never logged). :func:`cache_summary` adds up the latest report of every
live worker epoch; a restarted worker (a new epoch) starts again from zero.

Severity: a pool's row and usage cell carry ``sev-ok``, ``sev-warn`` or ``sev-crit`` (green,
amber, red) from ``coordinator.ui_warn_usage`` and ``coordinator.ui_critical_usage`` (0.8 and
0.95 by default; ``/v1/summary`` hands them to the page); a lost worker is ``sev-crit``, a
suspended or draining one ``sev-warn``, and every fallback reason but none is ``sev-warn``.

Events: the page reads the latest :data:`EVENT_WINDOW` events and shows them grouped by request
(a lease's events and every replica commit under it are one row with a count; other events by
stream), newest first, at
most :data:`EVENTS` groups, with a filter by type, so one busy request cannot fill the view.
Replicas are named by their tier and the worker's reported device (``device:w1 (cpu)``), not
by the ledger's location key (``gpu:w1``), which names the tier's role whatever the hardware.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from aiohttp import web

from coordinator.core import LedgerState
from shared.messages import CacheCounters

REFRESH_MS = 2000
#: Stream groups the page lists.
EVENTS = 20
#: Latest events read to build them.
EVENT_WINDOW = 200


def _rate(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def _counts(c: CacheCounters) -> dict[str, Any]:
    return {"queried_tokens": c.queried, "hit_tokens": c.hits, "validated_tokens": c.validated,
            "hit_rate": _rate(c.hits, c.queried), "validated_hit_rate": _rate(c.validated, c.queried),
            "fallbacks": dict(sorted(c.fallbacks.items()))}


def cache_summary(state: LedgerState, reports: dict[str, tuple[int, CacheCounters]]) -> dict[str, Any]:
    """Prefix-cache counters per live worker epoch (its latest heartbeat's) and their sums.

    A report counts only while its epoch is its worker's current, alive one: a fenced epoch's
    process is gone, and a new one's counters start from zero."""
    by_worker = []
    queried = hits = validated = 0
    fallbacks: dict[str, int] = {}
    for wid, w in sorted(state.workers.items()):
        epoch, c = reports.get(wid, (0, None))
        if not w.alive or c is None or epoch != w.epoch:
            continue
        by_worker.append({"worker_id": wid, "epoch": epoch, **_counts(c)})
        queried, hits, validated = queried + c.queried, hits + c.hits, validated + c.validated
        for reason, n in c.fallbacks.items():
            fallbacks[reason] = fallbacks.get(reason, 0) + n
    total = CacheCounters(queried=queried, hits=hits, validated=validated, fallbacks=fallbacks)
    return {"reporting": len(by_worker), **_counts(total), "by_worker": by_worker}


# --- the page ---------------------------------------------------------------------------------

_STYLE = """
:root { color-scheme: light dark; --muted: #777; --bad: #c62828; --ok: #2e7d32; }
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5rem; }
h1 { font-size: 1.3rem; margin: 0 0 .3rem; } h2 { font-size: 1.05rem; margin: 1.4rem 0 .4rem; }
table { border-collapse: collapse; } th, td { padding: .2rem .7rem .2rem 0; text-align: left; vertical-align: top; }
td { white-space: nowrap; } td[data-k=detail] { white-space: normal; }
th { border-bottom: 1px solid var(--muted); font-weight: 600; } td.n, th.n { text-align: right; }
#status { color: var(--muted); } body[data-state=error] #status, #auth-error { color: var(--bad); }
body[data-state=error] main { opacity: .55; }
.big { font-size: 1.6rem; font-weight: 600; }
.tiles { display: flex; gap: .8rem 2.5rem; flex-wrap: wrap; margin-bottom: .8rem; }
.muted { color: var(--muted); } .live { color: var(--ok); } .lost, .suspended { color: var(--bad); }
td.sev-ok { background: #c8e6c9; color: #1b5e20; } td.sev-warn { background: #ffb300; color: #000; }
td.sev-crit { background: #d50000; color: #fff; font-weight: 600; }
meter { width: 8rem; }
code, .mono { font-family: ui-monospace, monospace; font-size: 12px; }
"""

_SCRIPT = """
"use strict";
const REFRESH_MS = %(refresh)d, EVENTS = %(events)d, WINDOW = %(window)d, KEY = "kvledger.admin_token";
const $ = (id) => document.getElementById(id);
// A token handed over as /ui#token=... (a fragment is never sent to a server) is kept for this
// tab and removed from the address bar.
(() => {
  const m = /^#token=(.+)$/.exec(location.hash);
  if (m) {
    sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);
  }
})();

class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path) {
  const headers = {Accept: "application/json"};
  const token = sessionStorage.getItem(KEY);
  if (token) headers.Authorization = "Bearer " + token;
  const r = await fetch(path, {headers, cache: "no-store", credentials: "omit", redirect: "error"});
  let body = null;
  try { body = await r.json(); } catch (e) { /* not JSON: the status says enough */ }
  if (!r.ok) throw new HttpError(r.status, (body && body.error && body.error.message) || ("HTTP " + r.status));
  return body;
}

// The only way anything reaches the page: elements and text nodes, never markup.
function el(tag, data, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(data || {})) e.dataset[k] = String(v);
  e.append(...children.map((c) => (c instanceof Node ? c : String(c ?? ""))));
  return e;
}
const td = (k, value, ctx, cls) => { const e = el("td", {k, ...ctx}, value); if (cls) e.className = cls; return e; };
const pct = (x) => (x === null || x === undefined ? "–" : (x * 100).toFixed(1) + " %%");
// now: the coordinator's clock at the summary; a heartbeat may land before /v1/workers answers
const ago = (now, t) => (t ? (Math.max(0, now - t) / 1000).toFixed(1) + " s ago" : "never");

function rows(id, list, empty) {
  const body = $(id);
  const cols = body.parentElement.querySelectorAll("th").length;
  if (!list.length) {
    const c = el("td", {}, empty); c.colSpan = cols; c.className = "muted";
    body.replaceChildren(el("tr", {}, c));
  } else {
    body.replaceChildren(...list);
  }
}

const DETAIL = ["worker_id", "epoch", "kind", "lease_id", "usable_blocks", "scope", "value", "form", "location",
                "from_state", "to_state", "enabled", "reason"];
let devices = {};   // worker -> the device its heartbeats report
// A replica's place by its tier and the worker's device: the ledger's "gpu:w1" is the device pool
// of w1, whatever w1 computes on.
function place(loc) {
  const m = /^gpu:(.+)$/.exec(loc);
  if (!m) return loc;
  return "device:" + m[1] + (devices[m[1]] ? " (" + devices[m[1]] + ")" : "");
}
function detail(ev) {
  const src = Object.assign({}, ev.transition || {}, ev);
  const out = [];
  for (const k of DETAIL) {
    let v = src[k];
    if (v === null || v === undefined || v === "" || typeof v === "object") continue;
    if (k === "location") v = place(String(v));
    out.push(k + "=" + String(v).slice(0, 120));
  }
  return out.join(" ");
}
const sev = (usage, t) => (usage === null || usage === undefined ? "" :
  usage >= t.critical ? "sev-crit" : usage >= t.warn ? "sev-warn" : "sev-ok");

// One row per request (its lease's events and every replica commit under that lease), else per
// stream; newest first.
function groupKey(e) {
  const src = Object.assign({}, (e.event && e.event.transition) || {}, e.event || {});
  return src.lease_id ? "lease:" + src.lease_id : e.stream_id;
}
function groups(events, type) {
  const by = new Map();
  for (const e of events) {
    if (type && e.type !== type) continue;
    const key = groupKey(e);
    const g = by.get(key) || {stream: key, count: 0, types: new Set(), last: e};
    g.count += 1; g.types.add(e.type);
    if (e.position >= g.last.position) g.last = e;
    by.set(key, g);
  }
  return [...by.values()].sort((a, b) => b.last.position - a.last.position).slice(0, EVENTS);
}

let lastEvents = [];
function renderEvents() {
  const sel = $("event_type"), type = sel.value;
  const types = [...new Set(lastEvents.map((e) => e.type))].sort();
  sel.replaceChildren(el("option", {}, "every type"), ...types.map((t) => { const o = el("option", {}, t); o.value = t; return o; }));
  sel.firstChild.value = "";
  sel.value = types.includes(type) ? type : "";
  rows("events", groups(lastEvents, sel.value).map((g) => {
    const ctx = {stream: g.stream}, e = g.last;
    return el("tr", ctx, td("stream", g.stream.replace(/gpu:([^:]+)$/, (_, w) => place("gpu:" + w)), ctx, "mono"),
              td("count", g.count, ctx, "n"),
              td("types", [...g.types].sort().join(", "), ctx, "mono"), td("position", e.position, ctx, "n"),
              td("recorded_at", e.recorded_at.slice(0, 23), ctx, "mono"), td("detail", detail(e.event), ctx, "mono"));
  }), "no event yet");
}

function render(s, workers, pools, events) {
  const c = s.cache, t = s.thresholds;
  devices = {};
  for (const w of workers.workers) if (w.device) devices[w.worker_id] = w.device;
  $("leader").textContent = "leader epoch " + s.leader_epoch + ", log position " + s.position + ", reuse " + s.reuse;
  $("thresholds").textContent = "amber from " + pct(t.warn) + ", red from " + pct(t.critical) + " of a pool's slots";
  for (const k of ["hit_rate", "validated_hit_rate"]) $(k).textContent = pct(c[k]);
  for (const k of ["queried_tokens", "hit_tokens", "validated_tokens", "reporting"]) $(k).textContent = String(c[k]);
  const n = {live: 0, suspended: 0, lost: 0, draining: 0};
  for (const w of workers.workers) {
    n[!w.alive ? "lost" : w.suspended ? "suspended" : "live"] += 1;
    n.draining += w.alive && w.draining ? 1 : 0;
  }
  $("worker_counts").textContent =
    n.live + " live, " + n.suspended + " suspended, " + n.lost + " lost, " + n.draining + " draining";

  rows("workers", workers.workers.map((w) => {
    const ctx = {worker: w.worker_id};
    const state = !w.alive ? "lost" : w.suspended ? "suspended" : "live";
    const level = state === "lost" ? "sev-crit" : state === "suspended" || w.draining ? "sev-warn" : "sev-ok";
    return el("tr", ctx, td("worker_id", w.worker_id, ctx, "mono"), td("epoch", w.epoch, ctx, "n"),
              td("state", state, ctx, state + " " + level), td("liveness", ago(s.now_ms, w.last_heartbeat_ms), ctx, "n"),
              td("draining", w.draining ? "yes" : "no", ctx), td("leases", w.leases, ctx, "n"),
              td("model", w.model_id, ctx, "mono"), td("device", w.device || "–", ctx, "mono"),
              td("dtype", w.dtype || "–", ctx, "mono"), td("cache_dtype", w.cache_dtype || "–", ctx, "mono"),
              td("endpoint", w.endpoint, ctx, "mono"));
  }), "no worker registered");

  const poolRows = [];
  for (const p of pools.pools) {
    for (const [form, f] of Object.entries(p.forms)) {
      const ctx = {pool: p.worker_id, form, severity: sev(f.usage, t) || "none"};
      const bar = el("meter"); bar.min = 0; bar.max = f.limit || 1; bar.value = f.used;
      bar.low = t.warn * (f.limit || 1); bar.high = t.critical * (f.limit || 1); bar.optimum = 0;
      poolRows.push(el("tr", ctx, td("worker_id", place("gpu:" + p.worker_id), ctx, "mono"), td("form", form, ctx),
                       td("used", f.used, ctx, "n"), td("limit", f.limit, ctx, "n"),
                       td("usage", pct(f.usage), ctx, "n " + sev(f.usage, t)), el("td", {}, bar)));
    }
  }
  rows("pools", poolRows, "no live worker");

  const tierRows = [];
  for (const [tier, places] of Object.entries(pools.tiers || {})) {
    if (!Object.keys(places).length) {   // every tier is listed: an empty one says so
      tierRows.push(el("tr", {tier}, td("tier", tier, {tier, place: ""}), td("place", "none", {tier, place: ""}, "muted"),
                       td("replicas", 0, {tier, place: ""}, "n")));
    }
    for (const [where, count] of Object.entries(places)) {
      const ctx = {tier, place: where};
      tierRows.push(el("tr", ctx, td("tier", tier, ctx), td("place", tier === "device" ? place("gpu:" + where) : where, ctx, "mono"),
                       td("replicas", count, ctx, "n")));
    }
  }
  rows("tiers", tierRows, "no replica is ready in any tier");

  rows("gateways", (s.gateways || []).map((g) => {
    const ctx = {gateway: g.gateway_id};
    return el("tr", ctx, td("gateway_id", g.gateway_id, ctx, "mono"), td("last_route", ago(s.now_ms, g.last_route_ms), ctx, "n"));
  }), "no gateway has asked for a route since this coordinator leads");

  rows("cache", c.by_worker.map((w) => {
    const ctx = {reporter: w.worker_id};
    const fb = Object.values(w.fallbacks).reduce((a, b) => a + b, 0);
    return el("tr", ctx, td("worker_id", w.worker_id, ctx, "mono"), td("epoch", w.epoch, ctx, "n"),
              td("queried_tokens", w.queried_tokens, ctx, "n"), td("hit_tokens", w.hit_tokens, ctx, "n"),
              td("validated_tokens", w.validated_tokens, ctx, "n"), td("hit_rate", pct(w.hit_rate), ctx, "n"),
              td("validated_hit_rate", pct(w.validated_hit_rate), ctx, "n"),
              td("fallbacks", fb, ctx, "n" + (fb ? " sev-warn" : "")));
  }), "no worker has reported its counters yet");

  rows("fallbacks", Object.entries(c.fallbacks).map(([reason, count]) =>
    el("tr", {reason}, td("reason", reason, {reason}, "mono"), td("count", count, {reason}, "n sev-warn"))),
    "no fallback");

  lastEvents = events.events;
  renderEvents();
}

function setState(state, text) {
  document.body.dataset.state = state;
  $("status").textContent = text;
}

let timer = 0, lastOk = "never";
async function refresh() {
  clearTimeout(timer);
  try {
    const s = await api("/v1/summary");
    const after = Math.max(0, s.position - WINDOW);
    const [workers, pools, events] = await Promise.all(
      [api("/v1/workers"), api("/v1/pools"), api("/v1/events?after=" + after + "&limit=" + WINDOW)]);
    render(s, workers, pools, events);
    $("auth").hidden = true;
    lastOk = new Date().toISOString().slice(11, 19) + " UTC";
    setState("ok", "updated at " + lastOk + "; refreshes every " + REFRESH_MS / 1000 + " s");
  } catch (e) {
    if (e instanceof HttpError && e.status === 401) {
      $("auth-error").textContent = e.message;
      $("auth").hidden = false;
      setState("auth", "the admin API wants a token");
      return;  // until one is given
    }
    setState("error", "the coordinator does not answer: " + e.message + " (last update: " + lastOk + ")");
  }
  timer = setTimeout(refresh, REFRESH_MS);
}

$("auth").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY, $("token").value.trim());
  $("token").value = "";
  refresh();
});
$("event_type").addEventListener("change", renderEvents);
$("forget").addEventListener("click", () => { sessionStorage.removeItem(KEY); refresh(); });
refresh();
""" % {"refresh": REFRESH_MS, "events": EVENTS, "window": EVENT_WINDOW}

_BODY = """
<header>
  <h1>kvledger coordinator</h1>
  <div id="leader" class="muted"></div>
  <div id="status">loading…</div>
  <form id="auth" hidden autocomplete="off">
    <p>This coordinator's admin API wants its bearer token (<code>KVL_ADMIN_TOKEN</code>). It is kept in this
      tab only (sessionStorage).</p>
    <p id="auth-error"></p>
    <input id="token" type="password" size="40" aria-label="admin token"> <button type="submit">use token</button>
  </form>
</header>
<main>
  <h2>Prefix cache (since each worker process started)</h2>
  <div class="tiles">
    <div><div class="big" id="hit_rate">–</div>hit rate (offered / queried)</div>
    <div><div class="big" id="validated_hit_rate">–</div>validated hit rate (reused / queried)</div>
    <div><div class="big" id="queried_tokens">–</div>prompt tokens queried</div>
    <div><div class="big" id="hit_tokens">–</div>offered (hash hits)</div>
    <div><div class="big" id="validated_tokens">–</div>reused after validation</div>
    <div><div class="big" id="reporting">–</div>workers reporting</div>
  </div>
  <table><thead><tr><th>worker</th><th class="n">epoch</th><th class="n">queried tokens</th>
    <th class="n">hit tokens</th><th class="n">validated tokens</th><th class="n">hit rate</th>
    <th class="n">validated hit rate</th><th class="n">fallback requests</th>
  </tr></thead><tbody id="cache"></tbody></table>
  <h2>Fallbacks by reason (requests that recomputed more than the cache offered)</h2>
  <table><thead><tr><th>reason</th><th class="n">requests</th></tr></thead><tbody id="fallbacks"></tbody></table>
  <h2>Workers <span id="worker_counts" class="muted"></span></h2>
  <table><thead><tr><th>worker</th><th class="n">epoch</th><th>state</th><th class="n">last heartbeat</th>
    <th>draining</th><th class="n">leases</th><th>model</th><th>device</th><th>compute dtype</th>
    <th>cache dtype</th><th>endpoint</th></tr></thead><tbody id="workers"></tbody></table>
  <h2>Gateways (route queries seen by this leader)</h2>
  <table><thead><tr><th>gateway</th><th class="n">last route query</th></tr></thead><tbody id="gateways"></tbody></table>
  <h2>Device pools per worker and form <span id="thresholds" class="muted"></span></h2>
  <table><thead><tr><th>device pool</th><th>form</th><th class="n">used slots</th><th class="n">total slots</th>
    <th class="n">usage</th><th></th></tr></thead><tbody id="pools"></tbody></table>
  <h2>Live replicas per tier (device pools, host memory, disk; counted every 5 s at most)</h2>
  <table><thead><tr><th>tier</th><th>where</th><th class="n">replicas</th></tr></thead><tbody id="tiers"></tbody></table>
  <h2>Latest events by request <label class="muted">type <select id="event_type"></select></label></h2>
  <table><thead><tr><th>request (lease) or stream</th><th class="n">events</th><th>types</th><th class="n">last position</th>
    <th>last recorded at (UTC)</th><th>last event</th></tr></thead><tbody id="events"></tbody></table>
</main>
<footer class="muted"><p>Read-only. <button id="forget" type="button">forget token</button>
  API: <code>/openapi.json</code>.</p></footer>
"""


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


PAGE = ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        "<meta name=\"referrer\" content=\"no-referrer\"><title>kvledger status</title>"
        f"<style>{_STYLE}</style></head>\n<body data-state=\"loading\">{_BODY}<script>{_SCRIPT}</script>"
        "</body></html>\n").encode()

#: Only this page's own script and style run; it may talk to its own origin and nothing else.
CSP = ("default-src 'none'; "
       f"script-src {_sha256(_SCRIPT)}; style-src {_sha256(_STYLE)}; connect-src 'self'; "
       "img-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

HEADERS = {"Content-Type": "text/html; charset=utf-8", "Content-Security-Policy": CSP,
           "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY"}


async def status_page(request: web.Request) -> web.Response:
    """The status page (static; its data comes from the admin API, under the API's rules)."""
    return web.Response(body=PAGE, headers=HEADERS)
