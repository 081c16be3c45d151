// The operations view: one `_acp_server/stats/snapshot` a second, shown by changing text in place.
// Refusal rates are computed here from the successive totals the server counts by errorKind.

import { KeyedTable, duration, el, setText } from "./dom.js";

const HISTORY_S = 300;
const COLORS = ["#c0322b", "#2456d6", "#b86e00", "#1f8a4c", "#7b3fbf", "#0a8a9a", "#6b7385"];
const SVG = "http://www.w3.org/2000/svg";
// The priority classes in rank order: a shared limit `seats:c1` is the interactive class's seats.
const CLASSES = ["critical", "interactive", "background", "bulk"];
const GROUPS = [["seats", "seats"], ["tenant:", "tenant"], ["room", "waiting room"], ["pool:", "backend pool"]];

/** What a shared limit's name stands for, as `acp-server cluster` groups them. */
export function describeLimit(name) {
  const cls = /^(seats|room):c(\d+)$/.exec(name);
  if (cls) return [cls[1] === "seats" ? "seats" : "waiting room", `class ${CLASSES[Number(cls[2])] ?? cls[2]}`];
  if (name === "seats") return ["seats", "global seats (running prompts)"];
  if (name === "room") return ["waiting room", "prompts waiting for a seat"];
  if (name.startsWith("tenant:")) return ["tenant", `seats of tenant ${name.slice(7)}`];
  const pool = /^pool:(.*?)(:active)?$/.exec(name);
  if (pool) return ["backend pool", pool[2] ? `${pool[1]}: backend calls running` : `${pool[1]}: admitted prompts`];
  return ["other", name];
}

export class OpsView {
  constructor() {
    this.pools = new KeyedTable(document.querySelector("#pools tbody"));
    this.classes = new KeyedTable(document.querySelector("#classes tbody"));
    this.transports = new KeyedTable(document.querySelector("#transports tbody"));
    this.refusals = new KeyedTable(document.querySelector("#refusals tbody"));
    this.sessions = new KeyedTable(document.querySelector("#session-rows tbody"));
    this.replicas = new KeyedTable(document.querySelector("#replicas tbody"));
    this.limits = new KeyedTable(document.querySelector("#cluster-limits tbody"));
    this.cluster = document.getElementById("cluster");
    this.chart = document.getElementById("refusal-chart");
    this.lines = new Map(); // errorKind -> polyline
    this.history = []; // [{t, rates: {kind: per second}}]
    this.previous = null; // {t, byKind}
    this.figures = {};
    for (const id of ["n-sessions", "n-pending", "n-running", "n-queued", "n-refused", "evictions", "admission-summary", "cluster-summary"]) {
      this.figures[id] = document.getElementById(id);
    }
    this.snapshots = 0;
  }

  /** Ask for the feed on a (re)opened connection. */
  async subscribe(rpc) {
    this.previous = null; // a restarted server counts from 0 again
    const notice = document.getElementById("ops-notice");
    try {
      await rpc.call("_acp_server/stats/subscribe", null);
      notice.hidden = true;
    } catch (err) {
      // a token without the admin or metrics scope may use the sessions view but not read the stats
      const why = typeof err.data?.detail === "string" ? ` (${err.data.detail})` : "";
      setText(notice, `The live figures are not available: ${err.message}${why}`);
      notice.dataset.kind = err.kind ?? "";
      notice.hidden = false;
    }
  }

  render(snap) {
    this.snapshots += 1;
    document.body.dataset.snapshots = String(this.snapshots);
    const bridge = snap.bridge ?? {};
    setText(this.figures["n-sessions"], bridge.sessions ?? 0);
    setText(this.figures["n-pending"], bridge.pendingPrompts ?? 0);
    setText(this.figures["n-running"], bridge.runningPrompts ?? 0);
    setText(this.figures["n-queued"], bridge.queuedPrompts ?? 0);
    setText(this.figures["n-refused"], bridge.refusedTotal ?? 0);
    const conns = snap.connections ?? {};
    setText(this.figures.evictions, conns.evictionsTotal ?? 0);

    const pools = Object.entries(snap.pools ?? {}).map(([name, p]) => [
      name,
      [name, p.active, p.waiting, p.leased, `${p.maxActive}${p.maxWaiting == null ? "" : " + " + p.maxWaiting}`, duration(p.oldestWaitMs)],
    ]);
    this.pools.update(pools.length ? pools : [["", ["no backend has max_active set (unlimited)", "", "", "", "", ""]]]);

    const adm = snap.admission ?? {};
    // with a coordinator, the seats, the waiting room and the pools in force are the cluster's
    const shared = snap.coordinator ? " (the limits in force are shared: see the cluster below)" : "";
    setText(
      this.figures["admission-summary"],
      (adm.enabled
        ? `${adm.mode}: ${adm.running} of ${adm.maxRunningPrompts || "unlimited"} seats held, ${adm.waiting} waiting`
        : "no admission policy configured (every prompt goes straight to its pool)") + shared,
    );
    this.classes.update(
      Object.entries(adm.classes ?? {}).map(([name, c]) => [name, [name, c.running, c.share, c.waiting, duration(c.oldestWaitMs)]]),
    );

    this.transports.update(Object.entries(conns.byTransport ?? {}).sort().map(([name, n]) => [name, [name, n]]));
    this.sessions.update(
      (snap.sessions ?? []).map((s) => [s.sessionId, [s.sessionId, s.tenant, s.pending, s.running ? "yes" : "no", s.attached]]),
    );
    this.renderCluster(snap.coordinator, snap.cluster);
    this.renderRefusals(snap.refusals?.byKind ?? {});
  }

