// Line view (after bertviz): the tokens in two columns, queries on the left and keys on the
// right, a line from each query to each key it attends to with opacity by weight.
// Hovering a token keeps only its lines; clicking it keeps the filter until clicked again.

import { removeSink } from "../attention.js";
import { cssVar } from "../paint.js";
import { axisLabel, quoted, escapeHTML } from "../tokens.js";
import { showTooltip, hideTooltip } from "../tooltip.js";

const ROW = 18;
const FONT = '12px ui-monospace, "SF Mono", Menlo, Consolas, "DejaVu Sans Mono", monospace';

export class LineView {
  constructor(ctx) {
    this.ctx = ctx;
    this.focus = null; // {side: "q"|"k", index}
    this.locked = null;
    this.matrix = null;
  }

  mount(host) {
    this.host = host;
    this.scroller = document.createElement("div");
    this.scroller.className = "line-scroller";
    this.canvas = document.createElement("canvas");
    this.canvas.className = "line-canvas";
    this.canvas.tabIndex = 0;
    this.canvas.setAttribute("role", "img");
    this.canvas.setAttribute("aria-label", "Line view of the selected head: hover or use arrow keys to follow one token's lines");
    this.scroller.append(this.canvas);
    host.append(this.scroller);
    this.canvas.addEventListener("mousemove", (e) => this.onMove(e));
    this.canvas.addEventListener("mouseleave", () => {
      this.focus = null;
      hideTooltip();
      this.draw();
    });
    this.canvas.addEventListener("click", (e) => {
      const hit = this.hit(e);
      if (!hit) this.locked = null;
      else if (this.locked && this.locked.side === hit.side && this.locked.index === hit.index) this.locked = null;
      else this.locked = hit;
      this.draw();
    });
    this.canvas.addEventListener("keydown", (e) => {
      if (!this.matrix) return;
      const T = this.matrix.T;
      const cur = this.locked || { side: "q", index: -1 };
      if (e.key === "ArrowDown" || e.key === "ArrowUp") {
        const index = Math.max(0, Math.min(T - 1, cur.index + (e.key === "ArrowDown" ? 1 : -1)));
        this.locked = { side: cur.side, index };
      } else if (e.key === "ArrowLeft" || e.key === "ArrowRight") {
        this.locked = { side: e.key === "ArrowLeft" ? "q" : "k", index: Math.max(0, cur.index) };
      } else if (e.key === "Escape") this.locked = null;
      else return;
      e.preventDefault();
      this.draw();
      if (this.locked) {
        const p = this.point(this.locked);
        this.canvas.scrollIntoView?.({ block: "nearest" });
        this.tip(this.locked, p.x, p.y);
      } else hideTooltip();
    });
  }

  unmount() {
    hideTooltip();
    this.scroller?.remove();
  }

  async render(params, changed, isCurrent = () => true) {
    const { attention: att, selection: { layer, head }, settings: { sink }, tokens } = params;
    await att.ensure([layer]);
    if (!isCurrent()) return false;
    let m = att.head(layer, head);
    if (sink) m = removeSink(m, att.T);
    this.matrix = { data: m, T: att.T, tokens };
    this.title = `lines, layer ${layer} head ${head}${sink ? " (first-token sink hidden)" : ""}`;
    this.locked = null;
    this.ctx.setLegend(null);
    this.ctx.setCaption(
      `<b>Layer ${layer} · head ${head}</b> — queries on the left, keys on the right; line opacity is the attention weight (relative to the strongest line while a token is focused). Hover a token to see only its lines, click to keep them${sink ? "; first-token sink hidden" : ""}.`,
    );
    this.layout();
    this.draw();
    return true;
  }

  layout() {
    const ctx = this.canvas.getContext("2d");
    ctx.font = FONT;
    const labels = this.matrix.tokens.map((t) => axisLabel(t.text, 16));
    let w = 0;
    for (const l of labels) w = Math.max(w, ctx.measureText(l).width);
    const colW = Math.ceil(w) + 16;
    const W = Math.max(Math.min(320, colW * 2 + 80), Math.min(this.host.clientWidth - 8 || 700, colW * 2 + 460));
    const H = 30 + this.matrix.T * ROW + 10;
    this.geo = { labels, colW, W, H, qx: 24, kx: W - 24 - colW, top: 30 };
    const dpr = window.devicePixelRatio || 1;
    this.canvas.width = Math.round(W * dpr);
    this.canvas.height = Math.round(H * dpr);
    this.canvas.style.width = W + "px";
    this.canvas.style.height = H + "px";
  }

  point({ side, index }) {
    const g = this.geo;
    const r = this.canvas.getBoundingClientRect();
    const x = side === "q" ? g.qx + g.colW : g.kx;
    return { x: r.left + x, y: r.top + g.top + (index + 0.5) * ROW };
  }

  hit(e) {
    const g = this.geo;
    if (!g) return null;
    const r = this.canvas.getBoundingClientRect();
    const x = e.clientX - r.left;
    const y = e.clientY - r.top;
    const index = Math.floor((y - g.top) / ROW);
    if (index < 0 || index >= this.matrix.T) return null;
    if (x >= g.qx - 8 && x <= g.qx + g.colW + 8) return { side: "q", index };
    if (x >= g.kx - 8 && x <= g.kx + g.colW + 8) return { side: "k", index };
    return null;
  }

  onMove(e) {
    const hit = this.hit(e);
    const same = hit && this.focus && hit.side === this.focus.side && hit.index === this.focus.index;
    if (same) return;
    this.focus = hit;
    this.draw();
    if (hit) this.tip(hit, e.clientX, e.clientY);
    else hideTooltip();
  }

