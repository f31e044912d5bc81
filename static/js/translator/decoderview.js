// The decoder's causal self-attention of an encoder-decoder (target × target).

import { MatrixView } from "../views/matrixview.js";
import { translationFor, isTranslator, describeAvg } from "./translation.js";
import { Explainable } from "../explain/explainable.js";

// a click on a cell of one head's map also explains its row step by step (the decoder group's)
export class DecoderView extends Explainable(MatrixView, { group: "decoder", averaged: true }) {
  async render(params, changed, isCurrent) {
    return super.render({ ...params, axes: Object.freeze({ rows: "target query", cols: "target key" }) }, changed, isCurrent);
  }

  async compute(params) {
    if (!params.attention || !isTranslator(params.attention.meta)) return null;
    const set = await translationFor(params.attention, params.model.name);
    const { layer, head } = params.selection;
    const avg = params.settings.xavg ?? "head";
    return {
      data: set.pick("decoder", avg, layer, head),
      rows: set.T,
      cols: set.T,
      tokens: set.target,
      causal: true,
      title: `decoder self-attention, ${describeAvg(avg, layer, head)}`,
      caption: `<b>Decoder self-attention</b> — ${describeAvg(avg, layer, head)}: the target's causal attention to its own earlier tokens (start token first). ` +
        `The Head, Model and Aggregate views show the encoder's self-attention over the source.`,
    };
  }
}
