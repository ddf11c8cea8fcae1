// The cpgbroker dashboard: polls the management API of the member that served this page and
// draws what it says. Plain JavaScript run as it is (no build step, no library).
//
// The login the user types is kept in sessionStorage (gone with the tab) and sent as HTTP
// Basic on every /api request, as RabbitMQ's management UI does. The history behind the
// sparklines and rates lives in this page only: the API answers with the present, and a
// member keeps no history for it.
//
// Names that clients chose (queues, connections, users) are only ever put in the page as
// text (textContent), never as markup.
"use strict";

// RabbitMQ's UI refreshes every 5 s by default; 2 s shows a failover as it happens.
const POLL_MS = 2000;
// Samples kept per queue: 5 minutes at one every POLL_MS.
const HISTORY = 150;
// A sparkline spans at least this many samples (one minute): a new page's first samples do
// not fill the width as if they were minutes of history.
const SPAN_MIN = 30;
// Members report how far they have applied the stream at least every this many events
// (cluster/progress.py, PROGRESS_EVERY): a member less than this behind is no news.
const PROGRESS_EVERY = 1000;
// A request that takes longer than this counts as the member not answering.
const REQUEST_TIMEOUT_MS = 5000;
const STORE_KEY = "cpgbroker.dashboard.login";
const MONITOR_TAGS = ["administrator", "monitoring"];
const SVG_NS = "http://www.w3.org/2000/svg";

const state = {
  auth: null, // the Authorization header's value
  user: "",
  timer: null,
  // Bumped at each log-out: a poll still in flight from before then does not go on polling.
  round: 0,
  lastOk: 0,
  // "vhost\0name" -> [{t, ready, unacked, publish, deliver}], oldest first; publish and
  // deliver are the queue's counters (null when the member gives none)
  queueHistory: new Map(),
  // [{t, seq}] of the answering member's event sequence, oldest first
  events: [],
  // node name -> {member, state, running, gone}: every member this page has seen, so that
  // one that left the membership (killed, stopped, cut off) is still listed, as gone.
  members: new Map(),
};

class AuthError extends Error {}

// ---------------------------------------------------------------------------------- helpers

function $(id) {
  return document.getElementById(id);
}

// An element with attributes and children (strings become text nodes, never markup).
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (key === "dataset") Object.assign(node.dataset, value);
    else if (key === "className") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) {
    if (child === null || child === undefined) continue;
    node.append(typeof child === "string" || typeof child === "number" ? String(child) : child);
  }
  return node;
}

function fact(list, term, ...desc) {
  list.append(el("dt", null, term), el("dd", null, ...desc));
}

function badge(text, kind) {
  return el("span", { className: `badge ${kind}` }, text);
}

function stateKind(name) {
  if (name === "ready" || name === "standalone") return "ok";
  if (name === "gone") return "bad";
  return "warn";
}

function clock(t) {
  return new Date(t).toLocaleTimeString();
}

function fmt(n) {
  return typeof n === "number" ? n.toLocaleString("en") : "–";
}

// Base64 of the UTF-8 bytes (btoa alone takes Latin-1 only).
function base64(text) {
  let binary = "";
  for (const byte of new TextEncoder().encode(text)) binary += String.fromCharCode(byte);
  return btoa(binary);
}

async function api(path) {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(), REQUEST_TIMEOUT_MS);
  let response;
  try {
    response = await fetch(path, {
      headers: { Authorization: state.auth, Accept: "application/json" },
      // No browser-kept credentials, and so no browser login prompt on a 401: the page
      // sends its own.
      credentials: "omit",
      cache: "no-store",
      signal: controller.signal,
    });
  } catch (e) {
    throw new Error(controller.signal.aborted ? "no answer in time" : "no connection");
  } finally {
    clearTimeout(timer);
  }
  if (response.status === 401) {
    let reason = "the login was refused";
    try {
      const body = await response.json();
      if (body && body.reason && body.reason !== "Not_Authorized") reason = body.reason;
    } catch (e) {
      // not JSON: keep the generic reason
    }
    throw new AuthError(reason);
  }
  if (!response.ok) throw new Error(`${path} answered ${response.status}`);
  return response.json();
}

