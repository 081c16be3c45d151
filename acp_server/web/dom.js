// Small DOM helpers. Every string from the server or the agent goes in through textContent (never
// innerHTML), and live figures change the text of nodes that already exist, so nothing flickers.

/** A new element with a class and text (text is always set as text). */
export function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

/** Set a node's text only when it changed (no layout work for figures that stay the same). */
export function setText(node, value) {
  const text = String(value);
  if (node.textContent !== text) node.textContent = text;
}

/** "1.2 s", "340 ms", "0" for a duration in milliseconds. */
export function duration(ms) {
  if (!ms) return "0";
  if (ms < 1000) return `${Math.round(ms)} ms`;
  if (ms < 60000) return `${(ms / 1000).toFixed(1)} s`;
  return `${Math.floor(ms / 60000)} min ${Math.round((ms % 60000) / 1000)} s`;
}

/**
 * A table body whose rows are keyed: `update(rows)` adds, removes and rewrites cells in place.
 * `rows` is a list of [key, [cell, ...]]; numeric cells are right-aligned.
 */
export class KeyedTable {
  constructor(tbody, { onClick } = {}) {
    this.tbody = tbody;
    this.rows = new Map();
    this.onClick = onClick;
  }

  update(rows) {
    const seen = new Set();
    let before = this.tbody.firstChild;
    for (const [key, cells] of rows) {
      seen.add(key);
      let row = this.rows.get(key);
      if (!row) {
        const tr = el("tr");
        tr.dataset.key = key;
        const tds = cells.map((cell) => tr.appendChild(el("td", typeof cell === "number" ? "num" : "")));
        if (this.onClick) tr.addEventListener("click", () => this.onClick(key));
        row = { tr, tds };
        this.rows.set(key, row);
      }
      cells.forEach((cell, i) => setText(row.tds[i], cell));
      if (row.tr !== before) this.tbody.insertBefore(row.tr, before);
      before = row.tr.nextSibling;
    }
    for (const [key, row] of this.rows) {
      if (!seen.has(key)) {
        row.tr.remove();
        this.rows.delete(key);
      }
    }
  }
}
