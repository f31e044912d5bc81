// A canvas heatmap: the matrix is painted once into an offscreen bitmap of rows×cols
// pixels (one pixel per cell, via a packed colour LUT) and scaled up without smoothing;
// labels, highlights and the cursor are drawn on top. No DOM node per cell.

import { lut32, css, isDiverging } from "./colormap.js";
import { axisLabel } from "./tokens.js";

const FONT = '11px ui-monospace, "SF Mono", Menlo, Consolas, "DejaVu Sans Mono", monospace';

export function cssVar(name, fallback = "#888") {
  const v = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return v || fallback;
}

/** A copy of `canvas` on the page's opaque surface colour, for PNG export. */
export function opaqueCopy(canvas) {
  const c = document.createElement("canvas");
  c.width = canvas.width;
  c.height = canvas.height;
  const ctx = c.getContext("2d");
  ctx.fillStyle = cssVar("--surface", "#fff");
  ctx.fillRect(0, 0, c.width, c.height);
  ctx.drawImage(canvas, 0, 0);
  return c;
}

export function parseColor(str) {
  // #rgb, #rrggbb or rgb(r, g, b) -> [r, g, b]
  if (str.startsWith("#")) {
    const h = str.length === 4 ? [...str.slice(1)].map((c) => c + c).join("") : str.slice(1, 7);
    return [0, 2, 4].map((i) => parseInt(h.substr(i, 2), 16));
  }
  const m = str.match(/[\d.]+/g);
  return m ? m.slice(0, 3).map(Number) : [128, 128, 128];
}

/**
 * Paint a rows×cols matrix into a new (or given) canvas at one pixel per cell.
 * Values are mapped linearly from [vmin, vmax] (optionally through `gamma`) into the LUT.
 * `masked(r, c)` cells (e.g. the causal upper triangle) get `maskColor`.
 */
export function paintMatrix(data, rows, cols, { cmap = "viridis", vmin = 0, vmax = 1, gamma = 1, causal = false, rowOffset = 0, maskColor = [128, 128, 128], nanMask = true, canvas = null } = {}) {
  const c = canvas || document.createElement("canvas");
  if (c.width !== cols || c.height !== rows) {
    c.width = cols;
    c.height = rows;
  }
  const ctx = c.getContext("2d");
  const img = ctx.createImageData(cols, rows);
  const px = new Uint32Array(img.data.buffer);
  const table = lut32(cmap);
  const mask = (255 << 24) | (maskColor[2] << 16) | (maskColor[1] << 8) | maskColor[0];
  const span = vmax - vmin || 1;
  const k = 255 / span;
  for (let r = 0; r < rows; r++) {
    const base = r * cols;
    const limit = causal ? Math.min(cols, r + rowOffset + 1) : cols;
    for (let col = 0; col < limit; col++) {
      const v = data[base + col];
      if (v !== v) {
        px[base + col] = nanMask ? mask : table[0];
        continue;
      }
      let t = (v - vmin) * k;
      if (gamma !== 1) t = 255 * Math.pow(Math.max(0, t / 255), gamma);
      const i = t <= 0 ? 0 : t >= 255 ? 255 : t | 0;
      px[base + col] = table[i];
    }
    for (let col = limit; col < cols; col++) px[base + col] = mask;
  }
  ctx.putImageData(img, 0, 0);
  return c;
}

