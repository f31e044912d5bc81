// Shared base for views that show one token × token matrix (head, aggregate, difference):
// one Heatmap, pinned query rows (their sum drawn as bars under the grid), tooltips.
// A subclass implements compute(params) -> result | null (null: nothing to draw, and the
// view then shows nothing rather than an old picture).

import { Heatmap } from "../heatmap.js";
import { sumRows } from "../attention.js";
import { colourScale, divergingScale } from "../scales.js";
import { quoted, escapeHTML, visible } from "../tokens.js";
import { showTooltip, hideTooltip } from "../tooltip.js";

export const fmt = (v, digits = 3) => (v !== v ? "—" : Number(v).toFixed(digits));

export class MatrixView {
  /** ctx: {select(patch), setLegend(spec|null), setCaption(html)} — the page's actions. */
  constructor(ctx) {
    this.ctx = ctx;
    this.result = null;
    this.params = null;
  }

  mount(host) {
    // when cells are too narrow for every token's label: say so, and offer the zoom that shows them all
    this.labelNote = document.createElement("p");
    this.labelNote.className = "label-note";
    this.labelNote.hidden = true;
    this.labelNote.innerHTML = '<span></span> <button type="button" class="btn small">Zoom to label every token</button>';
    this.labelNote.querySelector("button").addEventListener("click", () => {
      const L = this.heatmap?.layout;
      if (L) this.ctx.select({ zoom: Math.min(8, this.params.settings.zoom * Math.max(L.colStep, L.rowStep)) });
    });
    host.append(this.labelNote);
    this.heatmap = new Heatmap(host, {
      onHover: (h) => this.onHover(h),
      onCellClick: (c) => this.onCellClick(c),
      onLabelHover: (h) => this.onLabelHover(h),
      onEscape: () => this.ctx.select({ pin: [] }),
      onZoom: (zoom) => this.ctx.select({ zoom }),
    });
    this.heatmap.overlay.setAttribute("aria-label", "Attention heatmap: arrow keys move between cells, Enter pins the query row, Escape clears pins, + and − zoom");
  }

  unmount() {
    hideTooltip();
    this.heatmap?.destroy();
    this.heatmap = null;
    this.labelNote?.remove();
  }

  /** The note over the map when only every n-th token has a label. */
  updateLabelNote() {
    const L = this.heatmap?.model ? this.heatmap.layout : null;
    const step = L ? Math.max(L.colStep, L.rowStep) : 1;
    this.labelNote.hidden = step <= 1;
    if (step > 1) this.labelNote.firstElementChild.textContent = `Every ${step}${step === 2 ? "nd" : step === 3 ? "rd" : "th"} token is labelled: hover the map or an axis for any token, or`;
  }

  async compute() {
    return null;
  }

  /**
   * result: {data, rows, cols, tokens, colTokens?, rowTokens2?, colTokens2?, diverging?,
   * title, caption, legend?, what?, format?, cellInfo?(r, c)}
   */
  async render(params, changed, isCurrent = () => true) {
    if (this.result && changed && [...changed].every((k) => k === "pin" || k === "zoom")) {
      this.params = params;
      if (changed.has("zoom")) this.heatmap.setZoom(params.settings.zoom);
      this.updateFooter();
      this.updateLabelNote();
      return true;
    }
    const result = await this.compute(params);
    if (!isCurrent() || !this.heatmap) return false;
    this.params = params;
    this.result = result;
    if (!result) {
      this.heatmap.clear();
      this.updateLabelNote();
      this.ctx.setLegend(null);
      return false;
    }
    const { settings } = params;
    const { data, rows, cols } = result;
    const sc = result.diverging ? divergingScale(data, cols, settings.scale) : colourScale(data, cols, settings.scale, { what: result.what });
    const cmap = result.diverging ? settings.dcmap : settings.cmap;
    this.heatmap.opts.zoom = settings.zoom;
    this.heatmap.set({
      data: sc.data,
      rows,
      cols,
      rowLabels: result.tokens.slice(0, rows).map((t) => t.text),
      colLabels: (result.colTokens || result.tokens).slice(0, cols).map((t) => t.text),
      rowLabels2: result.rowTokens2?.slice(0, rows).map((t) => t.text),
      colLabels2: result.colTokens2?.slice(0, cols).map((t) => t.text),
      cmap,
      vmin: sc.vmin,
      vmax: sc.vmax,
      gamma: sc.gamma,
      causal: result.causal ?? params.causal ?? true, // an encoder's maps are full squares: causal false
      boundary: result.boundary ?? null,
      rowTitle: `${params.axes.rows} →`,
      colTitle: `${params.axes.cols} →`,
    });
    this.legend = { cmap, vmin: sc.vmin, vmax: sc.vmax, gamma: sc.gamma, label: sc.label, lowNote: result.lowNote, highNote: result.highNote };
    this.ctx.setLegend(this.legend);
    this.ctx.setCaption(result.caption || "");
    this.updateFooter();
    this.updateLabelNote();
    return true;
  }

