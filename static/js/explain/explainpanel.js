// The Head view's explain panel: how one head computes one query row of its map, step by step,
// with the real numbers (POST /attention/explain): z = softmax(q·Kᵀ/√d_head + mask)·V —
// the query vector, each key's q·k, the scale, the mask, the softmax (beside the map's own row),
// the values and their weighted sum z. Two bar charts show the scores before and after softmax.

import { fetchExplain } from "./explain_api.js";
import { escapeHTML, visible, axisLabel } from "../tokens.js";

const f = (v, d = 3) => (v == null || Number.isNaN(v) ? "—" : v.toFixed(d));

/** An SVG bar chart of `values` (null = masked: a grey stub), one bar per key, fitting any width. */
function barChart(values, { title, highlight = null, labels = [] }) {
  const n = values.length;
  const real = values.filter((v) => v != null && Number.isFinite(v));
  const hi = Math.max(0, ...real);
  const lo = Math.min(0, ...real);
  const span = hi - lo || 1;
  const W = Math.max(120, n * 14);
  const H = 90;
  const zero = 4 + ((H - 8) * hi) / span;
  const bw = W / n;
  const bars = values
    .map((v, i) => {
      const x = i * bw + bw * 0.12;
      const w = bw * 0.76;
      const tip = `<title>#${i} ${escapeHTML(visible(labels[i] ?? ""))}: ${v == null ? "masked" : f(v, 4)}</title>`;
      if (v == null || !Number.isFinite(v)) return `<rect class="masked" x="${x}" y="${zero - 2}" width="${w}" height="4">${tip}</rect>`;
      const h = ((H - 8) * Math.abs(v)) / span;
      return `<rect class="${i === highlight ? "hl" : v < 0 ? "neg" : "pos"}" x="${x}" y="${v >= 0 ? zero - h : zero}" width="${w}" height="${Math.max(0.5, h)}">${tip}</rect>`;
    })
    .join("");
  return `<figure class="xp-chart"><figcaption>${title}</figcaption><svg viewBox="0 0 ${W} ${H}" preserveAspectRatio="none" role="img" aria-label="${escapeHTML(title)}"><line x1="0" x2="${W}" y1="${zero}" y2="${zero}" class="axis"/>${bars}</svg></figure>`;
}

/** A vector as a row of numbers (scrolls inside its box). */
const vector = (v, d = 3) => `<div class="xp-vec">[${v.map((x) => f(x, d)).join(", ")}]</div>`;

export class ExplainPanel {
  constructor(ctx) {
    this.ctx = ctx;
    this.key = "";
    this.answer = null;
  }

  /** Put the panel after `el` (outside the map's scroller, so it wraps to the width). */
  mount(el) {
    this.root = document.createElement("section");
    this.root.className = "explain-panel";
    this.root.id = "explain-panel";
    this.root.hidden = true;
    this.root.setAttribute("aria-label", "How the head computes this row");
    el.after(this.root);
  }

  unmount() {
    this.root?.remove();
  }

  /** Show the computation of `query` (null: close) of the chosen head of `group` (null: the primary); `col`: the key clicked. */
  async show(params, query, col = null, group = null) {
    if (query == null || !params.attention) {
      this.root.hidden = true;
      this.key = "";
      return;
    }
    const { layer, head } = params.selection;
    const key = JSON.stringify([params.attention.ids ?? params.attention.text, params.attention.targetIds, layer, head, query, group]);
    this.col = col;
    if (key === this.key && this.answer) return this.draw();
    this.key = key;
    this.root.hidden = false;
    this.root.dataset.state = "loading";
    this.root.innerHTML = `<p class="hint">computing layer ${layer}, head ${head}, row ${query}…</p>`;
    try {
      const answer = await this.ctx.track(fetchExplain(params.attention, { layer, head, query, group }));
      if (this.key !== key) return;
      this.answer = answer;
      this.draw();
    } catch (err) {
      if (this.key !== key) return;
      this.answer = null;
      this.root.dataset.state = "error";
      this.root.innerHTML = `<p class="hint">Could not compute this row: ${escapeHTML(err.message)}</p>`;
    }
  }

  draw() {
    const a = this.answer;
    const keys = a.key_tokens;
    const labels = keys.map((t) => t.text);
    const maxDiff = Math.max(0, ...a.softmax.map((p, i) => Math.abs(p - (a.pattern_row?.[i] ?? p))));
    const rows = keys
      .map((t, i) => {
        const hl = i === this.col ? ' class="hl"' : "";
        return `<tr${hl}><td>${i}</td><td class="tok">${escapeHTML(axisLabel(t.text, 12))}</td><td>${f(a.scores[i])}</td><td>${f(a.scaled[i])}</td><td>${a.mask[i] ? "✓" : "−∞"}</td><td>${f(a.softmax[i], 4)}</td><td>${f(a.pattern_row?.[i], 4)}</td></tr>`;
      })
      .join("");
    const matrix = (m, name) =>
      `<details><summary>${name} (${m.length} × ${a.d_head})</summary><div class="xp-scroll"><table class="xp-matrix"><tbody>${m
        .map((v, i) => `<tr><th>${escapeHTML(axisLabel(labels[i], 10))}</th>${v.map((x) => `<td>${f(x, 2)}</td>`).join("")}</tr>`)
        .join("")}</tbody></table></div></details>`;
    this.root.dataset.state = "done";
    this.root.dataset.query = a.query;
    this.root.innerHTML = `
      <div class="xp-head">
        <h3>How layer ${a.layer}, head ${a.head}${a.group ? ` (${escapeHTML(a.group)})` : ""} computes row ${a.query}: “${escapeHTML(visible(a.query_token.text))}”</h3>
        <button type="button" class="btn small ghost xp-close" aria-label="Close the explanation">✕</button>
      </div>
      <p class="xp-formula"><code>z = softmax(q·Kᵀ / √d + mask) · V</code> — the row of <code>softmax(QKᵀ/√d)V</code> for this query, d = d_head = <b>${a.d_head}</b>, 1/√d = <b data-scale>${f(a.scale, 5)}</b>.</p>
      <p class="hint">Positions: ${escapeHTML(a.positions ?? "")}${a.kv_head != null && a.kv_head !== a.head ? ` · keys and values: kv head ${a.kv_head} (shared by several query heads)` : ""}</p>
      <ol class="xp-steps">
        <li><b>q</b>, the query of “${escapeHTML(visible(a.query_token.text))}” (${a.d_head} numbers)${vector(a.q)}</li>
        <li><b>q·k</b> with every key, <b>× 1/√d</b>, then the <b>mask</b> (−∞ where the query may not look), then <b>softmax</b>:
          <div class="xp-scroll"><table class="xp-table"><thead><tr><th>#</th><th>key</th><th>q·k</th><th>×1/√d</th><th>mask</th><th>softmax</th><th>map</th></tr></thead><tbody>${rows}</tbody></table></div>
          <p class="hint">softmax agrees with the map's row to <b data-maxdiff>${maxDiff.toExponential(1)}</b>.</p>
          <div class="xp-charts">${barChart(a.masked ?? a.scaled, { title: "scores q·k/√d (before softmax)", highlight: this.col, labels })}${barChart(a.softmax, { title: "weights (after softmax)", highlight: this.col, labels })}</div>
        </li>
        <li><b>z = Σ softmax · v</b>, this head's output at the row (before the output projection)${vector(a.z)}</li>
      </ol>
      ${matrix(a.keys, "keys K")}${matrix(a.values, "values V")}`;
    this.root.querySelector(".xp-close").addEventListener("click", () => this.ctx.select({ explain: null }));
  }
}