// ---------------------------------------------------------------------------------- login

function showLogin(message) {
  $("main").hidden = true;
  $("logout").hidden = true;
  $("who").textContent = "";
  $("poll-state").textContent = "";
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("username").focus();
}

async function login(user, password) {
  state.auth = "Basic " + base64(`${user}:${password}`);
  state.user = user;
  const me = await api("/api/whoami");
  if (!MONITOR_TAGS.some((t) => (me.tags || []).includes(t))) {
    throw new AuthError(
      `${user} may not see the cluster's members (tag administrator or monitoring needed)`,
    );
  }
  sessionStorage.setItem(STORE_KEY, JSON.stringify({ user, auth: state.auth }));
}

function logout(message) {
  state.round += 1;
  clearTimeout(state.timer);
  state.timer = null;
  state.auth = null;
  sessionStorage.removeItem(STORE_KEY);
  showLogin(message);
}

function start() {
  $("login").hidden = true;
  $("main").hidden = false;
  $("logout").hidden = false;
  $("who").textContent = state.user;
  poll();
}

// ---------------------------------------------------------------------------------- polling

async function poll() {
  const round = state.round;
  state.timer = null;
  try {
    const [overview, nodes, queues, connections] = await Promise.all([
      api("/api/overview"),
      api("/api/nodes"),
      api("/api/queues"),
      api("/api/connections"),
    ]);
    if (round !== state.round) return;
    const now = Date.now();
    state.lastOk = now;
    remember(now, overview, nodes, queues);
    render(overview, nodes, queues, connections);
    $("banner").hidden = true;
    $("poll-state").textContent = `updated ${clock(now)}`;
  } catch (e) {
    if (round !== state.round) return;
    if (e instanceof AuthError) {
      logout(e.message);
      return;
    }
    const since = state.lastOk ? `; showing what it said at ${clock(state.lastOk)}` : "";
    $("banner").textContent = `${location.host} does not answer (${e.message})${since}.`;
    $("banner").hidden = false;
    $("poll-state").textContent = "not answering";
  }
  state.timer = setTimeout(poll, POLL_MS);
}

function push(list, sample) {
  list.push(sample);
  if (list.length > HISTORY) list.splice(0, list.length - HISTORY);
}

function remember(now, overview, nodes, queues) {
  const listed = new Set();
  for (const n of nodes) {
    listed.add(n.name);
    state.members.set(n.name, {
      member: n.cpgbroker_member,
      state: n.cpgbroker_state || (n.running ? "running" : "stopped"),
      running: n.running,
      memAlarm: n.mem_alarm,
      diskAlarm: n.disk_free_alarm,
      gone: null,
    });
  }
  for (const [name, m] of state.members) {
    if (!listed.has(name) && m.gone === null) {
      m.gone = now;
      m.running = false;
    }
  }
  const seen = new Set();
  for (const q of queues) {
    const key = `${q.vhost}\u0000${q.name}`;
    seen.add(key);
    if (!state.queueHistory.has(key)) state.queueHistory.set(key, []);
    const stats = q.message_stats || {};
    push(state.queueHistory.get(key), {
      t: now,
      ready: q.messages_ready || 0,
      unacked: q.messages_unacknowledged || 0,
      publish: typeof stats.publish === "number" ? stats.publish : null,
      deliver: typeof stats.deliver_get === "number" ? stats.deliver_get : null,
    });
  }
  for (const key of [...state.queueHistory.keys()]) {
    if (!seen.has(key)) state.queueHistory.delete(key); // deleted queues
  }
  const cluster = overview.cpgbroker_cluster;
  if (cluster && typeof cluster.event_seq === "number") {
    push(state.events, { t: now, seq: cluster.event_seq });
  }
}

// Per second, between the oldest and newest of the last few samples (one interval alone is
// noisy: a poll that comes late doubles it).
function rate(samples, value) {
  const recent = samples.slice(-5);
  if (recent.length < 2) return null;
  const first = recent[0];
  const last = recent[recent.length - 1];
  const seconds = (last.t - first.t) / 1000;
  return seconds > 0 ? (value(last) - value(first)) / seconds : null;
}

