// Lens view (the logit lens, POST /lens): rows are the embeddings and the residual stream
// after every block, columns the positions; each cell shows the top-1 token that row's
// residual predicts there (through the final norm and the unembedding), tinted by its
// probability. A cell whose top-1 is the token that actually comes next is marked; hover or
// focus a cell for its top-k and the actual token's rank. The current ablation applies.
// A sequence longer than WINDOW positions is read a window of WINDOW columns at a time (the
// state's `lensat`, its first position; null: the last window): the server unembeds only the
// positions asked for, (layers + 1) x WINDOW rows through the head, whatever the length.

import { fetchLens } from "./explain_api.js";
import { describeHead } from "./ablation.js";
import { escapeHTML, visible, axisLabel } from "../tokens.js";
import { showTooltip, hideTooltip } from "../tooltip.js";
import { START_LABEL } from "../translator/translation.js";

/** The positions' tokens: a target's (its first is the decoder's start token, labelled as the other views do), else the text's. */
const columns = (a) => (a.target_tokens ? [{ ...a.target_tokens[0], text: START_LABEL }, ...a.target_tokens.slice(1)] : a.tokens);

export const WINDOW = 16;

/** The window of positions [start, end) to read of a stream of T tokens, or null to read them all
 * (a short stream, or T unknown: a translator's target is read whole). */
export function lensWindow(T, at) {
  if (!(T > WINDOW)) return null;
  const start = at == null ? T - WINDOW : Math.max(0, Math.min(at, T - WINDOW));
  return { start, end: start + WINDOW, T };
}

/** Whether the answer is a mixture of experts' (its blocks' cells name the experts they routed each position to). */
const routed = (a) => a.layers.some((layer) => layer.positions.some((p) => p.experts?.length));

/** A cell's mark: the expert its block gave the position the most weight (experts come heaviest first). */
function expertMark(experts) {
  const mark = Object.assign(document.createElement("sup"), { className: "lens-expert", textContent: `E${experts[0].expert}` });
  mark.dataset.expert = experts[0].expert;
  return mark;
}

const pct = (p) => (p == null ? "—" : p >= 0.995 ? "100%" : p < 0.001 ? "<0.1%" : `${(100 * p).toFixed(p < 0.1 ? 1 : 0)}%`);

export class LensView {
  constructor(ctx) {
    this.ctx = ctx;
    this.params = null;
    this.answer = null;
  }

  mount(host) {
    this.root = document.createElement("div");
    this.root.className = "lens";
    host.append(this.root);
    this.root.addEventListener("mouseover", (e) => this.tip(e.target.closest("td[data-layer]")));
    this.root.addEventListener("focusin", (e) => this.tip(e.target.closest("td[data-layer]")));
    this.root.addEventListener("mouseleave", hideTooltip);
    this.root.addEventListener("focusout", hideTooltip);
    this.root.addEventListener("keydown", (e) => this.move(e));
  }

  unmount() {
    hideTooltip();
    this.root?.remove();
  }

  async render(params, changed, isCurrent = () => true) {
    this.params = params;
    if (this.answer && changed && [...changed].every((k) => ["layer", "head", "pin", "zoom", "explain", "probe"].includes(k))) return true;
    // a translator's columns are its target's (read whole); a decoder's or encoder's its tokens
    this.window = params.attention?.targetIds || params.model.capabilities?.has?.("target") ? null : lensWindow(params.tokens.length, params.settings.lensat);
    const w = this.window;
    const positions = w ? Array.from({ length: w.end - w.start }, (_, i) => w.start + i) : null;
    let answer;
    try {
      answer = await this.ctx.track(fetchLens(params.attention, { topK: 5, ablation: params.ablation, positions }));
    } catch (err) {
      if (!isCurrent()) return false;
      this.answer = null;
      this.root.replaceChildren();
      this.ctx.showError(err, "The logit lens");
      return false;
    }
    if (!isCurrent()) return false;
    this.answer = answer;
    this.build();
    return true;
  }