/** Draw a horizontal colour legend with min / mid / max ticks. */
export function drawLegend(canvas, { cmap = "viridis", vmin = 0, vmax = 1, gamma = 1, label = "" } = {}) {
  const dpr = window.devicePixelRatio || 1;
  const W = canvas.clientWidth || 220;
  const H = canvas.clientHeight || 34;
  canvas.width = Math.round(W * dpr);
  canvas.height = Math.round(H * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, W, H);
  const barH = 10;
  const x0 = 6;
  const x1 = W - 6;
  for (let x = x0; x < x1; x++) {
    const t = (x - x0) / (x1 - x0 - 1);
    ctx.fillStyle = css(cmap, t);
    ctx.fillRect(x, 2, 1, barH);
  }
  ctx.strokeStyle = cssVar("--border");
  ctx.strokeRect(x0 - 0.5, 1.5, x1 - x0 + 1, barH + 1);
  ctx.fillStyle = cssVar("--muted");
  ctx.font = FONT;
  ctx.textBaseline = "top";
  const fmt = (v) => {
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 100) return v.toFixed(0);
    if (a >= 10) return v.toFixed(1);
    if (a >= 0.095) return v.toFixed(2);
    return v.toPrecision(2);
  };
  const valueAt = (t) => {
    if (gamma === 1) return vmin + t * (vmax - vmin);
    return vmin + Math.pow(t, 1 / gamma) * (vmax - vmin);
  };
  ctx.textAlign = "left";
  ctx.fillText(fmt(vmin), x0, barH + 6);
  ctx.textAlign = "center";
  ctx.fillText(fmt(valueAt(0.5)), (x0 + x1) / 2, barH + 6);
  ctx.textAlign = "right";
  ctx.fillText(fmt(vmax), x1, barH + 6);
  canvas.setAttribute("aria-label", `colour scale ${cmap} from ${fmt(vmin)} to ${fmt(vmax)}${label ? " " + label : ""}`);
}

/**
 * An interactive heatmap with token labels on both axes.
 * Events (all optional): onHover({row, col, value, x, y} | null), onCellClick({row, col, event}),
 * onLabelHover({axis, index, x, y} | null).
 */
export class Heatmap {
  constructor(container, opts = {}) {
    this.opts = { maxCell: 30, minCell: 1, labelMax: 12, interactive: true, square: true, ...opts };
    this.container = container;
    this.wrap = document.createElement("div");
    this.wrap.className = "heatmap";
    this.base = document.createElement("canvas");
    this.overlay = document.createElement("canvas");
    this.overlay.className = "heatmap-overlay";
    this.base.className = "heatmap-base";
    this.wrap.append(this.base, this.overlay);
    container.append(this.wrap);
    this.bitmap = document.createElement("canvas");
    this.model = null;
    this.hover = null; // {row, col}
    this.labelHover = null; // index of a token hovered on an axis
    this.cursor = null; // keyboard cursor {row, col}
    this.pinned = new Set();
    this.footer = null;
    this.layout = null;
    if (this.opts.interactive) this._bind();
  }

