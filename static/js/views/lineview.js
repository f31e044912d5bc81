// Line view (after bertviz): the tokens in two columns, queries on the left and keys on the
// right, a line from each query to each key it attends to with opacity by weight. One head
// (the toolbar's), or several heads of the layer at once, each in its own colour, toggled by
// the coloured chips above the picture (click: add or remove a head; double-click: that head
// alone). Hovering a token keeps only its lines; clicking it keeps the filter until clicked again.
//
// Speed: the canvas is only as tall as the visible window and is redrawn on scroll, so a long
// text (256 tokens is 4,600 px of rows) costs what the window shows, not what the text holds;
// each head's lines are listed once per render (only those that would show), not per frame.

import { removeSink } from "../attention.js";
import { cssVar } from "../paint.js";
import { headColour } from "../colormap.js";
import { axisLabel, quoted, escapeHTML } from "../tokens.js";
import { showTooltip, hideTooltip } from "../tooltip.js";

const ROW = 18;
const TOP = 30; // the headings' band
const FONT = '12px ui-monospace, "SF Mono", Menlo, Consolas, "DejaVu Sans Mono", monospace';
const BUCKETS = 20; // opacity steps: one path per head and step
const MIN_WEIGHT = 0.5 / BUCKETS; // a weaker line rounds to opacity 0: it is not drawn

/** Each head's lines worth drawing: query, key and weight, as three parallel arrays. */
function lineList(data, T, causal) {
  const q = [];
  const k = [];
  const w = [];
  for (let i = 0; i < T; i++) {
    const end = causal ? i + 1 : T; // a causal map has nothing right of its diagonal
    for (let j = 0; j < end; j++) {
      const v = data[i * T + j];
      if (v >= MIN_WEIGHT) {
        q.push(i);
        k.push(j);
        w.push(v);
      }
    }
  }
  return { q: Int32Array.from(q), k: Int32Array.from(k), w: Float32Array.from(w) };
}

export class LineView {
  constructor(ctx) {
    this.ctx = ctx;
    this.focus = null; // {side: "q"|"k", index}
    this.locked = null;
    this.matrix = null; // {heads: [{head, data, colour, lines}], T, tokens, causal}
    this.frame = 0;
  }

  mount(host) {
    this.host = host;
    this.root = document.createElement("div");
    this.root.className = "line-view";
    this.chips = document.createElement("div");
    this.chips.className = "line-heads";
    this.chips.setAttribute("role", "group");
    this.chips.setAttribute("aria-label", "Heads drawn: click to add or remove one, double-click for that head alone");
    this.scroller = document.createElement("div");
    this.scroller.className = "line-scroller";
    this.spacer = document.createElement("div");
    this.spacer.className = "line-spacer";
    this.canvas = document.createElement("canvas");
    this.canvas.className = "line-canvas";
    this.canvas.tabIndex = 0;
    this.canvas.setAttribute("role", "img");
    this.canvas.setAttribute("aria-label", "Line view of the selected heads: hover or use arrow keys to follow one token's lines");
    this.spacer.append(this.canvas);
    this.scroller.append(this.spacer);
    this.root.append(this.chips, this.scroller);
    host.append(this.root);
    this.scroller.addEventListener("scroll", () => this.requestDraw(), { passive: true });
    this.canvas.addEventListener("mousemove", (e) => this.onMove(e));
    this.canvas.addEventListener("mouseleave", () => {
      this.focus = null;
      hideTooltip();
      this.requestDraw();
    });
    this.canvas.addEventListener("click", (e) => {
      const hit = this.hit(e);
      if (!hit) this.locked = null;
      else if (this.locked && this.locked.side === hit.side && this.locked.index === hit.index) this.locked = null;
      else this.locked = hit;
      this.draw();
    });
    this.canvas.addEventListener("keydown", (e) => this.onKey(e));
  }

  unmount() {
    hideTooltip();
    cancelAnimationFrame(this.frame);
    this.root?.remove();
  }