  build() {
    const a = this.answer;
    const cols = columns(a); // a translator's positions are its target's
    const abl = this.params.ablation.length ? ` With ${this.params.ablation.map(describeHead).join(", ")} ablated.` : "";
    this.ctx.setLegend(null);
    this.ctx.setCaption(
      `<b>Logit lens</b>: what the residual stream predicts at each position (columns) after each layer (rows), read through ${escapeHTML(a.head ?? "the final norm and the unembedding")}. ` +
        `Each cell is the top-1 token, tinted by its probability; <span class="lens-hit-key">outlined</span> where it is ${a.predicts === "same" ? "the token actually at that position" : "the token that actually comes next"}. ` +
        `The last row is the model's own prediction. Hover or focus a cell for the top 5.` +
        (routed(a) ? " A mixture of experts: each block's cell also names, small, the expert that block routed the position to with the most weight (the tooltip lists each chosen expert and its weight)." : "") +
        escapeHTML(abl),
    );
    const table = document.createElement("table");
    table.className = "lens-grid";
    const head = table.createTHead().insertRow();
    head.append(Object.assign(document.createElement("th"), { className: "lens-corner", textContent: "layer \\ pos." }));
    for (const { position } of a.layers[0]?.positions ?? []) {
      const t = cols[position];
      const th = document.createElement("th");
      th.scope = "col";
      th.textContent = axisLabel(t?.text ?? "", 10);
      th.title = `#${position} “${visible(t?.text ?? "")}”`;
      head.append(th);
    }
    const body = table.createTBody();
    a.layers.forEach((layer, li) => {
      const tr = body.insertRow();
      const th = document.createElement("th");
      th.scope = "row";
      th.textContent = layer.label;
      tr.append(th);
      layer.positions.forEach((pos, i) => {
        const td = tr.insertCell();
        const top = pos.top?.[0];
        td.dataset.layer = li;
        td.dataset.pos = i;
        td.tabIndex = li === 0 && i === 0 ? 0 : -1;
        td.textContent = top ? axisLabel(top.text, 8) : "";
        td.style.setProperty("--p", String(top?.prob ?? 0));
        if (top?.prob > 0.55) td.classList.add("dark");
        if (top && pos.actual && top.id === pos.actual.id) td.classList.add("hit");
        if (pos.experts?.length) td.append(expertMark(pos.experts));
      });
    });
    // the token that comes next at each position, when there is one
    if (a.layers[0]?.positions.some((p) => p.actual)) {
      const tr = table.createTFoot().insertRow();
      tr.append(Object.assign(document.createElement("th"), { scope: "row", textContent: "actual" }));
      for (const p of a.layers[0].positions) {
        const td = tr.insertCell();
        td.textContent = p.actual ? axisLabel(p.actual.text, 8) : "";
        td.className = "lens-actual";
      }
    }
    const wrap = document.createElement("div");
    wrap.className = "lens-scroll";
    wrap.append(table);
    this.root.replaceChildren(...(this.window ? [this.windowBar(this.window)] : []), wrap);
  }

  /** "positions a–b of T", and buttons that move the window a window's width. */
  windowBar({ start, end, T }) {
    const bar = document.createElement("div");
    bar.className = "lens-window";
    const go = (at) => this.ctx.select({ lensat: at });
    const button = (label, title, at) => {
      const b = Object.assign(document.createElement("button"), { type: "button", className: "btn small", textContent: label, title });
      b.disabled = at == null;
      if (at != null) b.addEventListener("click", () => go(at));
      return b;
    };
    const text = Object.assign(document.createElement("span"), { textContent: `positions ${start}–${end - 1} of ${T}` });
    text.title = `the lens reads ${WINDOW} positions at a time: each is (layers + 1) rows through the unembedding`;
    bar.append(
      button("« first", "the first positions", start > 0 ? 0 : null),
      button("‹ earlier", `the ${WINDOW} positions before`, start > 0 ? Math.max(0, start - WINDOW) : null),
      text,
      button("later ›", `the ${WINDOW} positions after`, end < T ? Math.min(T - WINDOW, start + WINDOW) : null),
      button("last »", "the last positions", end < T ? T - WINDOW : null),
    );
    return bar;
  }