  /** model: {data, rows, cols, rowLabels, colLabels, cmap, vmin, vmax, gamma, causal, rowOffset, rowTitle, colTitle} */
  set(model) {
    this.model = { rowOffset: 0, gamma: 1, causal: false, ...model };
    const maskColor = parseColor(cssVar("--heat-masked", "#e5e7eb"));
    paintMatrix(this.model.data, this.model.rows, this.model.cols, { ...this.model, maskColor, canvas: this.bitmap });
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

  /** Repaint bitmap (after a theme change) and redraw. */
  refresh() {
    if (this.model) this.set(this.model);
  }

  _measureLabels(ctx, labels, step) {
    let w = 0;
    for (let i = 0; i < labels.length; i += step) w = Math.max(w, ctx.measureText(labels[i]).width);
    return Math.ceil(w);
  }

  render() {
    const m = this.model;
    if (!m) return;
    const dpr = window.devicePixelRatio || 1;
    const avail = Math.max(200, this.container.clientWidth || 600);
    const ctx = this.base.getContext("2d");
    ctx.font = FONT;
    const rowLabels = m.plainRowLabels ? m.rowLabels.slice() : (m.rowLabels || []).map((t) => axisLabel(t, this.opts.labelMax));
    const colLabels = (m.colLabels || []).map((t) => axisLabel(t, this.opts.labelMax));
    // first guess of the cell size, then the label step that keeps labels apart
    let left = rowLabels.length ? Math.min(110, this._measureLabels(ctx, rowLabels, 1) + 26) : 8;
    let top = colLabels.length ? Math.min(110, this._measureLabels(ctx, colLabels, 1) + 26) : 8;
    const right = 12;
    let cell = Math.min(this.opts.maxCell, (avail - left - right) / m.cols);
    if (this.opts.maxHeight) cell = Math.min(cell, (this.opts.maxHeight - top) / m.rows);
    cell = Math.max(this.opts.minCell, cell);
    const spacing = 12;
    const step = Math.max(1, Math.ceil(spacing / cell));
    left = rowLabels.length ? Math.min(110, this._measureLabels(ctx, rowLabels, step) + 26) : 8;
    top = colLabels.length ? Math.min(110, this._measureLabels(ctx, colLabels, step) + 26) : 8;
    cell = Math.min(this.opts.maxCell, (avail - left - right) / m.cols);
    if (this.opts.maxHeight) cell = Math.min(cell, (this.opts.maxHeight - top) / m.rows);
    cell = Math.max(this.opts.minCell, cell);
    const gridW = cell * m.cols;
    const gridH = cell * m.rows;
    const footerH = this.footer ? 56 : 0;
    const W = Math.ceil(left + gridW + right);
    const H = Math.ceil(top + gridH + (footerH ? footerH + 10 : 8));
    this.layout = { left, top, cell, gridW, gridH, W, H, step, rowLabels, colLabels, footerTop: top + gridH + 10, footerH };
    for (const c of [this.base, this.overlay]) {
      c.width = Math.round(W * dpr);
      c.height = Math.round(H * dpr);
      c.style.width = W + "px";
      c.style.height = H + "px";
    }
    this.wrap.style.width = W + "px";
    this.wrap.style.height = H + "px";
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, W, H);
    // cells
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(this.bitmap, left, top, gridW, gridH);
    ctx.strokeStyle = cssVar("--border");
    ctx.lineWidth = 1;
    ctx.strokeRect(left - 0.5, top - 0.5, gridW + 1, gridH + 1);
    // labels
    const fg = cssVar("--text");
    const muted = cssVar("--muted");
    ctx.font = FONT;
    ctx.fillStyle = fg;
    ctx.textBaseline = "middle";
    ctx.textAlign = "right";
    for (let r = 0; r < rowLabels.length; r += step) ctx.fillText(rowLabels[r], left - 6, top + (r + 0.5) * cell);
    ctx.save();
    ctx.textAlign = "left";
    for (let c = 0; c < colLabels.length; c += step) {
      ctx.save();
      ctx.translate(left + (c + 0.5) * cell, top - 6);
      ctx.rotate(-Math.PI / 2);
      ctx.fillText(colLabels[c], 0, 0);
      ctx.restore();
    }
    ctx.restore();
    // axis titles
    ctx.fillStyle = muted;
    ctx.font = '600 10px system-ui, -apple-system, "Segoe UI", sans-serif';
    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    if (m.colTitle) ctx.fillText(m.colTitle, left, 2);
    if (m.rowTitle) {
      ctx.save();
      ctx.translate(4, top);
      ctx.rotate(Math.PI / 2);
      ctx.fillText(m.rowTitle, 0, -10);
      ctx.restore();
    }
    if (this.footer) this._drawFooter(ctx);
    this.drawOverlay();
  }

  _drawFooter(ctx) {
    const { left, cell, footerTop, footerH, gridW } = this.layout;
    const vals = this.footer.values;
    let max = 0;
    for (const v of vals) if (v > max) max = v;
    const h = footerH - 14;
    ctx.fillStyle = cssVar("--surface-2");
    ctx.fillRect(left, footerTop, gridW, h);
    const cmap = this.model.cmap;
    for (let c = 0; c < vals.length; c++) {
      const t = max > 0 ? vals[c] / max : 0;
      ctx.fillStyle = css(isDiverging(cmap) ? "viridis" : cmap, 0.25 + 0.75 * t);
      const bh = t * h;
      ctx.fillRect(left + c * cell + (cell > 3 ? 0.5 : 0), footerTop + h - bh, Math.max(1, cell - (cell > 3 ? 1 : 0)), bh);
    }
    ctx.fillStyle = cssVar("--muted");
    ctx.font = '10px system-ui, -apple-system, "Segoe UI", sans-serif';
    ctx.textAlign = "left";
    ctx.textBaseline = "top";
    ctx.fillText(`${this.footer.label}  (max ${max.toFixed(3)})`, left, footerTop + h + 2);
  }

