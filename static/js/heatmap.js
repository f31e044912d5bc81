// An interactive canvas heatmap with token labels on its axes. The matrix is painted once
// into a rows×cols bitmap and scaled up without smoothing; labels, the prompt/generation
// boundary, highlights and the cursor are drawn on top. No DOM node per cell.
// Cells fit the container's width, times `zoom`; the container scrolls (pan) when wider.

import { paintMatrix, cssVar, parseColor, MONO } from "./paint.js";
import { drawGrid } from "./heatmap-draw.js";
import { bindPointer } from "./heatmap-input.js";
import { axisLabel } from "./tokens.js";

const LABEL_GAP = 12; // px between two drawn labels: fewer labels rather than overlapping ones

/** The rows of `set` below `n`, as runs [first, last] of consecutive rows, in order. */
export function runs(set, n) {
  const rows = [...set].filter((r) => r < n).sort((a, b) => a - b);
  const out = [];
  for (const r of rows) {
    const last = out[out.length - 1];
    if (last && r === last[1] + 1) last[1] = r;
    else out.push([r, r]);
  }
  return out;
}

export class Heatmap {
  /**
   * opts: maxCell, minCell, minRowHeight (rows taller than columns are wide, e.g. the
   * generation view), labelMax, zoom, minWidth (the narrowest width laid out, px; a small map in
   * a side panel asks for less than 160); events onHover({row, col, value, masked, x, y} | null),
   * onCellClick({row, col, event}), onLabelHover({axis, index, x, y} | null), onZoom(factor).
   */
  constructor(container, opts = {}) {
    this.opts = { maxCell: 30, minCell: 1, minRowHeight: 0, labelMax: 12, zoom: 1, minWidth: 160, ...opts };
    this.container = container;
    this.wrap = document.createElement("div");
    this.wrap.className = "heatmap";
    this.base = document.createElement("canvas");
    this.base.className = "heatmap-base";
    this.overlay = document.createElement("canvas");
    this.overlay.className = "heatmap-overlay";
    this.wrap.append(this.base, this.overlay);
    container.append(this.wrap);
    this.bitmap = document.createElement("canvas");
    this.model = null;
    this.hover = null;
    this.labelHover = null;
    this.cursor = null;
    this.pinned = new Set();
    this.footer = null;
    this.layout = null;
    this.pointerType = "mouse";
    bindPointer(this);
  }

  /**
   * model: {data, rows, cols, rowLabels, colLabels, rowLabels2?, colLabels2? (a second
   * sequence's tokens on the right / bottom), cmap, vmin, vmax, gamma, causal, rowOffset,
   * rowTitle, colTitle, boundary? (first generated position), plainRowLabels?}
   */
  set(model) {
    this.model = { rowOffset: 0, gamma: 1, causal: false, ...model };
    const maskColor = parseColor(cssVar("--heat-masked", "#e5e7eb"));
    paintMatrix(this.model.data, this.model.rows, this.model.cols, { ...this.model, maskColor, canvas: this.bitmap });
    this.wrap.hidden = false;
    this.render();
  }

  /** Show nothing (and export nothing) until the next set(). */
  clear() {
    this.model = null;
    this.layout = null;
    this.footer = null;
    this.wrap.hidden = true;
  }

  setZoom(z) {
    this.opts.zoom = z;
    this.render();
  }

  setFooter(footer) {
    this.footer = footer; // {values: Float32Array(cols), label} | null
    this.render();
  }

  setPinned(set) {
    this.pinned = new Set(set);
    this.drawOverlay();
  }

  _labels(ctx, labels, step) {
    let w = 0;
    for (let i = 0; i < labels.length; i += step) w = Math.max(w, ctx.measureText(labels[i]).width);
    return labels.length ? Math.min(110, Math.ceil(w) + 26) : 8;
  }

