// The head view of a long input (more than LONG_TOKENS): one head read a window at a time, never
// whole. The map opens pooled to the canvas's resolution; the wheel (or + / −, or the buttons)
// zooms around the pointer, a drag pans, a double click shows the whole map again. Each window
// on view is fetched reduced on the server (AttentionSet.window): at full resolution once it spans
// no more positions than the canvas has pixels, pooled to them before. Token labels appear once a
// zoom makes them readable (a cell at least LABEL_PX tall). The window is the state key `win`
// ([row start, row end, column start, column end]; null: the whole map), so a link reopens it.

import { paintMatrix, cssVar, parseColor, MONO } from "../paint.js";
import { colourScale, SCALES } from "../scales.js";
import { showTooltip, hideTooltip } from "../tooltip.js";
import { escapeHTML, quoted, visible } from "../tokens.js";

const LABEL_PX = 11; // a cell this tall (and wide) or more gets its token's label
const MARGIN = 96; // css px left of and above the plot, for labels and ticks
const MIN_SPAN = 8; // the deepest zoom: this many positions a side
const ZOOM_STEP = 1.6;

export class LongHeadView {
  constructor(ctx) {
    this.ctx = ctx;
    this.params = null;
    this.tile = null;
    this.controller = null;
    this.drag = null;
  }

  mount(host) {
    this.host = host;
    this.root = document.createElement("div");
    this.root.className = "long-head";
    this.root.innerHTML =
      '<div class="long-head-bar"><button type="button" class="btn small" data-act="whole">Whole map</button> ' +
      '<button type="button" class="btn small" data-act="in" aria-label="Zoom in">Zoom in +</button> ' +
      '<button type="button" class="btn small" data-act="out" aria-label="Zoom out">Zoom out −</button> ' +
      '<span class="long-head-status tt-muted" aria-live="polite"></span></div>';
    this.canvas = document.createElement("canvas");
    this.canvas.className = "long-head-canvas";
    this.canvas.tabIndex = 0;
    this.canvas.setAttribute("aria-label", "Attention map of a long input: the wheel or + and − zoom, a drag or the arrow keys pan, 0 shows the whole map");
    this.root.append(this.canvas);
    host.append(this.root);
    this.status = this.root.querySelector(".long-head-status");
    this.bitmap = document.createElement("canvas");
    this.root.querySelector('[data-act="whole"]').addEventListener("click", () => this.setWindow(null));
    this.root.querySelector('[data-act="in"]').addEventListener("click", () => this.zoomAt(1 / ZOOM_STEP, 0.5, 0.5));
    this.root.querySelector('[data-act="out"]').addEventListener("click", () => this.zoomAt(ZOOM_STEP, 0.5, 0.5));
    const c = this.canvas;
    c.addEventListener("wheel", (e) => {
      const p = this.plotPoint(e);
      if (!p) return;
      e.preventDefault();
      this.zoomAt(e.deltaY < 0 ? 1 / ZOOM_STEP : ZOOM_STEP, p.fx, p.fy);
    }, { passive: false });
    c.addEventListener("pointerdown", (e) => {
      const p = this.plotPoint(e);
      if (!p) return;
      this.drag = { x: e.clientX, y: e.clientY, win: this.window() };
      c.setPointerCapture(e.pointerId);
    });
    c.addEventListener("pointermove", (e) => {
      if (this.drag) return this.dragTo(e);
      this.hover(e);
    });
    const end = () => {
      this.drag = null;
    };
    c.addEventListener("pointerup", end);
    c.addEventListener("pointercancel", end);
    c.addEventListener("pointerleave", hideTooltip);
    c.addEventListener("dblclick", () => this.setWindow(null));
    c.addEventListener("keydown", (e) => {
      const [r0, r1, c0, c1] = this.window();
      const dy = Math.max(1, Math.round((r1 - r0) / 4));
      const dx = Math.max(1, Math.round((c1 - c0) / 4));
      const moves = { ArrowUp: [-dy, 0], ArrowDown: [dy, 0], ArrowLeft: [0, -dx], ArrowRight: [0, dx] };
      if (e.key === "+" || e.key === "=") this.zoomAt(1 / ZOOM_STEP, 0.5, 0.5);
      else if (e.key === "-") this.zoomAt(ZOOM_STEP, 0.5, 0.5);
      else if (e.key === "0") this.setWindow(null);
      else if (moves[e.key]) this.setWindow(this.clamp([r0 + moves[e.key][0], r1 + moves[e.key][0], c0 + moves[e.key][1], c1 + moves[e.key][1]]));
      else return;
      e.preventDefault();
    });
  }

  unmount() {
    hideTooltip();
    this.controller?.abort();
    this.root?.remove();
  }

  get T() {
    return this.params.attention.T;
  }

  /** The window on view: [r0, r1, c0, c1] (end exclusive), the state's clamped to the input. */
  window() {
    const win = this.params.settings.win;
    return win && win.length === 4 ? this.clamp(win) : [0, this.T, 0, this.T];
  }

