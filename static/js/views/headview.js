// Head view: one large heatmap for the chosen layer and head; a long input's (more than
// LONG_TOKENS) is read a window at a time instead (longheadview.js).

import { MatrixView } from "./matrixview.js";
import { removeSink, headStats, HEAD_STATS_ROWS } from "../attention.js";
import { Explainable } from "../explain/explainable.js";
import { LongHeadView } from "./longheadview.js";

// a click on a cell also explains its row step by step (explain/explainable.js)
class FullHeadView extends Explainable(MatrixView) {
  async compute({ attention: att, selection: { layer, head }, settings: { sink }, tokens, boundary, causal, scope }) {
    await att.ensure([layer]);
    let data = att.head(layer, head);
    if (!data) return null;
    const stats = headStats(data, att.T);
    if (sink) data = removeSink(data, att.T);
    const pct = (x) => (x === x ? `${(100 * x).toFixed(0)}%` : "—");
    const where = boundary != null ? ` The line after token ${boundary} marks where the prompt ends and the generation begins.` : "";
    const shape = causal
      ? `${att.T} tokens.`
      : `${att.T} × ${att.T}, bidirectional: every token attends to every other (rows: queries, columns: keys; each row sums to 1).`;
    return {
      data,
      rows: att.T,
      cols: att.T,
      tokens,
      boundary,
      title: `layer ${layer}, head ${head}${sink ? " (first-token sink hidden)" : ""}`,
      caption:
        `<b>Layer ${layer} · head ${head}</b>${scope ? ` of ${scope}` : ""} — ${shape} ` +
        `<span class="head-stats" data-self="${stats.self}" data-previous="${stats.previous}" data-first="${stats.first}">` +
        `Mean weight on itself ${pct(stats.self)}, on the previous token ${pct(stats.previous)}, on the first token ${pct(stats.first)}, ${causal ? HEAD_STATS_ROWS : "averaged over query rows 1 … T−1"}</span>` +
        `${sink ? "; colours with the first-token column hidden and rows renormalised" : ""}. Click a cell to pin its row and see how the head computes it (below the map); shift-click to add rows.${where}`,
    };
  }
}

/** The head view: the whole map (FullHeadView), or a long input's windows (LongHeadView). */
export class HeadView {
  constructor(ctx) {
    this.ctx = ctx;
    this.inner = null;
  }

  mount(host) {
    this.host = host;
  }

  unmount() {
    this.inner?.unmount();
    this.inner = null;
  }

  async render(params, changed, isCurrent = () => true) {
    const att = params.attention;
    if (att?.mayBeLong() && !att.T) await att.overview();
    if (!isCurrent()) return false;
    const Kind = att?.long ? LongHeadView : FullHeadView;
    if (!(this.inner instanceof Kind)) {
      this.inner?.unmount();
      this.inner = new Kind(this.ctx);
      this.inner.mount(this.host);
      changed = null; // a fresh view draws everything
    }
    return this.inner.render(params, changed, isCurrent);
  }

  // what the page's readouts and tests read of the view on screen
  get heatmap() {
    return this.inner?.heatmap;
  }

  get result() {
    return this.inner?.result;
  }

  exportPicture(scale) {
    return this.inner?.exportPicture(scale) ?? null;
  }

  exportData() {
    return this.inner?.exportData() ?? null;
  }
}