  async render(params, changed, isCurrent = () => true) {
    const { attention: att, selection: { layer, head, lineHeads }, settings: { sink }, tokens, causal, model, scope } = params;
    await att.ensure([layer]);
    if (!isCurrent()) return false;
    this.params = params;
    const several = lineHeads != null;
    const shown = several ? lineHeads : [head];
    const accent = cssVar("--accent");
    this.matrix = {
      heads: shown.map((h) => {
        let data = att.head(layer, h);
        if (sink) data = removeSink(data, att.T);
        return { head: h, data, colour: several ? headColour(h) : accent, lines: lineList(data, att.T, causal) };
      }),
      T: att.T,
      tokens,
      causal,
    };
    const which = several ? (shown.length === model.n_heads ? `all ${shown.length} heads` : shown.length ? `heads ${shown.join(", ")}` : "no head") : `head ${head}`;
    this.title = `lines, layer ${layer} ${which}${sink ? " (first-token sink hidden)" : ""}`;
    this.locked = null;
    this.drawChips(model.n_heads, head, lineHeads);
    this.ctx.setLegend(null);
    this.ctx.setCaption(
      `<b>Layer ${layer} · ${which}</b>${scope ? ` of ${scope}` : ""} — queries on the left, keys on the right; line opacity is the attention weight` +
        `${several ? ", each head in its colour" : ""} (relative to the strongest line while a token is focused). Hover a token to see only its lines, click to keep them` +
        `${several ? "" : "; the coloured chips draw several heads at once"}${sink ? "; first-token sink hidden" : ""}.`,
    );
    this.layout();
    this.draw();
    return true;
  }

  /** The head chips: one per head in its colour, pressed when drawn; then "all" and "one". */
  drawChips(H, head, lineHeads) {
    const on = new Set(lineHeads ?? [head]);
    const pick = (list) => this.ctx.select({ lheads: list });
    const chips = [];
    for (let h = 0; h < H; h++) {
      const b = document.createElement("button");
      b.type = "button";
      b.className = "head-chip";
      b.dataset.head = h;
      b.style.setProperty("--head-colour", lineHeads == null ? cssVar("--accent") : headColour(h));
      b.setAttribute("aria-pressed", String(on.has(h)));
      b.textContent = `H${h}`;
      b.title = `head ${h}: click to ${on.has(h) ? "remove it" : "add it"}, double-click for it alone`;
      b.addEventListener("click", (e) => {
        if (e.detail > 1) return; // the second click of a double-click
        const next = new Set(on);
        if (next.has(h)) next.delete(h);
        else next.add(h);
        pick([...next]);
      });
      b.addEventListener("dblclick", () => pick([h]));
      chips.push(b);
    }
    const all = document.createElement("button");
    all.type = "button";
    all.className = "btn small";
    all.dataset.act = "all-heads";
    all.textContent = "All heads";
    all.disabled = lineHeads?.length === H;
    all.addEventListener("click", () => pick([...Array(H).keys()]));
    const one = document.createElement("button");
    one.type = "button";
    one.className = "btn small";
    one.dataset.act = "one-head";
    one.textContent = `Only H${head}`;
    one.title = "The toolbar's head alone";
    one.disabled = lineHeads == null;
    one.addEventListener("click", () => pick(null));
    const label = document.createElement("span");
    label.className = "line-heads-label";
    label.textContent = "Heads";
    this.chips.replaceChildren(label, ...chips, all, one);
  }

  layout() {
    const ctx = this.canvas.getContext("2d");
    ctx.font = FONT;
    const labels = this.matrix.tokens.map((t) => axisLabel(t.text, 16));
    let w = 0;
    for (const l of labels) w = Math.max(w, ctx.measureText(l).width);
    const colW = Math.ceil(w) + 16;
    const avail = this.scroller.clientWidth - 2 || this.host.clientWidth - 8 || 700;
    const W = Math.min(Math.max(Math.min(320, colW * 2 + 80), Math.min(avail, colW * 2 + 460)), Math.max(avail, 200));
    const H = TOP + this.matrix.T * ROW + 10;
    this.spacer.style.height = H + "px";
    this.spacer.style.width = W + "px";
    this.canvas.style.width = W + "px";
    this.canvas.style.height = "0px";
    // the window: what the scroller shows of the H pixels (its max-height is the page's to set)
    const V = Math.max(1, Math.min(H, this.scroller.clientHeight || H));
    this.geo = { labels, colW, W, H, V, qx: 24, kx: W - 24 - colW };
    const dpr = window.devicePixelRatio || 1;
    this.canvas.width = Math.round(W * dpr);
    this.canvas.height = Math.round(V * dpr);
    this.canvas.style.height = V + "px";
  }

  /** The top of the window in content pixels (the canvas sticks to the scroller's top). */
  get y0() {
    return Math.max(0, Math.min(this.geo.H - this.geo.V, this.scroller.scrollTop));
  }