  updateFooter() {
    if (!this.result || !this.heatmap?.model) return;
    const tokens = this.result.tokens;
    const pinned = this.params.selection.pinned.filter((r) => r < this.result.rows);
    this.heatmap.setPinned(pinned);
    if (!pinned.length) return this.heatmap.setFooter(null);
    const values = sumRows(this.result.data, this.result.cols, pinned);
    const names = pinned.slice(0, 4).map((r) => `“${visible(tokens[r].text)}”`).join(", ");
    const more = pinned.length > 4 ? ` +${pinned.length - 4}` : "";
    this.heatmap.setFooter({ values, label: `Σ of ${pinned.length} pinned row${pinned.length > 1 ? "s" : ""}: ${names}${more}` });
  }

  cellHTML(row, col, value, masked) {
    const r = this.result;
    const q = quoted(r.tokens[row], row);
    const k = quoted((r.colTokens || r.tokens)[col], col);
    let v;
    if (masked) v = '<span class="tt-muted">masked (a later token)</span>';
    else if (value !== value) v = '<span class="tt-muted">hidden (first-token sink)</span>';
    else v = `<b>${r.format ? r.format(value) : fmt(value)}</b>`;
    const extra = r.cellInfo && !masked && value === value ? r.cellInfo(row, col) : "";
    return `<div class="tt-cell"><span class="tt-tok">${escapeHTML(q)}</span> → <span class="tt-tok">${escapeHTML(k)}</span>: ${v}</div>${extra}`;
  }

  onHover(h) {
    if (!h || !this.result) return hideTooltip();
    const value = this.result.data[h.row * this.result.cols + h.col]; // the value, not its colour
    showTooltip(this.cellHTML(h.row, h.col, value, h.masked), h.x, h.y);
  }

  onLabelHover(h) {
    const t = h && this.result?.tokens[h.index];
    if (!t) return hideTooltip();
    showTooltip(
      `<div class="tt-cell"><span class="tt-tok">${escapeHTML(quoted(t, h.index))}</span></div>` +
        `<div class="tt-muted">token id ${t.id} · row = what it attends to, column = who attends to it${h.axis === "row" ? " · click to pin" : ""}</div>`,
      h.x,
      h.y,
    );
  }

  onCellClick({ row, event }) {
    const pinned = new Set(this.params.selection.pinned);
    const multi = event && (event.shiftKey || event.ctrlKey || event.metaKey);
    if (multi) {
      if (pinned.has(row)) pinned.delete(row);
      else pinned.add(row);
    } else if (pinned.has(row) && pinned.size === 1 && event?.pointerType !== "touch") {
      pinned.clear();
    } else {
      pinned.clear();
      pinned.add(row);
    }
    this.ctx.select({ pin: [...pinned] });
  }

  /** {canvas (at `scale`), title, legend} for the PNG export, or null when nothing is drawn. */
  exportPicture(scale) {
    if (!this.result || !this.heatmap?.model) return null;
    return { canvas: this.heatmap.exportPicture(scale), title: this.result.title, legend: this.legend };
  }

  exportData() {
    if (!this.result) return null;
    const { data, rows, cols } = this.result;
    const matrix = [];
    for (let r = 0; r < rows; r++) matrix.push(Array.from(data.subarray(r * cols, (r + 1) * cols), (v) => (v !== v ? null : +v.toFixed(6))));
    const out = { title: this.result.title, tokens: this.result.tokens.slice(0, rows), matrix, pinned_rows: this.params.selection.pinned };
    if (this.result.rowTokens2) out.tokens_b = this.result.rowTokens2.slice(0, rows);
    return out;
  }
}
