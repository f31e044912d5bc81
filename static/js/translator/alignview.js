// Alignment lines (bertviz's sentence-pair picture): target tokens on the left, source tokens
// on the right, a line from each decoder step to each source token it reads, opacity by
// cross-attention weight. A pinned step (Cross view, or a click here) keeps only its lines.

import { cssVar } from "../paint.js";
import { axisLabel } from "../tokens.js";
import { translationFor, isTranslator, describeAvg } from "./translation.js";

const ROW = 20;
const TARGET_HEADING = "target →";
const SOURCE_HEADING = "← source";
const FONT = '12px ui-monospace, "SF Mono", Menlo, Consolas, "DejaVu Sans Mono", monospace';

export class AlignView {
  constructor(ctx) {
    this.ctx = ctx;
    this.data = null;
  }

  mount(host) {
    this.host = host;
    this.canvas = document.createElement("canvas");
    this.canvas.className = "line-canvas align-canvas";
    this.canvas.setAttribute("role", "img");
    this.canvas.setAttribute("aria-label", "Cross-attention lines from target steps (left) to source tokens (right)");
    host.append(this.canvas);
    this.canvas.addEventListener("click", (e) => {
      if (!this.data) return;
      const y = e.offsetY - ROW;
      const t = Math.floor(y / ROW);
      const pinned = this.params.selection.pinned;
      this.ctx.select({ pin: t >= 0 && t < this.data.set.T && !(pinned.length === 1 && pinned[0] === t) ? [t] : [] });
    });
  }

  unmount() {
    this.canvas?.remove();
    this.canvas = null;
  }

  async render(params, changed, isCurrent = () => true) {
    if (!params.attention || !isTranslator(params.attention.meta)) {
      this.data = null;
      this.ctx.setLegend(null);
      return false;
    }
    const set = await translationFor(params.attention, params.model.name);
    if (!isCurrent() || !this.canvas) return false;
    const { layer, head } = params.selection;
    const avg = params.settings.xavg ?? "head";
    this.params = params;
    this.data = { set, m: set.pick("cross", avg, layer, head), title: `alignment, ${describeAvg(avg, layer, head)}` };
    this.ctx.setLegend(null);
    this.ctx.setCaption(`<b>Alignment</b> — ${describeAvg(avg, layer, head)}: each decoder step (left) joined to the source tokens (right) it reads, ` +
      `darker for more attention. Click a step to keep only its lines.`);
    this.draw();
    return true;
  }

  draw() {
    const { set, m } = this.data;
    const c = this.canvas;
    const ctx2 = c.getContext("2d");
    ctx2.font = FONT;
    const label = (t) => axisLabel(t.text);
    // each column as wide as its longest label or its heading, whichever is wider
    const wl = Math.max(ctx2.measureText(TARGET_HEADING).width + 8, ...set.target.map((t, i) => ctx2.measureText(label(t, i)).width)) + 12;
    const wr = Math.max(ctx2.measureText(SOURCE_HEADING).width + 8, ...set.source.map((t, i) => ctx2.measureText(label(t, i)).width)) + 12;
    const gap = Math.max(120, Math.min(260, (this.host?.clientWidth || 800) - wl - wr - 8)); // fits a phone
    const width = wl + gap + wr;
    this.geo = { wl, gap, wr, width, source: wl + gap + 4, target: 4 }; // where the two headings start
    const height = (Math.max(set.T, set.S) + 1) * ROW + 8;
    const dpr = window.devicePixelRatio || 1;
    c.width = width * dpr;
    c.height = height * dpr;
    c.style.width = `${width}px`;
    c.style.height = `${height}px`;
    ctx2.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx2.font = FONT;
    ctx2.fillStyle = cssVar("--text", "#222");
    ctx2.textBaseline = "middle";
    ctx2.fillText(TARGET_HEADING, 4, ROW / 2);
    ctx2.fillText(SOURCE_HEADING, wl + gap + 4, ROW / 2);
    const yOf = (i) => ROW + i * ROW + ROW / 2;
    const pinned = this.params.selection.pinned.filter((t) => t < set.T);
    const accent = cssVar("--accent") || "#3366cc";
    for (let t = 0; t < set.T; t++) {
      if (pinned.length && !pinned.includes(t)) continue;
      for (let s = 0; s < set.S; s++) {
        const w = m[t * set.S + s];
        if (!(w > 0.01)) continue;
        ctx2.globalAlpha = Math.min(1, w);
        ctx2.strokeStyle = accent;
        ctx2.lineWidth = 1 + 3 * w;
        ctx2.beginPath();
        ctx2.moveTo(wl, yOf(t));
        ctx2.lineTo(wl + gap, yOf(s));
        ctx2.stroke();
      }
    }
    ctx2.globalAlpha = 1;
    ctx2.fillStyle = cssVar("--text", "#222");
    ctx2.textAlign = "right";
    set.target.forEach((t, i) => ctx2.fillText(label(t, i), wl - 6, yOf(i)));
    ctx2.textAlign = "left";
    set.source.forEach((t, i) => ctx2.fillText(label(t, i), wl + gap + 6, yOf(i)));
  }

  exportPicture() {
    return this.data ? { canvas: this.canvas, title: this.data.title, legend: null } : null;
  }

  exportData() {
    if (!this.data) return null;
    const { set, m } = this.data;
    const matrix = [];
    for (let t = 0; t < set.T; t++) matrix.push(Array.from(m.subarray(t * set.S, (t + 1) * set.S), (v) => +v.toFixed(6)));
    return { title: this.data.title, target_tokens: set.target, source_tokens: set.source, matrix };
  }
}