// How much a counter grew from one sample to the next. The queues' counters count since the
// answering member has had the queue: they restart from 0 when it takes a state update (or
// the queue is deleted and declared again), so a decrease is a restart, after which it counted
// its present value.
function growth(before, after) {
  return after >= before ? after - before : after;
}

// A counter's growth per second over the last few samples, as rate() does; null when a
// sample has no value for it.
function counterRate(samples, value) {
  const recent = samples.slice(-5);
  if (recent.length < 2 || recent.some((s) => value(s) === null)) return null;
  let grown = 0;
  for (let i = 1; i < recent.length; i++) grown += growth(value(recent[i - 1]), value(recent[i]));
  const seconds = (recent.at(-1).t - recent[0].t) / 1000;
  return seconds > 0 ? grown / seconds : null;
}

// A queue's publish and deliver rates between each two successive samples, for its sparkline.
function intervalRates(samples) {
  const out = [];
  for (let i = 1; i < samples.length; i++) {
    const [a, b] = [samples[i - 1], samples[i]];
    const seconds = (b.t - a.t) / 1000;
    if (seconds <= 0 || [a.publish, a.deliver, b.publish, b.deliver].includes(null)) continue;
    out.push({
      t: b.t,
      publish: growth(a.publish, b.publish) / seconds,
      deliver: growth(a.deliver, b.deliver) / seconds,
    });
  }
  return out;
}

function perSecondText(r) {
  return r === null ? "–" : `${r.toFixed(r >= 10 || r === 0 ? 0 : 1)}/s`;
}

// ---------------------------------------------------------------------------------- drawing

// A small line chart of the samples (newest at the right edge), one line per series.
function sparkline(samples, series, width = 140, height = 28) {
  const svg = document.createElementNS(SVG_NS, "svg");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  svg.setAttribute("class", "spark");
  let max = 1;
  for (const s of samples) for (const { value } of series) max = Math.max(max, value(s));
  // One sample draws as a short flat line, not as nothing.
  const drawn = samples.length === 1 ? [samples[0], samples[0]] : samples;
  const step = width / (Math.max(SPAN_MIN, drawn.length) - 1);
  const x0 = width - (drawn.length - 1) * step;
  for (const { value, className } of series) {
    const points = drawn.map((s, i) => {
      const y = height - 1 - (value(s) / max) * (height - 2);
      return `${(x0 + i * step).toFixed(1)},${y.toFixed(1)}`;
    });
    const line = document.createElementNS(SVG_NS, "polyline");
    line.setAttribute("points", points.join(" "));
    line.setAttribute("class", className);
    svg.append(line);
  }
  const title = document.createElementNS(SVG_NS, "title");
  const minutes = samples.length > 1 ? ((samples.at(-1).t - samples[0].t) / 60000).toFixed(1) : "0";
  title.textContent = `highest ${fmt(max)} over the last ${minutes} min`;
  svg.append(title);
  return svg;
}

function render(overview, nodes, queues, connections) {
  const cluster = overview.cpgbroker_cluster || {};
  $("cluster-name").textContent = `${overview.cluster_name} · page served by ${overview.node}`;
  const byId = new Map(nodes.map((n) => [n.cpgbroker_member, n.name]));
  const nameOf = (id) => byId.get(id) || `member ${id}`;
  const perNode = new Map();
  for (const c of connections) perNode.set(c.node, (perNode.get(c.node) || 0) + 1);
  renderTotals(overview);
  renderMembers(overview, perNode);
  renderReplication(overview, cluster, nameOf);
  renderActivity(cluster, nameOf);
  renderQueues(queues);
  renderConnections(connections);
}