  point({ side, index }) {
    const g = this.geo;
    const r = this.canvas.getBoundingClientRect();
    const x = side === "q" ? g.qx + g.colW : g.kx;
    return { x: r.left + x, y: r.top + TOP + (index + 0.5) * ROW - this.y0 };
  }

  hit(e) {
    const g = this.geo;
    if (!g) return null;
    const r = this.canvas.getBoundingClientRect();
    const x = e.clientX - r.left;
    const y = e.clientY - r.top + this.y0;
    const index = Math.floor((y - TOP) / ROW);
    if (index < 0 || index >= this.matrix.T) return null;
    if (x >= g.qx - 8 && x <= g.qx + g.colW + 8) return { side: "q", index };
    if (x >= g.kx - 8 && x <= g.kx + g.colW + 8) return { side: "k", index };
    return null;
  }

  onMove(e) {
    const hit = this.hit(e);
    const same = hit && this.focus && hit.side === this.focus.side && hit.index === this.focus.index;
    if (same || (!hit && !this.focus)) return;
    this.focus = hit;
    this.draw();
    if (hit) this.tip(hit, e.clientX, e.clientY);
    else hideTooltip();
  }

  onKey(e) {
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
    if (this.locked) {
      // keep the locked token in the window
      const y = TOP + (this.locked.index + 0.5) * ROW;
      if (y < this.y0 + ROW || y > this.y0 + this.geo.V - ROW) this.scroller.scrollTop = y - this.geo.V / 2;
      this.canvas.scrollIntoView?.({ block: "nearest" });
    }
    this.draw();
    if (this.locked) {
      const p = this.point(this.locked);
      this.tip(this.locked, p.x, p.y);
    } else hideTooltip();
  }

  /** The weight of query `i` on key `j`, for head entry `hd`. */
  static weight(hd, T, i, j) {
    const v = hd.data[i * T + j];
    return v === v ? v : 0;
  }

  tip({ side, index }, x, y) {
    const { heads, T, tokens } = this.matrix;
    if (!heads.length) return hideTooltip();
    // the mean over the drawn heads (one head: its weights)
    const pairs = [];
    for (let j = 0; j < T; j++) {
      let v = 0;
      for (const hd of heads) v += side === "q" ? LineView.weight(hd, T, index, j) : LineView.weight(hd, T, j, index);
      v /= heads.length;
      if (v > 0) pairs.push([j, v]);
    }
    pairs.sort((a, b) => b[1] - a[1]);
    const top = pairs
      .slice(0, 5)
      .map(([j, v]) => `<div class="tt-row"><span class="tt-tok">${escapeHTML(quoted(tokens[j], j))}</span><b>${v.toFixed(3)}</b></div>`)
      .join("");
    const head = `${side === "q" ? "attends most to" : "most attended by"}${heads.length > 1 ? ` (mean of ${heads.length} heads)` : ""}`;
    showTooltip(`<div class="tt-cell"><span class="tt-tok">${escapeHTML(quoted(tokens[index], index))}</span> ${head}:</div>${top || '<div class="tt-muted">nothing</div>'}`, x, y);
  }

  requestDraw() {
    if (this.frame) return;
    this.frame = requestAnimationFrame(() => {
      this.frame = 0;
      this.draw();
    });
  }

  draw() {
    if (!this.matrix || !this.geo) return;
    const dpr = window.devicePixelRatio || 1;
    const ctx = this.canvas.getContext("2d");
    const y0 = this.y0;
    ctx.setTransform(dpr, 0, 0, dpr, 0, -y0 * dpr);
    ctx.clearRect(0, y0, this.geo.W, this.geo.V);
    this.paint(ctx, this.focus || this.locked, y0, y0 + this.geo.V);
  }

