// Aggregate view: mean / max / sum over a chosen set of layers and heads, or attention rollout.

import { MatrixView, fmt } from "./matrixview.js";
import { reduce, rollout, removeSink } from "../attention.js";

export const OPS = {
  mean: "Mean",
  max: "Max",
  sum: "Sum",
  rollout: "Rollout (Abnar & Zuidema)",
};

export class AggregateView extends MatrixView {
  async compute() {
    const { att, state } = this.app;
    const layers = state.layers.filter((l) => l < att.nLayers).sort((a, b) => a - b);
    const heads = state.heads.filter((h) => h < att.nHeads).sort((a, b) => a - b);
    if (!layers.length || !heads.length) {
      this.app.setCaption("Choose at least one layer and one head to aggregate.");
      return null;
    }
    await att.ensure(layers);
    const T = att.T;
    let data;
    const op = OPS[state.op] ? state.op : "mean";
    if (op === "rollout") {
      data = rollout(layers.map((l) => heads.map((h) => att.head(l, h))), T);
    } else {
      const mats = [];
      for (const l of layers) for (const h of heads) mats.push(att.head(l, h));
      data = reduce(mats, op);
    }
    if (state.sink) data = removeSink(data, T);
    const list = (xs, all) => (xs.length === all ? "all" : xs.join(", "));
    const what = `layers ${list(layers, att.nLayers)} × heads ${list(heads, att.nHeads)}`;
    const describe =
      op === "rollout"
        ? `Attention rollout through ${what}: each layer's heads averaged, A′ = ½A + ½I, rows renormalised, multiplied through the layers.`
        : `${OPS[op]} over ${what} (${layers.length * heads.length} maps).`;
    return {
      data,
      n: T,
      unbounded: op === "sum" && !state.sink,
      title: `${op} over ${what}`,
      legend: op === "sum" ? "summed weight" : op === "rollout" ? "rolled-out weight" : "attention weight",
      caption: `${describe}${state.sink ? " First-token column hidden, rows renormalised." : ""} Pin several query rows to sum them.`,
      format: (v) => fmt(v),
    };
  }
}
