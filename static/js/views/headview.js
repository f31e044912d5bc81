// Head view: one large heatmap for the chosen layer and head.

import { MatrixView } from "./matrixview.js";
import { removeSink, headStats } from "../attention.js";

export class HeadView extends MatrixView {
  async compute() {
    const { att, state } = this.app;
    await att.ensure([state.layer]);
    let data = att.head(state.layer, state.head);
    if (!data) return null;
    const stats = headStats(data, att.T);
    if (state.sink) data = removeSink(data, att.T);
    const pct = (x) => `${(100 * x).toFixed(0)}%`;
    return {
      data,
      n: att.T,
      title: `layer ${state.layer}, head ${state.head}${state.sink ? " (first-token sink hidden)" : ""}`,
      caption:
        `<b>Layer ${state.layer} · head ${state.head}</b> — ${att.T} tokens. ` +
        `Mean weight on itself ${pct(stats.self)}, on the previous token ${pct(stats.previous)}, on the first token ${pct(stats.first)}` +
        `${state.sink ? " (hidden and rows renormalised)" : ""}. Click a row to pin it; shift-click to add rows.`,
    };
  }
}