  /**
   * Lines and token columns in content pixels, for content rows between y `from` and `to`;
   * `active` = the focused token or null.
   */
  paint(ctx, active, from, to) {
    const { heads, T } = this.matrix;
    const g = this.geo;
    const accent = cssVar("--accent");
    const text = cssVar("--text");
    const muted = cssVar("--muted");
    // headings
    if (from < TOP) {
      ctx.font = '600 11px system-ui, -apple-system, "Segoe UI", sans-serif';
      ctx.fillStyle = muted;
      ctx.textBaseline = "top";
      ctx.textAlign = "left";
      ctx.fillText("query", g.qx, 8);
      ctx.textAlign = "right";
      ctx.fillText("key", g.kx + g.colW, 8);
    }
    // the active token's weight on each token of the other column: the largest over the drawn heads
    const weight = new Float32Array(T);
    let scale = 1;
    if (active) {
      for (const hd of heads)
        for (let j = 0; j < T; j++) {
          const v = active.side === "q" ? LineView.weight(hd, T, active.index, j) : LineView.weight(hd, T, j, active.index);
          if (v > weight[j]) weight[j] = v;
        }
      // with a focus, opacity is relative to the strongest of its lines (so diffuse heads still show)
      let mx = 0;
      for (let j = 0; j < T; j++) if (weight[j] > mx) mx = weight[j];
      scale = mx > 0 ? 1 / mx : 1;
      for (let j = 0; j < T; j++) weight[j] *= scale;
    }
    const x0 = g.qx + g.colW + 4;
    const x1 = g.kx - 4;
    const xm = (x0 + x1) / 2;
    const yOf = (i) => TOP + (i + 0.5) * ROW;
    ctx.lineWidth = active ? 2 : heads.length > 1 ? 1 : 1.25;
    for (const hd of heads) {
      ctx.strokeStyle = hd.colour;
      if (active) {
        // the focused token's lines only: at most T, each drawn by itself
        for (let j = 0; j < T; j++) {
          const [i, k] = active.side === "q" ? [active.index, j] : [j, active.index];
          if (this.matrix.causal && k > i) continue;
          const v = LineView.weight(hd, T, i, k) * scale;
          if (!(v >= MIN_WEIGHT)) continue;
          ctx.globalAlpha = Math.min(1, v);
          this.curve(ctx, x0, x1, xm, yOf(i), yOf(k));
        }
        continue;
      }
      // every line that crosses the window, batched by opacity step
      const { q, k, w } = hd.lines;
      const buckets = Array.from({ length: BUCKETS + 1 }, () => []);
      for (let n = 0; n < w.length; n++) {
        const ya = yOf(q[n]);
        const yb = yOf(k[n]);
        if ((ya < from && yb < from) || (ya > to && yb > to)) continue;
        buckets[Math.min(BUCKETS, Math.round(w[n] * BUCKETS))].push(ya, yb);
      }
      for (let b = 1; b <= BUCKETS; b++) {
        const list = buckets[b];
        if (!list.length) continue;
        ctx.globalAlpha = Math.min(1, (b / BUCKETS) * 0.9);
        ctx.beginPath();
        for (let n = 0; n < list.length; n += 2) {
          ctx.moveTo(x0, list[n]);
          ctx.bezierCurveTo(xm, list[n], xm, list[n + 1], x1, list[n + 1]);
        }
        ctx.stroke();
      }
    }
    ctx.globalAlpha = 1;
    // token columns: the rows in the window
    const first = Math.max(0, Math.floor((from - TOP) / ROW));
    const last = Math.min(T - 1, Math.ceil((to - TOP) / ROW));
    ctx.font = FONT;
    ctx.textBaseline = "middle";
    for (const side of ["q", "k"]) {
      const x = side === "q" ? g.qx : g.kx;
      ctx.textAlign = side === "q" ? "right" : "left";
      for (let i = first; i <= last; i++) {
        const y = TOP + i * ROW;
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
        ctx.fillText(g.labels[i], side === "q" ? x + g.colW - 4 : x + 4, y + ROW / 2);
      }
    }
  }

  curve(ctx, x0, x1, xm, ya, yb) {
    ctx.beginPath();
    ctx.moveTo(x0, ya);
    ctx.bezierCurveTo(xm, ya, xm, yb, x1, yb);
    ctx.stroke();
  }

  /** The whole picture (every row, not only the window) for the PNG export. */
  exportPicture(scale = 1) {
    if (!this.matrix || !this.geo) return null;
    const c = document.createElement("canvas");
    c.width = Math.round(this.geo.W * scale);
    c.height = Math.round(this.geo.H * scale);
    const ctx = c.getContext("2d");
    ctx.scale(scale, scale);
    this.paint(ctx, this.locked, 0, this.geo.H);
    return { canvas: c, title: this.title, legend: null };
  }

  exportData() {
    if (!this.matrix) return null;
    const { heads, T, tokens } = this.matrix;
    const lines = [];
    for (const hd of heads)
      for (let i = 0; i < T; i++)
        for (let j = 0; j < (this.matrix.causal ? i + 1 : T); j++) {
          const v = hd.data[i * T + j];
          if (v > 0.01) lines.push({ head: hd.head, query: i, key: j, weight: +v.toFixed(5) });
        }
    return { title: this.title, tokens, heads: heads.map((h) => ({ head: h.head, colour: h.colour })), lines };
  }
}
