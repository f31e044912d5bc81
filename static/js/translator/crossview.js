// Cross-attention view (encoder-decoder): target tokens down, source tokens across, for one
// head, a layer's mean or the mean of all; stepping through the translation (Prev / Next, or
// a click on a row) pins one step and shows, under the grid, which source tokens it read.

import { MatrixView } from "../views/matrixview.js";
import { escapeHTML, visible } from "../tokens.js";
import { translationFor, isTranslator, describeAvg } from "./translation.js";
import { Explainable } from "../explain/explainable.js";

// a click on a cell of one head's map also explains its row step by step (the cross group's)
export class CrossView extends Explainable(MatrixView, { group: "cross", averaged: true }) {
  mount(host) {
    super.mount(host);
    this.onStep = (e) => {
      const dir = e.target.closest("[data-step]")?.dataset.step;
      if (!dir || !this.result) return;
      const now = this.params.selection.pinned[0];
      const T = this.result.rows;
      const next = now == null ? 0 : Math.max(0, Math.min(T - 1, now + (dir === "next" ? 1 : -1)));
      this.ctx.select({ pin: [next] });
    };
    document.querySelector("#translation-steps")?.addEventListener("click", this.onStep);
  }

  unmount() {
    document.querySelector("#translation-steps")?.removeEventListener("click", this.onStep);
    super.unmount();
  }

  async render(params, changed, isCurrent) {
    const axes = Object.freeze({ rows: "target (decoder step)", cols: "source" });
    const drawn = await super.render({ ...params, axes }, changed, isCurrent);
    if (drawn) this.describeStep();
    return drawn;
  }

  updateFooter() {
    super.updateFooter();
    this.describeStep();
  }

  describeStep() {
    const el = document.querySelector("#translation-step-note");
    if (!el || !this.result || !this.params) return;
    const step = this.params.selection.pinned[0];
    if (step == null || step >= this.result.rows) {
      el.textContent = "Prev / Next step through the translation.";
      return;
    }
    const { data, cols, tokens, colTokens } = this.result;
    const row = data.subarray(step * cols, (step + 1) * cols);
    let best = 0;
    for (let c = 1; c < cols; c++) if (row[c] > row[best]) best = c;
    const wrote = this.set.target[step + 1];
    const what = wrote ? `writing “${visible(wrote.text)}”` : "writing the end of the translation";
    el.innerHTML = `Step ${step + 1} of ${this.result.rows} (reads “${escapeHTML(visible(tokens[step].text))}”, ${escapeHTML(what)}): ` +
      `most attention on source “<b>${escapeHTML(visible(colTokens[best].text))}</b>” (${(100 * row[best]).toFixed(0)}%).`;
  }

  async compute(params) {
    const meta = params.attention?.meta;
    if (!params.attention || !isTranslator(meta)) return null;
    const set = await translationFor(params.attention, params.model.name);
    this.set = set;
    const { layer, head } = params.selection;
    const avg = params.settings.xavg ?? "head";
    const data = set.pick("cross", avg, layer, head);
    return {
      data,
      rows: set.T,
      cols: set.S,
      tokens: set.target,
      colTokens: set.source,
      causal: false,
      title: `cross-attention, ${describeAvg(avg, layer, head)}`,
      caption:
        `<b>Cross-attention</b> — ${describeAvg(avg, layer, head)}: each row is one decoder step (the token it reads; it writes the next), ` +
        `each column a source token; every row sums to 1 over the source. ${set.generated ? "The target is the model's own greedy translation." : "The target is the translation generated here."}`,
    };
  }
}