function renderTotals(overview) {
  const o = overview.object_totals || {};
  const q = overview.queue_totals || {};
  const eventRate = rate(state.events, (s) => s.seq);
  const tiles = [
    ["Members", [...state.members.values()].filter((m) => m.gone === null).length],
    ["Queues", o.queues],
    ["Ready", q.messages_ready],
    ["Unacked", q.messages_unacknowledged],
    ["Connections", o.connections],
    ["Channels", o.channels],
    ["Consumers", o.consumers],
    ["Events/s", eventRate === null ? "–" : Math.round(eventRate)],
  ];
  $("totals").replaceChildren(
    ...tiles.map(([label, value]) =>
      el(
        "div",
        { className: "tile" },
        el("div", { className: "value" }, fmt(value)),
        el("div", { className: "label" }, label),
      ),
    ),
  );
}

// How far behind the answering member a member is, by the progress it last reported.
function behindCell(eventSeq, p) {
  const td = el("td", { className: "num behind" });
  if (!p || typeof p.applied !== "number" || typeof eventSeq !== "number") {
    td.append(el("span", { className: "muted" }, "no report yet"));
    return td;
  }
  const behind = eventSeq - p.applied;
  td.dataset.behind = String(behind);
  if (behind < 0) {
    td.append(el("span", { className: "muted" }, `${fmt(-behind)} ahead`));
  } else if (behind > PROGRESS_EVERY) {
    td.append(badge(fmt(behind), "warn"));
  } else {
    td.append(fmt(behind));
    td.title = `members report their progress at least every ${fmt(PROGRESS_EVERY)} events`;
  }
  return td;
}

// Whether a member's digest agreed with the others' at the last checkpoint.
function digestCell(p, checkpoint) {
  const agreed = p ? p.checkpoint_agreed : undefined;
  const td = el("td", { className: "digest" });
  td.dataset.agreed = agreed === true ? "yes" : agreed === false ? "no" : "unknown";
  if (agreed === true) td.append(badge("agreed", "ok"));
  else if (agreed === false) td.append(badge("differs", "bad"));
  else td.append(el("span", { className: "muted" }, p ? "no checkpoint yet" : "–"));
  if (checkpoint && typeof agreed === "boolean") td.title = `at event ${fmt(checkpoint.seq)}`;
  return td;
}

function renderMembers(overview, perNode) {
  const cluster = overview.cpgbroker_cluster || {};
  const progress = new Map((cluster.members || []).map((p) => [p.member, p]));
  const rows = [];
  const names = [...state.members.keys()].sort();
  for (const name of names) {
    const m = state.members.get(name);
    const p = m.gone === null ? progress.get(m.member) : undefined;
    const shown = m.gone === null ? m.state : "gone";
    const alarms = [m.memAlarm ? "memory" : null, m.diskAlarm ? "disk" : null].filter(Boolean);
    rows.push(
      el(
        "tr",
        { dataset: { node: name, state: shown }, className: m.gone === null ? "" : "gone" },
        el(
          "td",
          null,
          name,
          name === overview.node ? el("span", { className: "muted" }, " (answering)") : null,
        ),
        el("td", { className: "num" }, m.gone === null ? String(m.member) : "–"),
        el("td", null, badge(shown, stateKind(shown))),
        el("td", null, m.running ? "yes" : "no"),
        m.gone === null ? behindCell(cluster.event_seq, p) : el("td", { className: "num" }, "–"),
        digestCell(p, cluster.checkpoint),
        el("td", { className: "num" }, m.gone === null ? fmt(perNode.get(name) || 0) : "–"),
        el("td", null, alarms.length ? badge(alarms.join(", "), "bad") : "none"),
        el("td", null, m.gone === null ? "now" : `left at ${clock(m.gone)}`),
      ),
    );
  }
  $("members").tBodies[0].replaceChildren(...rows);
  $("members-note").textContent =
    `As ${overview.node} sees the membership. Behind: the events it applied beyond what the ` +
    `member last reported (members report at least every ${fmt(PROGRESS_EVERY)} events: ` +
    "fewer is normal). Digest: whether the member's digest agreed with the others' at the last " +
    "checkpoint. A member that leaves (stopped, crashed or cut off) stays listed as gone.";
}