  tip(td) {
    if (!td || !this.answer) return;
    const layer = this.answer.layers[+td.dataset.layer];
    const pos = layer.positions[+td.dataset.pos];
    const i = pos.position;
    const cols = columns(this.answer);
    const alts = (pos.top ?? [])
      .map((t) => `<span class="${pos.actual && t.id === pos.actual.id ? "chosen" : ""}">${escapeHTML(visible(t.text))}</span><span class="bar" style="width:${Math.max(1, 60 * t.prob)}px"></span><span class="num">${pct(t.prob)}</span>`)
      .join("");
    const experts = pos.experts?.length ? `<div class="tt-muted">experts: ${pos.experts.map((e) => `E${e.expert} ${pct(e.weight)}`).join(" · ")}</div>` : "";
    const actual = pos.actual ? `<div class="tt-muted">actual next “${escapeHTML(visible(pos.actual.text))}”: rank ${pos.actual.rank}, ${pct(pos.actual.prob)}</div>` : "";
    const r = td.getBoundingClientRect();
    showTooltip(`<div class="tt-cell"><b>${escapeHTML(layer.label)}</b> at #${i} “${escapeHTML(visible(cols[i]?.text))}”</div><div class="tt-alts">${alts}</div>${actual}${experts}`, r.right, r.top);
  }

  /** Arrow keys move the focus between cells (one cell is in the tab order). */
  move(e) {
    const td = e.target.closest("td[data-layer]");
    const d = { ArrowRight: [0, 1], ArrowLeft: [0, -1], ArrowDown: [1, 0], ArrowUp: [-1, 0] }[e.key];
    if (!td || !d) return;
    const next = this.root.querySelector(`td[data-layer="${+td.dataset.layer + d[0]}"][data-pos="${+td.dataset.pos + d[1]}"]`);
    if (!next) return;
    e.preventDefault();
    td.tabIndex = -1;
    next.tabIndex = 0;
    next.focus();
  }

  /** The grid as the page draws it (top-1 tokens tinted by probability, hits outlined), for the PNG export. */
  exportPicture(scale = 1) {
    const a = this.answer;
    if (!a) return null;
    const cols = columns(a);
    const w = 58 * scale;
    const h = 22 * scale;
    const left = 84 * scale;
    const c = document.createElement("canvas");
    const at = (a.layers[0]?.positions ?? []).map((p) => p.position);
    c.width = left + at.length * w;
    c.height = (a.layers.length + 2) * h;
    const ctx = c.getContext("2d");
    ctx.textBaseline = "middle";
    ctx.font = `${11 * scale}px ui-monospace, monospace`;
    const text = (s, x, y, align = "center") => ((ctx.textAlign = align), ctx.fillText(s, x, y));
    ctx.fillStyle = "#555";
    at.forEach((p, i) => text(axisLabel(cols[p]?.text ?? "", 7), left + i * w + w / 2, h / 2));
    a.layers.forEach((layer, li) => {
      const y = (li + 1) * h;
      ctx.fillStyle = "#333";
      text(layer.label, left - 6 * scale, y + h / 2, "right");
      layer.positions.forEach((pos, i) => {
        const top = pos.top?.[0];
        if (!top) return;
        const x = left + i * w;
        ctx.fillStyle = `rgba(67, 56, 202, ${0.08 + 0.85 * top.prob})`;
        ctx.fillRect(x + scale, y + scale, w - 2 * scale, h - 2 * scale);
        if (pos.actual && pos.actual.id === top.id) {
          ctx.strokeStyle = "#d9480f";
          ctx.lineWidth = 2 * scale;
          ctx.strokeRect(x + 2 * scale, y + 2 * scale, w - 4 * scale, h - 4 * scale);
        }
        ctx.fillStyle = top.prob > 0.55 ? "#fff" : "#111";
        text(axisLabel(top.text, 7), x + w / 2, y + h / 2);
        if (pos.experts?.length) {
          ctx.font = `${8 * scale}px ui-monospace, monospace`;
          text(`E${pos.experts[0].expert}`, x + w - 3 * scale, y + 6 * scale, "right");
          ctx.font = `${11 * scale}px ui-monospace, monospace`;
        }
      });
    });
    const y = (a.layers.length + 1) * h;
    ctx.fillStyle = "#d9480f";
    text("actual", left - 6 * scale, y + h / 2, "right");
    a.layers[0]?.positions.forEach((pos, i) => pos.actual && text(axisLabel(pos.actual.text, 7), left + i * w + w / 2, y + h / 2));
    return { canvas: c, title: "logit lens: top-1 token per layer and position (outlined: the actual token)", legend: null };
  }

  exportData() {
    return this.answer ? { title: "logit lens", ...this.answer } : null;
  }
}
