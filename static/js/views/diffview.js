// Difference view: cell-wise A − B between two heads, one head on two prompts (aligned by
// position, both token sequences on the axes: A left and top, B right and bottom), or one head
// without and with the current ablation (the `ablate` key: the maps of the ablated run come from
// POST /attention with `ablate`), drawn with a diverging colour map centred on zero.

import { MatrixView, fmt } from "./matrixview.js";
import { AttentionSet, difference, removeSink } from "../attention.js";
import { quoted, escapeHTML } from "../tokens.js";
import { ablateField, describeHead, formatAblation } from "../explain/ablation.js";

const ROUNDING = 1e-5;  // a probability that moved less than this is float32 rounding (a few ulps), not a change

export class DiffView extends MatrixView {
  constructor(ctx) {
    super(ctx);
    this.other = null; // AttentionSet of prompt B
    this.ablated = null; // {att, key, set}: the AttentionSet of the current text under the ablation
  }

  /** The maps of `att`'s text with `ablation`'s heads ablated (fetched once per text and ablation). */
  ablatedSet(att, ablation, model) {
    const key = formatAblation(ablation);
    if (this.ablated?.att !== att || this.ablated.key !== key) {
      const set = new AttentionSet(att.text, model, { ids: att.ids, targetIds: att.targetIds, messages: att.messages, ablate: ablateField(ablation) });
      this.ablated = { att, key, set };
    }
    return this.ablated.set;
  }

  async compute({ attention: att, selection, settings, tokens, model, ablation }) {
    const { layer: l, head: h } = selection;
    const T = att.T;
    await att.ensure([l]);
    let a = att.head(l, h);
    let b;
    let Tb;
    let title;
    let caption;
    let extra = {};
    let names;
    if (settings.diff === "prompts") {
      const textB = settings.promptB;
      if (!textB.trim()) {
        this.ctx.setCaption("Type a second prompt (B) to compare the same head on two texts.");
        return null;
      }
      if (!this.other || this.other.text !== textB) this.other = new AttentionSet(textB, model);
      await this.other.ensure([l]);
      b = this.other.head(l, h);
      Tb = this.other.T;
      const n = Math.min(T, Tb);
      extra = { rowTokens2: this.other.tokens, colTokens2: this.other.tokens };
      title = `layer ${l} head ${h}: text A − prompt B`;
      names = ["text A", "prompt B"];
      caption =
        `Same head (layer ${l}, head ${h}) on two texts, aligned by position over the first ${n} tokens: A (${T} tokens, labels left and top) minus B (${Tb} tokens, labels right and bottom).` +
        (T !== Tb ? ` Positions past ${n} are not compared.` : "") + " Where the two texts hold different tokens at a position, the cells compare different words.";
    } else if (settings.diff === "ablation") {
      if (!model.capabilities.has("server")) {
        this.ctx.setCaption("Comparing a head with and without an ablation needs the attnlens server (POST /attention with ablate).");
        return null;
      }
      if (!ablation.length) {
        this.ctx.setCaption("Choose heads to ablate (Alt- or Shift-click them in the Atlas or Model view, or use the Ablate view): this view then shows how removing them changes this head's map.");
        return null;
      }
      const set = this.ablatedSet(att, ablation, model);
      await set.ensure([l]);
      b = set.head(l, h);
      Tb = T;
      const heads = ablation.map(describeHead).join(", ");
      title = `L${l}H${h}: clean − ablated`;
      names = ["clean", "ablated"];
      caption =
        `Layer ${l} head ${h} on the same text without (A) and with (B) ${heads} ablated. ` +
        "An ablation replaces a head's output, not its map, so only the maps of heads that read it (later layers, and a decoder's cross-attention) can change.";
    } else {
      const lb = selection.layerB;
      const hb = selection.headB;
      await att.ensure([lb]);
      b = att.head(lb, hb);
      Tb = T;
      title = `L${l}H${h} − L${lb}H${hb}`;
      names = [`L${l}H${h}`, `L${lb}H${hb}`];
      caption = `Layer ${l} head ${h} (A) minus layer ${lb} head ${hb} (B).`;
    }
    if (settings.sink) {
      a = removeSink(a, T);
      b = removeSink(b, Tb);
    }
    const d = difference(a, T, b, Tb);
    // two forwards may take different kernels (a kept sequence, the fused maps): ulps apart, not a change
    if (settings.diff === "ablation" && d.data.every((v) => !(Math.abs(v) > ROUNDING))) caption += " Here nothing changed: this head reads nothing the ablated heads write.";
    const high = `A (${names[0]}) attends more`;
    const low = `B (${names[1]}) attends more`;
    const tokB = extra.rowTokens2;
    return {
      data: d.data,
      rows: d.n,
      cols: d.n,
      tokens,
      diverging: true,
      title,
      lowNote: `← ${low}`,
      highNote: `${high} →`,
      caption: `${caption} Colour: ${high} at the ${settings.dcmap === "RdBu" ? "red" : "warm"} end, ${low} at the ${settings.dcmap === "RdBu" ? "blue" : "cool"} end.${settings.sink ? " First-token column hidden, rows renormalised." : ""}`,
      format: (v) => (v >= 0 ? "+" : "−") + fmt(Math.abs(v), 4),
      cellInfo: (r, c) =>
        `<div class="tt-muted">A ${fmt(a[r * T + c], 4)} − B ${fmt(b[r * Tb + c], 4)}</div>` +
        (tokB ? `<div class="tt-muted">in B: <span class="tt-tok">${escapeHTML(quoted(tokB[r], r))}</span> → <span class="tt-tok">${escapeHTML(quoted(tokB[c], c))}</span></div>` : ""),
      ...extra,
    };
  }
}