  /**
   * With a coordinator: this replica's link to it (`coordinator`) and what Redis holds for the whole
   * cluster (`cluster`: every replica's last renewal, every shared limit's holders and cap).
   */
  renderCluster(coord, cluster) {
    const shown = Boolean(coord || cluster);
    if (this.cluster.hidden === shown) this.cluster.hidden = !shown;
    if (!shown) return;
    const summary = this.figures["cluster-summary"];
    const parts = [];
    if (coord) {
      parts.push(`this replica ${coord.replicaId}: coordinator ${coord.up ? "up" : "DOWN"} (${coord.kind})`);
      parts.push(`${coord.leases} leases held`, `${coord.liveReplicas} live replicas`, `failure mode ${coord.failureMode}`);
      parts.push(`renewal ${coord.renewMsLast} ms (max ${coord.renewMsMax})`);
    }
    if (cluster?.error) parts.push(`cluster read failed: ${cluster.error}` + (cluster.limits?.length ? " (last figures shown)" : ""));
    else if (!cluster) parts.push("reading the cluster…");
    setText(summary, parts.join(" · "));
    summary.dataset.up = String(Boolean(coord?.up ?? true) && !cluster?.error);

    const self = coord?.replicaId;
    const replicas = [...(cluster?.replicas ?? [])].sort((a, b) => String(a.replicaId).localeCompare(String(b.replicaId)));
    this.replicas.update(
      replicas.map((r) => [
        String(r.replicaId),
        [r.replicaId === self ? `${r.replicaId} (this one)` : r.replicaId, r.live ? "live" : "gone", `${r.lastRenewMsAgo ? duration(r.lastRenewMsAgo) : "0 ms"} ago`],
      ]),
    );
    for (const r of replicas) {
      const row = this.replicas.rows.get(String(r.replicaId));
      row.tr.dataset.live = String(Boolean(r.live));
      row.tr.dataset.self = String(r.replicaId === self);
    }

    const order = (name) => GROUPS.findIndex(([head]) => name.startsWith(head));
    const limits = [...(cluster?.limits ?? [])].sort((a, b) => order(a.name) - order(b.name) || a.name.localeCompare(b.name));
    this.limits.update(
      limits.map((x) => {
        const [group, what] = describeLimit(String(x.name));
        return [String(x.name), [x.name, `${group}: ${what}`, x.count, x.cap ? x.cap : "-"]];
      }),
    );
  }

  renderRefusals(byKind) {
    const now = performance.now() / 1000;
    const rates = {};
    if (this.previous) {
      const dt = Math.max(now - this.previous.t, 0.001);
      for (const [kind, total] of Object.entries(byKind)) {
        const before = this.previous.byKind[kind] ?? 0;
        rates[kind] = Math.max(total - before, 0) / dt;
      }
    }
    this.previous = { t: now, byKind: { ...byKind } };
    this.history.push({ t: now, rates });
    while (this.history.length && now - this.history[0].t > HISTORY_S) this.history.shift();

    const kinds = new Set(Object.keys(byKind));
    for (const point of this.history) for (const kind of Object.keys(point.rates)) kinds.add(kind);
    const sorted = [...kinds].sort();
    this.refusals.update(
      sorted.map((kind) => [kind, [kind, (rates[kind] ?? 0).toFixed(1), byKind[kind] ?? 0]]),
    );
    sorted.forEach((kind, i) => this.legend(kind, COLORS[i % COLORS.length]));
    this.drawChart(sorted, now);
  }

  legend(kind, color) {
    const row = this.refusals.rows.get(kind);
    if (!row || row.tds[0].dataset.color === color) return;
    const swatch = el("span", "legend");
    swatch.style.background = color;
    row.tds[0].dataset.color = color;
    row.tds[0].textContent = "";
    row.tds[0].append(swatch, document.createTextNode(kind));
  }

  drawChart(kinds, now) {
    let peak = 1;
    for (const point of this.history) for (const v of Object.values(point.rates)) peak = Math.max(peak, v);
    kinds.forEach((kind, i) => {
      let line = this.lines.get(kind);
      if (!line) {
        line = document.createElementNS(SVG, "polyline");
        line.setAttribute("fill", "none");
        line.setAttribute("stroke-width", "2");
        line.setAttribute("vector-effect", "non-scaling-stroke");
        line.dataset.kind = kind;
        this.chart.appendChild(line);
        this.lines.set(kind, line);
      }
      line.setAttribute("stroke", COLORS[i % COLORS.length]);
      const points = this.history.map((p) => {
        const x = 600 - ((now - p.t) / HISTORY_S) * 600;
        const y = 118 - ((p.rates[kind] ?? 0) / peak) * 110;
        return `${x.toFixed(1)},${y.toFixed(1)}`;
      });
      line.setAttribute("points", points.join(" "));
    });
  }
}
