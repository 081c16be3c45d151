// The operations view: one `_acp_server/stats/snapshot` a second, shown by changing text in place.
// Refusal rates are computed here from the successive totals the server counts by errorKind.

import { KeyedTable, duration, el, setText } from "./dom.js";

const HISTORY_S = 300;
const COLORS = ["#c0322b", "#2456d6", "#b86e00", "#1f8a4c", "#7b3fbf", "#0a8a9a", "#6b7385"];
const SVG = "http://www.w3.org/2000/svg";

export class OpsView {
  constructor() {
    this.pools = new KeyedTable(document.querySelector("#pools tbody"));
    this.classes = new KeyedTable(document.querySelector("#classes tbody"));
    this.transports = new KeyedTable(document.querySelector("#transports tbody"));
    this.refusals = new KeyedTable(document.querySelector("#refusals tbody"));
    this.sessions = new KeyedTable(document.querySelector("#session-rows tbody"));
    this.chart = document.getElementById("refusal-chart");
    this.lines = new Map(); // errorKind -> polyline
    this.history = []; // [{t, rates: {kind: per second}}]
    this.previous = null; // {t, byKind}
    this.figures = {};
    for (const id of ["n-sessions", "n-pending", "n-running", "n-queued", "n-refused", "evictions", "admission-summary"]) {
      this.figures[id] = document.getElementById(id);
    }
    this.snapshots = 0;
  }

  /** Ask for the feed on a (re)opened connection. */
  async subscribe(rpc) {
    this.previous = null; // a restarted server counts from 0 again
    await rpc.call("_acp_server/stats/subscribe", null);
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
    setText(
      this.figures["admission-summary"],
      adm.enabled
        ? `${adm.mode}: ${adm.running} of ${adm.maxRunningPrompts || "unlimited"} seats held, ${adm.waiting} waiting`
        : "no admission policy configured (every prompt goes straight to its pool)",
    );
    this.classes.update(
      Object.entries(adm.classes ?? {}).map(([name, c]) => [name, [name, c.running, c.share, c.waiting, duration(c.oldestWaitMs)]]),
    );

    this.transports.update(Object.entries(conns.byTransport ?? {}).sort().map(([name, n]) => [name, [name, n]]));
    this.sessions.update(
      (snap.sessions ?? []).map((s) => [s.sessionId, [s.sessionId, s.tenant, s.pending, s.running ? "yes" : "no", s.attached]]),
    );
    this.renderRefusals(snap.refusals?.byKind ?? {});
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