function renderReplication(overview, c, nameOf) {
  const dl = $("replication");
  dl.replaceChildren();
  if (c.state === undefined) {
    fact(dl, "Not shown", "this login may not see the cluster's state");
    return;
  }
  const me = c.member === null || c.member === undefined ? overview.node : nameOf(c.member);
  fact(dl, "Answering member", `${me} (${c.state})`);
  if (c.clock_master !== undefined && c.clock_master !== null) {
    fact(dl, "Clock master", nameOf(c.clock_master));
  }
  // Events per second between polls: the cluster's activity (clock ticks included).
  const perSecond = state.events.slice(1).map((s, i) => {
    const before = state.events[i];
    return {
      t: s.t,
      v: Math.max(0, s.seq - before.seq) / Math.max(0.001, (s.t - before.t) / 1000),
    };
  });
  const line = [{ value: (s) => s.v, className: "total" }];
  const spark = perSecond.length ? sparkline(perSecond, line, 120, 20) : null;
  fact(dl, "Events applied", fmt(c.event_seq), " ", spark);
  const lag = c.lag || null;
  if (lag) {
    fact(
      dl,
      "Lag",
      lag.events_behind > 0
        ? badge(
            `slowest member ${fmt(lag.events_behind)} events behind`,
            // Members report their progress every 1,000 events: less is no news.
            lag.events_behind > 1000 ? "warn" : "ok",
          )
        : badge("none", "ok"),
      ` · sends held back for lag: ${fmt(lag.held_back)}`,
    );
  }
  const cp = c.checkpoint;
  if (cp) {
    fact(
      dl,
      "Digest checkpoint",
      badge(cp.agreed ? "all members agreed" : "digests differ", cp.agreed ? "ok" : "bad"),
      ` at event ${fmt(cp.seq)}`,
      (cp.losers || []).length ? ` (${cp.losers.map(nameOf).join(", ")} differ)` : "",
      " · ",
      el("code", null, String(cp.digest).slice(0, 16)),
    );
  } else {
    fact(dl, "Digest checkpoint", "none yet");
  }
  const q = c.quorum;
  if (q) {
    const votes = q.votes === undefined ? "" : ` · ${q.votes} of ${q.expected_votes} votes`;
    const needed = q.quorum === undefined ? "" : `, ${q.quorum} needed`;
    const quorate = badge(q.quorate ? "quorate" : "no quorum", q.quorate ? "ok" : "bad");
    fact(dl, "Quorum", quorate, votes + needed);
  }
}

function renderActivity(c, nameOf) {
  const dl = $("activity");
  dl.replaceChildren();
  if (c.state === undefined) {
    fact(dl, "Not shown", "this login may not see the cluster's state");
    return;
  }
  const checks = c.error_checks || {};
  const pending = Object.entries(checks.pending || {});
  if (checks.held_at !== null && checks.held_at !== undefined) {
    fact(dl, "Error check", badge(`holding at event ${fmt(checks.held_at)}`, "warn"));
  } else {
    fact(
      dl,
      "Error check",
      pending.length ? badge(`${pending.length} round(s) open`, "warn") : badge("none open", "ok"),
    );
  }
  for (const [seq, round] of pending) {
    const waiting = (round.waiting_for || []).map(nameOf).join(", ") || "nobody";
    fact(dl, `Round at ${fmt(Number(seq))}`, `waiting for ${waiting}`);
  }
  const decided = (checks.decided || []).slice(-3).reverse();
  for (const r of decided) {
    const leaving = (r.leaving || []).map(nameOf);
    fact(
      dl,
      `Decided at ${fmt(r.seq)}`,
      `${r.decision}`,
      leaving.length ? badge(`leaving: ${leaving.join(", ")}`, "bad") : null,
    );
  }
  const sending = c.updating || [];
  const receiving = c.update;
  if (!sending.length && !receiving) fact(dl, "State update", badge("none in progress", "ok"));
  for (const u of sending) {
    fact(
      dl,
      "State update",
      badge("sending", "warn"),
      ` to ${nameOf(u.newcomer)}, state of event ${fmt(u.seq)}`,
    );
  }
  if (receiving) {
    const total = receiving.total_messages ? ` of ${fmt(receiving.total_messages)}` : "";
    fact(
      dl,
      "State update",
      badge("receiving", "warn"),
      ` from ${nameOf(receiving.updater)}: ${fmt(receiving.messages)}${total} messages, ` +
        `${fmt(receiving.bytes)} bytes, ${receiving.seconds} s`,
    );
  }
}

