// The dashboard of `aggregator serve --http`: polls api/state and draws it. No framework, no build
// step, no network beyond this server. Every string from the fleet (device ids, reasons) is set as
// text, never as HTML: devices choose their ids and reasons, so they are untrusted.
"use strict";

const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2563eb", "#d97706", "#059669", "#dc2626", "#7c3aed", "#0891b2", "#db2777", "#65a30d"];
const token = new URLSearchParams(location.search).get("token");

function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

const color = (k) => COLORS[k % COLORS.length];
const ago = (t, now) => (t ? `${Math.max(0, Math.round(now - t))} s ago` : "-");
const clock = (t) => (t ? new Date(t * 1000).toLocaleTimeString() : "-");
const bytes = (n) => (n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB` : n >= 1024 ? `${(n / 1024).toFixed(1)} KiB` : `${n} B`);

function fill(tbody, rows, emptyText, columns) {
  tbody.replaceChildren(...(rows.length ? rows : [el("tr", {}, el("td", { class: "empty", colspan: columns }, emptyText))]));
}

function device(d) {
  const s = d.device || {};
  const parts = [s.machine, s.system, s.cpus && `${s.cpus} CPUs`,
    s.mem_available_mb != null && `${s.mem_available_mb}/${s.mem_total_mb ?? "?"} MiB free`,
    s.cpu_percent != null && `CPU ${Math.round(s.cpu_percent)}%`];
  return parts.filter(Boolean).join(", ") || "-";
}

function drawDevices(state) {
  const rows = state.devices.map((d) => el("tr", { "data-client": d.id },
    el("td", {}, d.id),
    el("td", { class: d.gone ? "gone" : d.online ? "online" : "offline" }, d.gone || (d.online ? "online" : "offline")),
    el("td", {}, ago(d.last_seen, state.time)),
    el("td", {}, device(d)),
    el("td", {}, d.max_submodel ? `≤ ${d.max_submodel}` : "nothing"),
    el("td", { class: "reason" }, d.reason || "-"),
    el("td", {}, d.assigned ? `${d.assigned} (round ${d.assigned_round})` : "-"),
    el("td", {}, d.last_loss != null ? `${d.last_loss.toFixed(3)} (round ${d.last_round})` : "-")));
  fill(document.querySelector("#devices tbody"), rows, "no device has announced yet", 8);
  document.getElementById("device-count").textContent =
    `${state.clients_online} online, ${state.clients_ready} can train, ${state.devices.length} shown`;
}

// a line chart of fractions over x, the y axis up to the next quarter above the data;
// series: [{name, color, points: [[x, y], ...]}]
function lineChart(series, xs, label) {
  const W = 560, H = 240, L = 40, R = 10, T = 10, B = 30;
  const xmin = Math.min(...xs), xmax = Math.max(...xs, xmin + 1);
  const top = Math.max(...series.flatMap((s) => s.points.map((p) => p[1])));
  const ymax = Math.min(1, Math.max(0.2, Math.ceil(top * 10 + 1e-9) / 10));
  const tick = ymax <= 0.6 ? 0.1 : 0.2;
  const X = (x) => L + ((x - xmin) / (xmax - xmin)) * (W - L - R);
  const Y = (y) => T + (1 - y / ymax) * (H - T - B);
  const svg = el("svg:svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": label });
  for (let i = 0; i * tick <= ymax + 1e-9; i++) {
    const y = i * tick;
    svg.append(el("svg:line", { class: "axis", x1: L, x2: W - R, y1: Y(y), y2: Y(y) }),
      el("svg:text", { x: L - 6, y: Y(y) + 4, "text-anchor": "end" }, `${Math.round(y * 100)}%`));
  }
  const step = Math.max(1, Math.ceil((xmax - xmin) / 10));
  for (let x = xmin; x <= xmax; x += step) svg.append(el("svg:text", { x: X(x), y: H - 10, "text-anchor": "middle" }, x));
  for (const s of series) {
    const d = s.points.map(([x, y], i) => `${i ? "L" : "M"}${X(x).toFixed(1)},${Y(y).toFixed(1)}`).join(" ");
    svg.append(el("svg:path", { class: "series", d, fill: "none", stroke: s.color, "stroke-width": 2, "data-submodel": s.name }));
    for (const [x, y] of s.points) {
      svg.append(el("svg:circle", { cx: X(x), cy: Y(y), r: 3, fill: s.color, "data-submodel": s.name, "data-round": x },
        el("svg:title", {}, `submodel ${s.name}, round ${x}: ${(y * 100).toFixed(1)}%`)));
    }
  }
  return svg;
}

function legend(names) {
  return el("div", { class: "legend" }, ...names.map((n, k) => {
    const swatch = el("i");
    swatch.style.background = color(k);
    return el("span", {}, swatch, `submodel ${n}`);
  }));
}

function drawAccuracy(state) {
  const rows = state.rounds_history.filter((r) => Array.isArray(r.accuracy) && r.accuracy.length);
  const box = document.getElementById("accuracy");
  if (!rows.length) {
    box.replaceChildren(el("p", { class: "empty" }, "no evaluated round yet (serve with --eval-dataset)"));
    return;
  }
  const n = Math.max(...rows.map((r) => r.accuracy.length));
  const series = [...Array(n).keys()].map((k) => ({
    name: k + 1, color: color(k), points: rows.filter((r) => r.accuracy[k] != null).map((r) => [r.round, r.accuracy[k]]),
  }));
  box.replaceChildren(lineChart(series, rows.map((r) => r.round), "test accuracy per submodel over rounds"),
    legend(series.map((s) => s.name)));
}

function drawBytes(state) {
  const rows = state.rounds_history.filter((r) => r.round >= 1).slice(-40);
  const box = document.getElementById("bytes");
  if (!rows.length) {
    box.replaceChildren(el("p", { class: "empty" }, "no closed round yet"));
    return;
  }
  const W = 560, H = 240, L = 60, B = 30, T = 10;
  const top = Math.max(1, ...rows.map((r) => Math.max(r.bytes_in, r.bytes_out)));
  const slot = (W - L) / rows.length, bar = Math.min(24, Math.max(2, slot / 2 - 2));
  const Y = (v) => T + (1 - v / top) * (H - T - B);
  const svg = el("svg:svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "aria-label": "bytes per round" });
  for (const f of [0, 0.5, 1]) {
    svg.append(el("svg:line", { class: "axis", x1: L, x2: W, y1: Y(top * f), y2: Y(top * f) }),
      el("svg:text", { x: L - 6, y: Y(top * f) + 4, "text-anchor": "end" }, bytes(Math.round(top * f))));
  }
  rows.forEach((r, i) => {
    const x = L + i * slot;
    for (const [j, v, c, what] of [[0, r.bytes_out, "#2563eb", "sent"], [1, r.bytes_in, "#d97706", "received"]]) {
      svg.append(el("svg:rect", { x: x + j * (bar + 1), y: Y(v), width: bar, height: Y(0) - Y(v), fill: c, "data-round": r.round },
        el("svg:title", {}, `round ${r.round}: ${bytes(v)} ${what}`)));
    }
    svg.append(el("svg:text", { x: x + bar, y: H - 10, "text-anchor": "middle" }, r.round));
  });
  const key = (c, t) => { const i = el("i"); i.style.background = c; return el("span", {}, i, t); };
  box.replaceChildren(svg, el("div", { class: "legend" }, key("#2563eb", "sent (models, tasks)"), key("#d97706", "received (updates)")));
}

function drawRounds(state) {
  const yes = (v) => el("td", { class: v === false ? "no" : "" }, v == null ? "-" : v ? "yes" : "no");
  const rows = state.rounds_history.filter((r) => r.round >= 1).slice(-30).reverse().map((r) => {
    const n = r.participants;
    const declined = Object.entries(r.declined);
    const buffered = r.mode === "buffered";  // a committed version: its updates' staleness, no deadline
    const closed = buffered ? `version ${r.round}: staleness ${r.staleness.join(", ") || "-"}`
      : r.reports >= n ? "all reported"
      : r.went_offline.length ? `without ${r.went_offline.join(", ")} (offline)` : "at its deadline";
    return el("tr", { "data-round": r.round, "data-staleness": buffered ? r.staleness.join(",") : "" },
      el("td", {}, buffered ? `v${r.round}` : r.round), el("td", {}, clock(r.opened)), el("td", {}, r.wall_s != null ? `${r.wall_s} s` + (r.deadline_s ? ` (deadline ${r.deadline_s} s)` : "") : "-"),
      el("td", {}, closed), el("td", {}, buffered ? `${r.staleness.length} (${r.reports} devices)` : `${r.reports}/${n}`),
      el("td", { class: "reason" }, declined.length ? declined.map(([c, why]) => `${c}: ${why}`).join("; ")
        : r.declines ? `${r.declines}` : "-"),
      el("td", {}, r.updates_per_submodel.join(" / ") || "-"), yes(r.quorum), yes(r.committed));
  });
  const open = state.open_round;
  if (open) {
    const left = open.deadline_s - (state.time - open.opened);
    rows.unshift(el("tr", { "data-round": open.round, class: "open" },
      el("td", {}, `${open.round} (open)`), el("td", {}, clock(open.opened)),
      el("td", {}, `${Math.round(state.time - open.opened)} s`), el("td", {}, `deadline in ${Math.max(0, Math.round(left))} s`),
      el("td", {}, `${open.reports}/${open.participants}`), el("td", {}, "-"), el("td", {}, "-"), el("td", {}, "-"), el("td", {}, "-")));
  }
  fill(document.querySelector("#rounds tbody"), rows, "no round yet", 9);
}

function drawRejections(state) {
  const entries = Object.entries(state.rejected_total).sort((a, b) => b[1] - a[1]);
  const top = Math.max(1, ...entries.map(([, n]) => n));
  const rows = entries.map(([reason, n]) => {
    const bar = el("span", { class: "bar" });
    bar.style.width = `${Math.max(2, (120 * n) / top)}px`;
    return el("tr", { "data-reason": reason }, el("td", {}, reason), el("td", {}, n), el("td", {}, bar));
  });
  fill(document.querySelector("#rejections tbody"), rows, "nothing rejected", 3);
}

function drawStarving(state) {
  const rounds = state.rounds_history.filter((r) => r.round >= 1);
  const rows = [...Array(state.submodels).keys()].map((k) => {
    const total = rounds.reduce((s, r) => s + (r.committed ? r.updates_per_submodel[k] || 0 : 0), 0);
    let since = 0;
    for (const r of [...rounds].reverse()) {
      if (r.committed && r.updates_per_submodel[k]) break;
      since += 1;
    }
    return el("tr", { "data-submodel": k + 1 }, el("td", {}, k + 1), el("td", {}, total),
      el("td", { class: since >= 3 ? "no" : "" }, rounds.length ? since : "-"));
  });
  fill(document.querySelector("#starving tbody"), rows, "-", 3);
}

function draw(state) {
  document.getElementById("federation").textContent = state.federation;
  document.getElementById("summary").textContent = `${state.state}, round ${state.round}/${state.rounds}, profile ${state.profile} ` +
    `(${state.submodels} submodels), round deadline ${state.round_timeout} s; updated ${clock(state.time)}`;
  drawDevices(state);
  drawAccuracy(state);
  drawBytes(state);
  drawRounds(state);
  drawRejections(state);
  drawStarving(state);
}

// which device runs which model version (`aggregator publish`, `edge-client serve --follow`)
function drawRollout(view) {
  const r = view.rollout;
  document.getElementById("rollout-summary").textContent = r
    ? `rollout #${r.seq}: stable v${r.stable ?? "-"}` + (r.canary ? `, canary v${r.canary} on ${r.canary_devices.join(", ")}` : "")
      + (r.revoked.length ? `, revoked ${r.revoked.map((v) => `v${v}`).join(", ")}` : "") + (r.reason ? ` (${r.reason})` : "")
    : "nothing published";
  const v = (x) => (x == null ? "-" : `v${x}`);
  const ms = (x) => (x == null ? "-" : x.toFixed(1));
  const rows = view.devices.map((d) => {
    const now = d.current || {}, before = d.before;
    return el("tr", { "data-follower": d.client },
      el("td", {}, d.client),
      el("td", { class: d.state === "offline" ? "offline" : "online" }, d.state),
      el("td", {}, v(d.version)),
      el("td", {}, v(d.target)),
      el("td", {}, d.health),
      el("td", {}, `${now.requests ?? 0} (${now.errors ?? 0})`),
      el("td", {}, ms(now.p95_ms)),
      el("td", {}, before ? `${v(before.version)} (${ms(before.p95_ms)})` : "-"),
      el("td", {}, `${bytes(d.fetched_bytes || 0)} / ${bytes(d.release_bytes || 0)}`),
      el("td", { class: "reason" }, d.event || "-"));
  });
  fill(document.querySelector("#rollout tbody"), rows, "no device follows a rollout", 10);
}

async function getJson(path) {
  const response = await fetch(path, { headers: token ? { Authorization: `Bearer ${token}` } : {}, cache: "no-store" });
  if (!response.ok) throw new Error(response.status === 401 ? "this server needs its token: open the page with ?token=TOKEN"
    : `${path} answered ${response.status}`);
  return response.json();
}

async function poll() {
  const error = document.getElementById("error");
  try {
    draw(await getJson("api/state"));
    drawRollout(await getJson("api/rollout"));
    error.hidden = true;
  } catch (e) {
    error.textContent = `${e.message} (retrying)`;
    error.hidden = false;
  }
  setTimeout(poll, POLL_MS);
}

poll();