  drawOverlay() {
    const L = this.layout;
    if (!L) return;
    const dpr = window.devicePixelRatio || 1;
    const ctx = this.overlay.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, L.W, L.H);
    const { left, top, cell, gridW, gridH } = L;
    const accent = cssVar("--accent");
    const shade = cssVar("--overlay-shade", "rgba(0,0,0,0.35)");
    // pinned rows
    ctx.lineWidth = 2;
    ctx.strokeStyle = accent;
    for (const r of this.pinned) {
      if (r >= this.model.rows) continue;
      ctx.strokeRect(left + 1, top + r * cell + 1, gridW - 2, Math.max(2, cell - 2));
      ctx.fillStyle = accent;
      ctx.beginPath();
      ctx.moveTo(left - 4, top + (r + 0.5) * cell);
      ctx.lineTo(left - 1, top + (r + 0.5) * cell - 3);
      ctx.lineTo(left - 1, top + (r + 0.5) * cell + 3);
      ctx.fill();
    }
    // token hovered on an axis: dim everything but its row and column
    if (this.labelHover != null) {
      const i = this.labelHover;
      ctx.fillStyle = shade;
      const rr = i - (this.model.rowOffset || 0);
      ctx.beginPath();
      ctx.rect(left, top, gridW, gridH);
      if (rr >= 0 && rr < this.model.rows) ctx.rect(left + gridW, top + rr * cell, -gridW, cell);
      ctx.fill("evenodd");
      if (i < this.model.cols) {
        ctx.clearRect(left + i * cell, top, cell, gridH);
        if (rr >= 0 && rr < this.model.rows) {
          // the intersection was cleared twice; nothing else to do
        }
      }
      ctx.strokeStyle = accent;
      ctx.lineWidth = 1.5;
      if (rr >= 0 && rr < this.model.rows) ctx.strokeRect(left, top + rr * cell, gridW, cell);
      if (i < this.model.cols) ctx.strokeRect(left + i * cell, top, cell, gridH);
      this._emphasiseLabel(ctx, "row", rr);
      this._emphasiseLabel(ctx, "col", i);
    }
    const cur = this.hover || this.cursor;
    if (cur) {
      const { row, col } = cur;
      ctx.strokeStyle = cssVar("--crosshair", "rgba(255,255,255,0.55)");
      ctx.lineWidth = 1;
      ctx.setLineDash([3, 3]);
      ctx.strokeRect(left + 0.5, top + row * cell + 0.5, gridW - 1, Math.max(1, cell - 1));
      ctx.strokeRect(left + col * cell + 0.5, top + 0.5, Math.max(1, cell - 1), gridH - 1);
      ctx.setLineDash([]);
      ctx.strokeStyle = accent;
      ctx.lineWidth = 2;
      const s = Math.max(cell, 4);
      ctx.strokeRect(left + col * cell - (s - cell) / 2, top + row * cell - (s - cell) / 2, s, s);
      this._emphasiseLabel(ctx, "row", row);
      this._emphasiseLabel(ctx, "col", col);
    }
  }

  _emphasiseLabel(ctx, axis, i) {
    const L = this.layout;
    const labels = axis === "row" ? L.rowLabels : L.colLabels;
    if (!labels || i < 0 || i >= labels.length) return;
    ctx.save();
    ctx.font = "600 " + FONT;
    const text = labels[i];
    const w = ctx.measureText(text).width + 8;
    ctx.fillStyle = cssVar("--accent");
    ctx.textBaseline = "middle";
    if (axis === "row") {
      const y = L.top + (i + 0.5) * L.cell;
      ctx.fillRect(L.left - 4 - w, y - 8, w, 16);
      ctx.fillStyle = cssVar("--accent-contrast", "#fff");
      ctx.textAlign = "right";
      ctx.fillText(text, L.left - 8, y);
    } else {
      const x = L.left + (i + 0.5) * L.cell;
      ctx.translate(x, L.top - 2);
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
    const m = this.model;
    if (!L || !m) return null;
    const col = Math.floor((x - L.left) / L.cell);
    const row = Math.floor((y - L.top) / L.cell);
    const inX = x >= L.left && x < L.left + L.gridW;
    const inY = y >= L.top && y < L.top + L.gridH;
    if (inX && inY) return { kind: "cell", row, col };
    if (inY && x < L.left && m.rowLabels) return { kind: "row", index: row };
    if (inX && y < L.top && m.colLabels) return { kind: "col", index: col };
    return null;
  }

  /** Centre of a cell in viewport (client) coordinates — used by tests and tooltips. */
  cellCenter(row, col) {
    const L = this.layout;
    const rect = this.overlay.getBoundingClientRect();
    return { x: rect.left + L.left + (col + 0.5) * L.cell, y: rect.top + L.top + (row + 0.5) * L.cell };
  }

  labelCenter(axis, index) {
    const L = this.layout;
    const rect = this.overlay.getBoundingClientRect();
    if (axis === "row") return { x: rect.left + L.left - 20, y: rect.top + L.top + (index + 0.5) * L.cell };
    return { x: rect.left + L.left + (index + 0.5) * L.cell, y: rect.top + L.top - 20 };
  }

  value(row, col) {
    const m = this.model;
    return m.data[row * m.cols + col];
  }

  _emitHover(row, col) {
    const m = this.model;
    if (row == null) {
      this.hover = null;
      this.opts.onHover?.(null);
    } else {
      this.hover = { row, col };
      const c = this.cellCenter(row, col);
      const masked = m.causal && col > row + (m.rowOffset || 0);
      this.opts.onHover?.({ row, col, value: this.value(row, col), masked, x: c.x, y: c.y });
    }
    this.drawOverlay();
  }

  _bind() {
    const el = this.overlay;
    el.tabIndex = 0;
    el.setAttribute("role", "img");
    el.addEventListener("mousemove", (e) => {
      const rect = el.getBoundingClientRect();
      const h = this.hit(e.clientX - rect.left, e.clientY - rect.top);
      if (h?.kind === "cell") {
        this.labelHover = null;
        this.opts.onLabelHover?.(null);
        if (!this.hover || this.hover.row !== h.row || this.hover.col !== h.col) this._emitHover(h.row, h.col);
        el.style.cursor = "crosshair";
      } else if (h && (h.kind === "row" || h.kind === "col")) {
        const idx = h.kind === "row" ? h.index + (this.model.rowOffset || 0) : h.index;
        this.hover = null;
        this.opts.onHover?.(null);
        if (this.labelHover !== idx) {
          this.labelHover = idx;
          const c = this.labelCenter(h.kind, h.index);
          this.opts.onLabelHover?.({ axis: h.kind, index: idx, x: c.x, y: c.y });
          this.drawOverlay();
        }
        el.style.cursor = h.kind === "row" ? "pointer" : "default";
      } else {
        this._clearHover();
        el.style.cursor = "default";
      }
    });
    el.addEventListener("mouseleave", () => this._clearHover());
    el.addEventListener("click", (e) => {
      const rect = el.getBoundingClientRect();
      const h = this.hit(e.clientX - rect.left, e.clientY - rect.top);
      if (h?.kind === "cell") this.opts.onCellClick?.({ row: h.row, col: h.col, event: e });
      else if (h?.kind === "row") this.opts.onCellClick?.({ row: h.index, col: null, event: e });
    });
    el.addEventListener("keydown", (e) => {
      const m = this.model;
      if (!m) return;
      let cur = this.cursor || this.hover || { row: 0, col: 0 };
      const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1], Home: [0, -1e9], End: [0, 1e9] };
      if (moves[e.key]) {
        const [dr, dc] = moves[e.key];
        cur = { row: Math.max(0, Math.min(m.rows - 1, cur.row + dr)), col: Math.max(0, Math.min(m.cols - 1, cur.col + dc)) };
        this.cursor = cur;
        this.hover = null;
        const c = this.cellCenter(cur.row, cur.col);
        const masked = m.causal && cur.col > cur.row + (m.rowOffset || 0);
        this.opts.onHover?.({ ...cur, value: this.value(cur.row, cur.col), masked, x: c.x, y: c.y, keyboard: true });
        this.drawOverlay();
        e.preventDefault();
      } else if ((e.key === "Enter" || e.key === " ") && (this.cursor || this.hover)) {
        const { row, col } = this.cursor || this.hover;
        this.opts.onCellClick?.({ row, col, event: e });
        e.preventDefault();
      } else if (e.key === "Escape") {
        this.opts.onEscape?.();
      }
    });
    el.addEventListener("blur", () => {
      this.cursor = null;
      this._clearHover();
    });
  }

  _clearHover() {
    const had = this.hover || this.labelHover != null;
    this.hover = null;
    this.labelHover = null;
    if (had) {
      this.opts.onHover?.(null);
      this.opts.onLabelHover?.(null);
      this.drawOverlay();
    }
  }

  /** A canvas with the rendered heatmap on an opaque background, for PNG export. */
  exportCanvas() {
    return opaqueCopy(this.base);
  }

  destroy() {
    this.wrap.remove();
  }
}