  /** A window moved inside [0, T) on both axes, at least MIN_SPAN a side (or T). */
  clamp([r0, r1, c0, c1]) {
    const T = this.T;
    const fit = (a, b) => {
      let span = Math.min(T, Math.max(Math.min(MIN_SPAN, T), Math.round(b - a)));
      let start = Math.round(a);
      start = Math.max(0, Math.min(T - span, start));
      return [start, start + span];
    };
    return [...fit(r0, r1), ...fit(c0, c1)];
  }

  setWindow(win) {
    const whole = !win || (win[0] === 0 && win[1] === this.T && win[2] === 0 && win[3] === this.T);
    this.ctx.select({ win: whole ? null : win });
  }

  /** Zoom by `factor` (< 1: in) keeping the point at (fx, fy) of the plot (fractions) in place. */
  zoomAt(factor, fx, fy) {
    const [r0, r1, c0, c1] = this.window();
    const rSpan = (r1 - r0) * factor;
    const cSpan = (c1 - c0) * factor;
    const rAt = r0 + fy * (r1 - r0);
    const cAt = c0 + fx * (c1 - c0);
    this.setWindow(this.clamp([rAt - fy * rSpan, rAt - fy * rSpan + rSpan, cAt - fx * cSpan, cAt - fx * cSpan + cSpan]));
  }

  dragTo(e) {
    const { x, y, win } = this.drag;
    const plot = this.plot();
    const [r0, r1, c0, c1] = win;
    const dr = ((e.clientY - y) / plot) * (r1 - r0);
    const dc = ((e.clientX - x) / plot) * (c1 - c0);
    if (Math.abs(dr) < 1 && Math.abs(dc) < 1) return;
    const next = this.clamp([r0 - dr, r1 - dr, c0 - dc, c1 - dc]);
    const now = this.window();
    if (next.every((v, i) => v === now[i])) return;
    this.setWindow(next);
  }

  /** The plot's side in css px: the host's width, or the window's height, whichever is less. */
  plot() {
    const width = Math.min(this.host.clientWidth || 800, 960);
    return Math.max(160, Math.min(width - MARGIN - 8, (window.innerHeight || 800) - MARGIN - 160));
  }

  /** The pointer as fractions of the plot, or null outside it. */
  plotPoint(e) {
    const r = this.canvas.getBoundingClientRect();
    const x = e.clientX - r.left - MARGIN;
    const y = e.clientY - r.top - MARGIN;
    const plot = this.plot();
    if (x < 0 || y < 0 || x >= plot || y >= plot) return null;
    return { fx: x / plot, fy: y / plot, x, y };
  }

  async render(params, changed, isCurrent = () => true) {
    this.params = params;
    const att = params.attention;
    const { layer, head } = params.selection;
    const [r0, r1, c0, c1] = this.window();
    const plot = this.plot();
    this.controller?.abort();
    const controller = (this.controller = new AbortController());
    this.status.textContent = "loading…";
    const started = performance.now();
    let tile;
    try {
      tile = await this.ctx.track(att.window(layer, head, { rows: [r0, r1], cols: [c0, c1], pixels: Math.floor(plot), signal: controller.signal }));
    } catch (err) {
      if (controller.signal.aborted || !isCurrent()) return false;
      this.status.textContent = "";
      this.ctx.showError(err, "Loading attention");
      return false;
    }
    if (!isCurrent() || controller.signal.aborted) return false;
    this.tile = tile;
    const t0 = performance.now();
    this.draw(tile, plot);
    const drawMs = performance.now() - t0;
    window.__attnlens.perf.longHead = { T: att.T, window: [r0, r1, c0, c1], pooled: tile.pooled, nr: tile.nr, nc: tile.nc, labels: this.labelled, drawMs, totalMs: performance.now() - started, bytes: att.bytesFetched };
    const bins = tile.pooled ? `pooled to ${tile.nr} × ${tile.nc} bins of about ${((r1 - r0) / tile.nr).toFixed(1)} tokens` : "every token";
    this.status.textContent = `rows ${r0}–${r1 - 1}, columns ${c0}–${c1 - 1} of ${att.T}: ${bins}`;
    this.ctx.setCaption(
      `<b>Layer ${layer} · head ${head}</b>${params.scope ? ` of ${params.scope}` : ""} on ${att.T} tokens, read a window at a time: ${bins}${tile.pooled ? " (a cell: the mean, over its row bin's queries, of their attention to its column bin's keys)" : ""}. Scroll to zoom at the pointer, drag to pan, double-click for the whole map; token labels appear once they are readable.`,
    );
    return true;
  }

