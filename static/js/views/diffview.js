// Difference view: cell-wise A − B between two heads, or one head on two prompts,
// drawn with a diverging colour map centred on zero.

import { MatrixView, fmt } from "./matrixview.js";
import { AttentionSet, difference, removeSink } from "../attention.js";

export class DiffView extends MatrixView {
  constructor(app) {
    super(app);
    this.other = null; // AttentionSet for prompt B
  }

  async compute() {
    const { att, state } = this.app;
    const T = att.T;
    let a;
    let b;
    let Tb;
    let title;
    let caption;
    const l = state.layer;
    const h = state.head;
    await att.ensure([l]);
    a = att.head(l, h);
    if (state.diff === "prompts") {
      const textB = state.promptB || "";
      if (!textB.trim()) {
        this.app.setCaption("Type a second prompt (B) to compare the same head on two texts.");
        return null;
      }
      if (!this.other || this.other.text !== textB) this.other = new AttentionSet(textB, this.app.meta);
      await this.other.ensure([l]);
      b = this.other.head(l, h);
      Tb = this.other.T;
      title = `layer ${l} head ${h}: current text − prompt B`;
      caption = `Same head (layer ${l}, head ${h}) on two texts: current (A, ${T} tokens) minus prompt B (${Tb} tokens), aligned by position over the first ${Math.min(T, Tb)} tokens. Labels are A's tokens.`;
    } else {
      const lb = Math.min(state.layerB, att.nLayers - 1);
      const hb = Math.min(state.headB, att.nHeads - 1);
      await att.ensure([lb]);
      b = att.head(lb, hb);
      Tb = T;
      title = `L${l}H${h} − L${lb}H${hb}`;
      caption = `Layer ${l} head ${h} (A) minus layer ${lb} head ${hb} (B). Red: A attends more; blue: B attends more.`;
    }
    if (state.sink) {
      a = removeSink(a, T);
      b = removeSink(b, Tb);
    }
    const d = difference(a, T, b, Tb);
    const A = a;
    const B = b;
    return {
      data: d.data,
      n: d.n,
      diverging: true,
      title,
      caption: caption + (state.sink ? " First-token column hidden, rows renormalised." : ""),
      legend: "A − B",
      format: (v) => (v >= 0 ? "+" : "−") + fmt(Math.abs(v), 4),
      cellInfo: (r, c) => `<div class="tt-muted">A ${fmt(A[r * T + c], 4)} − B ${fmt(B[r * Tb + c], 4)}</div>`,
    };
  }
}