  /** Work out cell sizes and margins for the container's width. */
  measure() {
    const m = this.model;
    const ctx = this.base.getContext("2d");
    ctx.font = MONO;
    const lab = (xs) => (xs || []).map((t) => axisLabel(t, this.opts.labelMax));
    const rowLabels = m.plainRowLabels ? m.rowLabels.slice() : lab(m.rowLabels);
    const colLabels = lab(m.colLabels);
    const rowLabels2 = lab(m.rowLabels2);
    const colLabels2 = lab(m.colLabels2);
    const avail = Math.max(this.opts.minWidth, this.container.clientWidth || 600);
    const fit = (left, right) => {
      let c = Math.min(this.opts.maxCell, (avail - left - right) / m.cols);
      if (this.opts.maxHeight) c = Math.min(c, this.opts.maxHeight / m.rows);
      return Math.max(this.opts.minCell, c);
    };
    let left = this._labels(ctx, rowLabels, 1);
    const minRight = m.boundary != null ? 64 : 12; // room for the boundary's "generated" note
    let right = rowLabels2.length ? this._labels(ctx, rowLabels2, 1) : minRight;
    let cellW = fit(left, right) * this.opts.zoom;
    let cellH = Math.max(cellW, this.opts.minRowHeight);
    const colStep = Math.max(1, Math.ceil(LABEL_GAP / cellW));
    const rowStep = Math.max(1, Math.ceil(LABEL_GAP / cellH));
    left = this._labels(ctx, rowLabels, rowStep);
    right = rowLabels2.length ? this._labels(ctx, rowLabels2, rowStep) : minRight;
    cellW = fit(left, right) * this.opts.zoom;
    cellH = Math.max(cellW, this.opts.minRowHeight);
    const top = this._labels(ctx, colLabels, colStep) + (m.boundary != null ? 10 : 0);
    const bottom = colLabels2.length ? this._labels(ctx, colLabels2, colStep) : 8;
    const gridW = cellW * m.cols;
    const gridH = cellH * m.rows;
    const footerH = this.footer ? 56 : 0;
    const W = Math.ceil(left + gridW + right);
    const H = Math.ceil(top + gridH + bottom + (footerH ? footerH + 10 : 0));
    return { left, top, right, cellW, cellH, gridW, gridH, W, H, colStep, rowStep, rowLabels, colLabels, rowLabels2, colLabels2, footerTop: top + gridH + bottom + 6, footerH };
  }