  draw(tile, plot) {
    const { settings } = this.params;
    const sc = colourScale(this.params.causal && tile.pooled ? maskedPool(tile) : tile.data, tile.nc, settings.scale);
    const [r0, , c0] = this.window();
    const causal = this.params.causal && !tile.pooled;
    paintMatrix(sc.data, tile.nr, tile.nc, { cmap: settings.cmap, vmin: sc.vmin, vmax: sc.vmax, gamma: sc.gamma, causal, rowOffset: r0 - c0, maskColor: parseColor(cssVar("--heat-masked", "#e5e7eb")), canvas: this.bitmap });
    const dpr = window.devicePixelRatio || 1;
    const side = MARGIN + plot + 4;
    this.canvas.style.width = `${side}px`;
    this.canvas.style.height = `${side}px`;
    this.canvas.width = Math.round(side * dpr);
    this.canvas.height = Math.round(side * dpr);
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, side, side);
    ctx.imageSmoothingEnabled = false;
    ctx.drawImage(this.bitmap, MARGIN, MARGIN, plot, plot);
    this.drawAxes(ctx, tile, plot);
    this.legend = { cmap: settings.cmap, vmin: sc.vmin, vmax: sc.vmax, gamma: sc.gamma, label: `${tile.pooled ? "pooled attention" : "attention weight"}, ${SCALES[settings.scale]}` };
    this.ctx.setLegend(this.legend);
  }

  /** Token labels when cells are LABEL_PX or more, else position ticks. */
  drawAxes(ctx, tile, plot) {
    const tokens = this.params.tokens;
    const ch = plot / tile.nr;
    const cw = plot / tile.nc;
    ctx.fillStyle = cssVar("--text", "#111");
    ctx.font = `11px ${MONO}`;
    const text = (i) => {
      const t = visible(tokens[i]?.text ?? "");
      return t.length > 12 ? `${t.slice(0, 11)}…` : t;
    };
    this.labelled = !tile.pooled && ch >= LABEL_PX && cw >= LABEL_PX;
    if (!tile.pooled && ch >= LABEL_PX) {
      ctx.textAlign = "right";
      ctx.textBaseline = "middle";
      for (let r = 0; r < tile.nr; r++) ctx.fillText(text(tile.rowEdges[r]), MARGIN - 4, MARGIN + (r + 0.5) * ch);
    } else this.ticks(ctx, tile.rowEdges, ch, "row");
    if (!tile.pooled && cw >= LABEL_PX) {
      ctx.save();
      ctx.textAlign = "left";
      ctx.textBaseline = "middle";
      for (let c = 0; c < tile.nc; c++) {
        ctx.save();
        ctx.translate(MARGIN + (c + 0.5) * cw, MARGIN - 4);
        ctx.rotate(-Math.PI / 2);
        ctx.fillText(text(tile.colEdges[c]), 0, 0);
        ctx.restore();
      }
      ctx.restore();
    } else this.ticks(ctx, tile.colEdges, cw, "col");
  }

  /** Position numbers about every 60 px along one axis. */
  ticks(ctx, edges, cell, axis) {
    const every = Math.max(1, Math.ceil(60 / cell));
    ctx.textAlign = axis === "row" ? "right" : "center";
    ctx.textBaseline = axis === "row" ? "middle" : "bottom";
    for (let i = 0; i < edges.length - 1; i += every) {
      const at = MARGIN + i * cell;
      if (axis === "row") ctx.fillText(String(edges[i]), MARGIN - 4, at);
      else ctx.fillText(String(edges[i]), at, MARGIN - 4);
    }
  }

  hover(e) {
    const p = this.plotPoint(e);
    const tile = this.tile;
    if (!p || !tile) return hideTooltip();
    const r = Math.min(tile.nr - 1, Math.floor(p.fy * tile.nr));
    const c = Math.min(tile.nc - 1, Math.floor(p.fx * tile.nc));
    const v = tile.data[r * tile.nc + c];
    const tokens = this.params.tokens;
    const span = (edges, i) => (edges[i + 1] - edges[i] > 1 ? `tokens ${edges[i]}–${edges[i + 1] - 1}` : escapeHTML(quoted(tokens[edges[i]], edges[i])));
    const what = tile.pooled ? "mean over these queries of their attention to these keys" : "attention weight";
    showTooltip(`<div class="tt-cell">${span(tile.rowEdges, r)} → ${span(tile.colEdges, c)}: <b>${v.toFixed(4)}</b></div><div class="tt-muted">${what}</div>`, e.clientX, e.clientY);
  }

  exportPicture() {
    if (!this.tile) return null;
    const { layer, head } = this.params.selection;
    return { canvas: this.canvas, title: `layer ${layer}, head ${head} (${this.status.textContent})`, legend: this.legend };
  }

  exportData() {
    if (!this.tile) return null;
    const t = this.tile;
    const matrix = [];
    for (let r = 0; r < t.nr; r++) matrix.push(Array.from(t.data.subarray(r * t.nc, (r + 1) * t.nc), (v) => +v.toFixed(6)));
    return { title: this.status.textContent, row_edges: t.rowEdges, col_edges: t.colEdges, pooled: t.pooled, matrix };
  }
}

/** A causal map's pooled tile with the cells no query of the row bin can see (every key of the
 * column bin after the bin's last query) as NaN, drawn in the masked colour. */
function maskedPool(tile) {
  const out = Float32Array.from(tile.data);
  for (let r = 0; r < tile.nr; r++) {
    const last = tile.rowEdges[r + 1] - 1;
    for (let c = 0; c < tile.nc; c++) if (tile.colEdges[c] > last) out[r * tile.nc + c] = NaN;
  }
  return out;
}
