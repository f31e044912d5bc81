// Probability bars shared by the encoder's panels: one row per candidate / label / token.

import { escapeHTML } from "../tokens.js";

/** One row: label, a bar `width` (0..1 of the track) and the value as a percentage. */
export function probRow(label, value, { width = value, attrs = "", title = "" } = {}) {
  return `
    <div class="prob-row" ${attrs}${title ? ` title="${escapeHTML(title)}"` : ""}>
      <span class="prob-label">${escapeHTML(label)}</span>
      <span class="prob-track"><span class="prob-fill" style="width:${(100 * width).toFixed(1)}%"></span></span>
      <span class="prob-value">${(100 * value).toFixed(1)}%</span>
    </div>`;
}

/** The results box of a panel: runs `work` with a loading mark, drops an answer that a newer run replaced. */
export class ResultsBox {
  constructor(el) {
    this.el = el;
    this.seq = 0;
  }

  clear(html = "") {
    this.seq++;
    this.el.innerHTML = html;
  }

  async run(work, show, onError) {
    const mine = ++this.seq;
    this.el.classList.add("loading");
    try {
      const res = await work();
      if (mine === this.seq) show(res);
    } catch (err) {
      if (mine === this.seq) {
        this.el.replaceChildren();
        onError(err);
      }
    } finally {
      if (mine === this.seq) this.el.classList.remove("loading");
    }
  }
}

/** A head's held-out figure from /models (`head_figures[task]`), as a short line; "weak" when its
 * report says so (fill-mask under 0.30 top-1, classify not above bag of words). */
export function headFigureHTML(figure) {
  if (!figure) return "";
  const pct = (v) => `${(100 * v).toFixed(1)}%`;
  const base = figure.baseline == null ? "" : ` (bag of words ${pct(figure.baseline)})`;
  const badge = figure.weak ? `<span class="badge weak" title="its held-out figure is low: read its answers with care">weak head</span> ` : "";
  return `<p class="head-figure">${badge}${figure.figure}: <b>${pct(figure.value)}</b>${base}</p>`;
}