function renderQueues(queues) {
  const sorted = [...queues].sort((a, b) =>
    (a.vhost + "\u0000" + a.name).localeCompare(b.vhost + "\u0000" + b.name),
  );
  const rows = sorted.map((q) => {
    const samples = state.queueHistory.get(`${q.vhost}\u0000${q.name}`) || [];
    const publish = counterRate(samples, (s) => s.publish);
    const deliver = counterRate(samples, (s) => s.deliver);
    const rates = intervalRates(samples);
    return el(
      "tr",
      { dataset: { vhost: q.vhost, queue: q.name } },
      el("td", null, q.vhost),
      el("td", null, q.name),
      el("td", null, q.type || "classic"),
      el("td", { className: "num" }, fmt(q.messages_ready)),
      el("td", { className: "num" }, fmt(q.messages_unacknowledged)),
      el("td", { className: "num" }, fmt(q.consumers)),
      el("td", { className: "num publish" }, perSecondText(publish)),
      el("td", { className: "num deliver" }, perSecondText(deliver)),
      el(
        "td",
        null,
        sparkline(samples, [
          { value: (s) => s.ready + s.unacked, className: "total" },
          { value: (s) => s.unacked, className: "unacked" },
        ]),
      ),
      el(
        "td",
        null,
        rates.length
          ? sparkline(rates, [
              { value: (s) => s.publish, className: "publish" },
              { value: (s) => s.deliver, className: "deliver" },
            ])
          : null,
      ),
    );
  });
  $("queues").tBodies[0].replaceChildren(...rows);
  $("queues-empty").hidden = rows.length > 0;
}

function renderConnections(connections) {
  const groups = new Map();
  for (const c of connections) {
    if (!groups.has(c.node)) groups.set(c.node, []);
    groups.get(c.node).push(c);
  }
  const rows = [];
  for (const node of [...groups.keys()].sort()) {
    const list = groups.get(node).sort((a, b) => a.name.localeCompare(b.name));
    rows.push(
      el(
        "tr",
        { className: "group", dataset: { node } },
        el(
          "td",
          { colspan: "7" },
          node,
          el(
            "span",
            { className: "muted" },
            ` · ${list.length} connection${list.length === 1 ? "" : "s"}`,
          ),
        ),
      ),
    );
    for (const c of list) {
      // The name the client gave its connection (RabbitMQ shows it too), else its product.
      const props = c.client_properties || {};
      const label = props.connection_name || props.product;
      rows.push(
        el(
          "tr",
          { dataset: { node } },
          el("td", null, ""),
          el("td", null, c.name, label ? el("span", { className: "muted" }, ` ${label}`) : null),
          el("td", null, c.user),
          el("td", null, c.vhost),
          el("td", { className: "num" }, fmt(c.channels)),
          el("td", null, c.ssl ? "yes" : "no"),
          el("td", null, c.state),
        ),
      );
    }
  }
  $("connections").tBodies[0].replaceChildren(...rows);
  $("connections-empty").hidden = rows.length > 0;
}

// ---------------------------------------------------------------------------------- start

document.addEventListener("DOMContentLoaded", () => {
  $("login-form").addEventListener("submit", async (event) => {
    event.preventDefault();
    $("login-error").textContent = "";
    $("login-button").disabled = true;
    try {
      await login($("username").value, $("password").value);
      $("password").value = "";
      start();
    } catch (e) {
      state.auth = null;
      $("login-error").textContent =
        e instanceof AuthError ? e.message : `cannot log in: ${e.message}`;
    } finally {
      $("login-button").disabled = false;
    }
  });
  $("logout").addEventListener("click", () => logout(""));
  const saved = sessionStorage.getItem(STORE_KEY);
  if (saved) {
    try {
      const { user, auth } = JSON.parse(saved);
      state.user = user;
      state.auth = auth;
      start();
      return;
    } catch (e) {
      sessionStorage.removeItem(STORE_KEY);
    }
  }
  showLogin("");
});