  render() {
    if (!this.model) return;
    const L = (this.layout = this.measure());
    const dpr = window.devicePixelRatio || 1;
    for (const c of [this.base, this.overlay]) {
      c.width = Math.round(L.W * dpr);
      c.height = Math.round(L.H * dpr);
      c.style.width = L.W + "px";
      c.style.height = L.H + "px";
    }
    this.wrap.style.width = L.W + "px";
    this.wrap.style.height = L.H + "px";
    const ctx = this.base.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, L.W, L.H);
    this.drawBase(ctx);
    this.drawOverlay();
  }

  drawBase(ctx) {
    drawGrid(ctx, this.model, this.layout, this.bitmap, this.footer);
  }

  drawOverlay() {
    const L = this.layout;
    if (!L || !this.model) return;
    const dpr = window.devicePixelRatio || 1;
    const ctx = this.overlay.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, L.W, L.H);
    const { left, top, cellW, cellH, gridW, gridH } = L;
    const m = this.model;
    const accent = cssVar("--accent");
    ctx.lineWidth = 2;
    ctx.strokeStyle = accent;
    ctx.fillStyle = accent;
    // one outline per run of adjacent pinned rows (a mean-pooled encoder pins every row: one box, not T)
    for (const [a, b] of runs(this.pinned, m.rows)) {
      ctx.strokeRect(left + 1, top + a * cellH + 1, gridW - 2, Math.max(2, (b - a + 1) * cellH - 2));
      if (b - a > 2) continue; // a long run's outline says it all: no arrow per row
      for (let r = a; r <= b; r++) {
        const y = top + (r + 0.5) * cellH;
        ctx.beginPath();
        ctx.moveTo(left - 4, y);
        ctx.lineTo(left - 1, y - 3);
        ctx.lineTo(left - 1, y + 3);
        ctx.fill();
      }
    }
    if (this.labelHover != null) {
      // a token hovered on an axis: dim everything but its row and column
      const i = this.labelHover;
      const rr = i - m.rowOffset;
      const hasRow = rr >= 0 && rr < m.rows;
      ctx.fillStyle = cssVar("--overlay-shade", "rgba(0,0,0,0.35)");
      ctx.beginPath();
      ctx.rect(left, top, gridW, gridH);
      if (hasRow) ctx.rect(left + gridW, top + rr * cellH, -gridW, cellH);
      ctx.fill("evenodd");
      if (i < m.cols) ctx.clearRect(left + i * cellW, top, cellW, gridH);
      ctx.strokeStyle = accent;
      ctx.lineWidth = 1.5;
      if (hasRow) ctx.strokeRect(left, top + rr * cellH, gridW, cellH);
      if (i < m.cols) ctx.strokeRect(left + i * cellW, top, cellW, gridH);
      this._emphasise(ctx, "row", rr);
      this._emphasise(ctx, "col", i);
    }
    const cur = this.hover || this.cursor;
    if (cur) {
      const { row, col } = cur;
      ctx.strokeStyle = cssVar("--crosshair", "rgba(255,255,255,0.55)");
      ctx.lineWidth = 1;
      ctx.setLineDash([3, 3]);
      ctx.strokeRect(left + 0.5, top + row * cellH + 0.5, gridW - 1, Math.max(1, cellH - 1));
      ctx.strokeRect(left + col * cellW + 0.5, top + 0.5, Math.max(1, cellW - 1), gridH - 1);
      ctx.setLineDash([]);
      ctx.strokeStyle = accent;
      ctx.lineWidth = 2;
      const sw = Math.max(cellW, 4);
      const sh = Math.max(cellH, 4);
      ctx.strokeRect(left + col * cellW - (sw - cellW) / 2, top + row * cellH - (sh - cellH) / 2, sw, sh);
      this._emphasise(ctx, "row", row);
      this._emphasise(ctx, "col", col);
    }
  }

  _emphasise(ctx, axis, i) {
    const L = this.layout;
    const labels = axis === "row" ? L.rowLabels : L.colLabels;
    if (!labels || i < 0 || i >= labels.length) return;
    ctx.save();
    ctx.font = "600 " + MONO;
    const text = labels[i];
    const w = ctx.measureText(text).width + 8;
    ctx.fillStyle = cssVar("--accent");
    ctx.textBaseline = "middle";
    if (axis === "row") {
      const y = L.top + (i + 0.5) * L.cellH;
      ctx.fillRect(L.left - 4 - w, y - 8, w, 16);
      ctx.fillStyle = cssVar("--accent-contrast", "#fff");
      ctx.textAlign = "right";
      ctx.fillText(text, L.left - 8, y);
    } else {
      ctx.translate(L.left + (i + 0.5) * L.cellW, L.top - 2);
      ctx.rotate(-Math.PI / 2);
      ctx.fillRect(-2, -8, w, 16);
      ctx.fillStyle = cssVar("--accent-contrast", "#fff");
      ctx.textAlign = "left";
      ctx.fillText(text, 2, 0);
    }
    ctx.restore();
  }

  /** Which cell or label is under a point in canvas CSS pixels. */
  hit(x, y) {
    const L = this.layout;
    if (!L || !this.model) return null;
    const col = Math.floor((x - L.left) / L.cellW);
    const row = Math.floor((y - L.top) / L.cellH);
    const inX = x >= L.left && x < L.left + L.gridW;
    const inY = y >= L.top && y < L.top + L.gridH;
    if (inX && inY) return { kind: "cell", row, col };
    if (inY && x < L.left && L.rowLabels.length) return { kind: "row", index: row };
    if (inX && y < L.top && L.colLabels.length) return { kind: "col", index: col };
    return null;
  }

  /** Centre of a cell in viewport (client) coordinates: for tooltips and tests. */
  cellCenter(row, col) {
    const L = this.layout;
    const rect = this.overlay.getBoundingClientRect();
    return { x: rect.left + L.left + (col + 0.5) * L.cellW, y: rect.top + L.top + (row + 0.5) * L.cellH };
  }

  labelCenter(axis, index) {
    const L = this.layout;
    const rect = this.overlay.getBoundingClientRect();
    if (axis === "row") return { x: rect.left + L.left - 20, y: rect.top + L.top + (index + 0.5) * L.cellH };
    return { x: rect.left + L.left + (index + 0.5) * L.cellW, y: rect.top + L.top - 20 };
  }

  value(row, col) {
    return this.model.data[row * this.model.cols + col];
  }

  /** The picture without hover marks, at `scale` times its CSS size, for the PNG export. */
  exportPicture(scale = 1) {
    if (!this.layout) return null;
    const L = this.layout;
    const c = document.createElement("canvas");
    c.width = Math.round(L.W * scale);
    c.height = Math.round(L.H * scale);
    const ctx = c.getContext("2d");
    ctx.scale(scale, scale);
    this.drawBase(ctx);
    return c;
  }

  destroy() {
    this.wrap.remove();
  }
}