  tip({ side, index }, x, y) {
    const { data, T, tokens } = this.matrix;
    const pairs = [];
    for (let j = 0; j < T; j++) {
      const v = side === "q" ? data[index * T + j] : data[j * T + index];
      if (v > 0) pairs.push([j, v]);
    }
    pairs.sort((a, b) => b[1] - a[1]);
    const top = pairs
      .slice(0, 5)
      .map(([j, v]) => `<div class="tt-row"><span class="tt-tok">${escapeHTML(quoted(tokens[j], j))}</span><b>${v.toFixed(3)}</b></div>`)
      .join("");
    const head = side === "q" ? "attends most to" : "most attended by";
    showTooltip(`<div class="tt-cell"><span class="tt-tok">${escapeHTML(quoted(tokens[index], index))}</span> ${head}:</div>${top || '<div class="tt-muted">nothing</div>'}`, x, y);
  }

  draw() {
    if (!this.matrix || !this.geo) return;
    const dpr = window.devicePixelRatio || 1;
    const ctx = this.canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, this.geo.W, this.geo.H);
    this.paint(ctx, this.focus || this.locked);
  }

  /** Lines and token columns in CSS pixels, `active` = the focused token or null. */
  paint(ctx, active) {
    const { data, T } = this.matrix;
    const g = this.geo;
    const accent = cssVar("--accent");
    const text = cssVar("--text");
    const muted = cssVar("--muted");
    // headings
    ctx.font = '600 11px system-ui, -apple-system, "Segoe UI", sans-serif';
    ctx.fillStyle = muted;
    ctx.textBaseline = "top";
    ctx.textAlign = "left";
    ctx.fillText("query", g.qx, 8);
    ctx.textAlign = "right";
    ctx.fillText("key", g.kx + g.colW, 8);
    // weights of the other column for the active token
    const weight = new Float32Array(T);
    if (active) {
      for (let j = 0; j < T; j++) {
        const v = active.side === "q" ? data[active.index * T + j] : data[j * T + active.index];
        weight[j] = v === v ? v : 0;
      }
    }
    // with a focus, opacity is relative to the strongest of its lines (so diffuse heads still show)
    let scale = 1;
    if (active) {
      let mx = 0;
      for (let j = 0; j < T; j++) if (weight[j] > mx) mx = weight[j];
      scale = mx > 0 ? 1 / mx : 1;
      for (let j = 0; j < T; j++) weight[j] *= scale;
    }
    // lines, batched by opacity bucket
    const x0 = g.qx + g.colW + 4;
    const x1 = g.kx - 4;
    const yOf = (i) => g.top + (i + 0.5) * ROW;
    const buckets = Array.from({ length: 21 }, () => []);
    for (let i = 0; i < T; i++) {
      if (active && active.side === "q" && i !== active.index) continue;
      for (let j = 0; j <= i && j < T; j++) {
        if (active && active.side === "k" && j !== active.index) continue;
        const v = data[i * T + j] * scale;
        if (!(v > 0.01)) continue;
        buckets[Math.min(20, Math.round(v * 20))].push(i, j);
      }
    }
    ctx.strokeStyle = accent;
    ctx.lineWidth = active ? 2 : 1.25;
    for (let b = 1; b <= 20; b++) {
      const list = buckets[b];
      if (!list.length) continue;
      ctx.globalAlpha = Math.min(1, (b / 20) * (active ? 1 : 0.9));
      ctx.beginPath();
      for (let k = 0; k < list.length; k += 2) {
        const ya = yOf(list[k]);
        const yb = yOf(list[k + 1]);
        ctx.moveTo(x0, ya);
        ctx.bezierCurveTo((x0 + x1) / 2, ya, (x0 + x1) / 2, yb, x1, yb);
      }
      ctx.stroke();
    }
    ctx.globalAlpha = 1;
    // token columns
    ctx.font = FONT;
    ctx.textBaseline = "middle";
    for (const side of ["q", "k"]) {
      const x = side === "q" ? g.qx : g.kx;
      for (let i = 0; i < T; i++) {
        const y = g.top + i * ROW;
        const isActive = active && active.side === side && active.index === i;
        const other = active && active.side !== side;
        if (isActive) {
          ctx.fillStyle = accent;
          ctx.fillRect(x - 4, y + 1, g.colW + 8, ROW - 2);
        } else if (other && weight[i] > 0) {
          ctx.globalAlpha = 0.2 + 0.45 * weight[i];
          ctx.fillStyle = accent;
          ctx.fillRect(x - 4, y + 1, (g.colW + 8) * Math.min(1, weight[i] * 0.95 + 0.05), ROW - 2);
          ctx.globalAlpha = 1;
        }
        ctx.fillStyle = isActive ? cssVar("--accent-contrast", "#fff") : active && other && !(weight[i] > 0.005) ? muted : text;
        ctx.textAlign = side === "q" ? "right" : "left";
        ctx.fillText(g.labels[i], side === "q" ? x + g.colW - 4 : x + 4, y + ROW / 2);
      }
    }
  }

  exportPicture(scale = 1) {
    if (!this.matrix || !this.geo) return null;
    const c = document.createElement("canvas");
    c.width = Math.round(this.geo.W * scale);
    c.height = Math.round(this.geo.H * scale);
    const ctx = c.getContext("2d");
    ctx.scale(scale, scale);
    this.paint(ctx, this.locked);
    return { canvas: c, title: this.title, legend: null };
  }

  exportData() {
    if (!this.matrix) return null;
    const { data, T, tokens } = this.matrix;
    const lines = [];
    for (let i = 0; i < T; i++)
      for (let j = 0; j <= i; j++) {
        const v = data[i * T + j];
        if (v > 0.01) lines.push({ query: i, key: j, weight: +v.toFixed(5) });
      }
    return { title: this.title, tokens, lines };
  }
}
