// Aggregate view: the mean or the maximum over a chosen set of layers and heads, or
// attention rollout. ("sum" is gone: it was the mean times the number of maps.)

import { MatrixView, fmt } from "./matrixview.js";
import { reduce, rollout, removeSink } from "../attention.js";

export const OPS = {
  mean: { label: "Mean", what: "mean attention weight" },
  max: { label: "Max", what: "largest attention weight of any map" },
  rollout: { label: "Rollout (Abnar & Zuidema)", what: "rolled-out attention (rows sum to 1)" },
};

export class AggregateView extends MatrixView {
  async compute({ attention: att, selection, settings: { op, sink }, tokens, boundary }) {
    const { layers, heads } = selection;
    if (!layers.length || !heads.length) {
      this.ctx.setCaption("Choose at least one layer and one head to aggregate.");
      return null;
    }
    await att.ensure(layers);
    const T = att.T;
    let data;
    if (op === "rollout") data = rollout(layers.map((l) => heads.map((h) => att.head(l, h))), T);
    else {
      const mats = [];
      for (const l of layers) for (const h of heads) mats.push(att.head(l, h));
      data = reduce(mats, op);
    }
    if (sink) data = removeSink(data, T);
    const list = (xs, all) => (xs.length === all ? "all" : xs.join(", "));
    const what = `layers ${list(layers, att.nLayers)} × heads ${list(heads, att.nHeads)}`;
    const describe =
      op === "rollout"
        ? `Attention rollout through ${what}: each layer's heads averaged, A′ = ½A + ½I, rows renormalised, multiplied through the layers.`
        : `${OPS[op].label} over ${what} (${layers.length * heads.length} maps).`;
    return {
      data,
      rows: T,
      cols: T,
      tokens,
      boundary,
      what: OPS[op].what,
      title: `${op} over ${what}`,
      caption: `${describe}${sink ? " First-token column hidden, rows renormalised." : ""} Pin several query rows to sum them.`,
      format: (v) => fmt(v),
    };
  }
}
