// Shared base for views that show one token × token matrix (head, aggregate, difference):
// one Heatmap, pinned query rows (their sum drawn as bars under the grid), tooltips.

import { Heatmap } from "../heatmap.js";
import { maxAbs, sumRows, colourScale } from "../attention.js";
import { quoted, escapeHTML, visible } from "../tokens.js";
import { showTooltip, hideTooltip } from "../tooltip.js";

export const fmt = (v, digits = 3) => (v !== v ? "—" : Number(v).toFixed(digits));

export class MatrixView {
  constructor(app) {
    this.app = app;
    this.result = null;
  }

  mount(host) {
    this.host = host;
    this.heatmap = new Heatmap(host, {
      onHover: (h) => this.onHover(h),
      onCellClick: (c) => this.onCellClick(c),
      onLabelHover: (h) => this.onLabelHover(h),
      onEscape: () => this.app.setPinned([]),
    });
    this.heatmap.overlay.setAttribute("aria-label", this.ariaLabel());
  }

  ariaLabel() {
    return "Attention heatmap: arrow keys move between cells, Enter pins the query row, Escape clears pins";
  }

  unmount() {
    hideTooltip();
    this.heatmap?.destroy();
    this.heatmap = null;
  }

  /** Subclasses: resolve to {data, n, diverging?, title, caption, cellInfo?(r, c) -> html}. */
  async compute() {
    return null;
  }

  async render(seq) {
    const result = await this.compute();
    if (seq != null && seq !== this.app.seq) return; // a newer render started meanwhile
    if (!result || !this.heatmap) return;
    this.result = result;
    const { state } = this.app;
    const { data, n } = result;
    const tokens = result.tokens || this.app.att.tokens;
    let shown = data;
    let vmin;
    let vmax;
    let gamma = 1;
    let cmap = state.cmap;
    let legend = result.legend;
    if (result.diverging) {
      cmap = state.dcmap;
      const m = state.scale === "unit" ? 1 : maxAbs(data) || 1;
      vmin = -m;
      vmax = m;
    } else {
      const sc = colourScale(data, n, result.unbounded && state.scale === "unit" ? "max" : state.scale);
      ({ vmin, vmax, gamma } = sc);
      shown = sc.data;
      if (state.scale !== "unit" && state.scale !== "max") legend = sc.label;
    }
    const labels = tokens.slice(0, n).map((t) => t.text);
    this.heatmap.set({
      data: shown,
      rows: n,
      cols: n,
      rowLabels: labels,
      colLabels: labels,
      cmap,
      vmin,
      vmax,
      gamma,
      causal: true,
      rowTitle: "query →",
      colTitle: "key →",
    });
    this.app.setLegend({ cmap, vmin, vmax, gamma, label: legend || "attention weight" });
    this.app.setCaption(result.caption || "");
    this.updateFooter();
  }

  updateFooter() {
    const pinned = [...this.app.state.pinned].filter((r) => this.result && r < this.result.n);
    this.heatmap.setPinned(pinned);
    if (pinned.length && this.result) {
      const values = sumRows(this.result.data, this.result.n, pinned);
      const tokens = this.result.tokens || this.app.att.tokens;
      const names = pinned
        .slice(0, 4)
        .map((r) => `“${visible(tokens[r].text)}”`)
        .join(", ");
      const more = pinned.length > 4 ? ` +${pinned.length - 4}` : "";
      this.heatmap.setFooter({ values, label: `Σ of ${pinned.length} pinned row${pinned.length > 1 ? "s" : ""}: ${names}${more}` });
    } else {
      this.heatmap.setFooter(null);
    }
  }

  onPinnedChange() {
    if (this.heatmap && this.result) this.updateFooter();
  }

  cellHTML(row, col, value, masked) {
    const tokens = this.result.tokens || this.app.att.tokens;
    const q = quoted(tokens[row], row);
    const k = quoted(tokens[col], col);
    let v;
    if (masked) v = '<span class="tt-muted">masked (a later token)</span>';
    else if (value !== value) v = '<span class="tt-muted">hidden (first-token sink)</span>';
    else v = `<b>${this.result.format ? this.result.format(value) : fmt(value)}</b>`;
    const extra = this.result.cellInfo && !masked && value === value ? this.result.cellInfo(row, col) : "";
    return `<div class="tt-cell"><span class="tt-tok">${escapeHTML(q)}</span> → <span class="tt-tok">${escapeHTML(k)}</span>: ${v}</div>${extra}`;
  }

  onHover(h) {
    if (!h || !this.result) return hideTooltip();
    const value = this.result.data[h.row * this.result.n + h.col]; // the weight, not its colour scale
    showTooltip(this.cellHTML(h.row, h.col, value, h.masked), h.x, h.y);
  }

  onLabelHover(h) {
    if (!h) return hideTooltip();
    const tokens = this.result.tokens || this.app.att.tokens;
    const t = tokens[h.index];
    if (!t) return hideTooltip();
    showTooltip(
      `<div class="tt-cell"><span class="tt-tok">${escapeHTML(quoted(t, h.index))}</span></div>` +
        `<div class="tt-muted">token id ${t.id} · row = what it attends to, column = who attends to it${h.axis === "row" ? " · click to pin" : ""}</div>`,
      h.x,
      h.y,
    );
  }

  onCellClick({ row, event }) {
    const pinned = new Set(this.app.state.pinned);
    const multi = event && (event.shiftKey || event.ctrlKey || event.metaKey);
    if (multi) {
      if (pinned.has(row)) pinned.delete(row);
      else pinned.add(row);
    } else if (pinned.has(row) && pinned.size === 1) {
      pinned.clear();
    } else {
      pinned.clear();
      pinned.add(row);
    }
    this.app.setPinned([...pinned]);
  }

  exportCanvas() {
    return this.heatmap?.exportCanvas();
  }

  exportData() {
    if (!this.result) return null;
    const { data, n } = this.result;
    const tokens = (this.result.tokens || this.app.att.tokens).slice(0, n);
    const matrix = [];
    for (let r = 0; r < n; r++) matrix.push(Array.from(data.subarray(r * n, (r + 1) * n), (v) => (v !== v ? null : +v.toFixed(6))));
    return { title: this.result.title, tokens, matrix, pinned_rows: [...this.app.state.pinned] };
  }
}
