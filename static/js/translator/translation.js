// An encoder-decoder's attention for one source and target: the three groups of /attention
// (encoder self S×S, decoder self T×T, cross T×S), fetched once per source and target and kept
// here. The target is a generated translation's ids (after Generate, or from a link), or
// none: then the server's greedy translation. Rows of the decoder and cross maps are the
// decoder's inputs: its start token, then the target tokens (row t is the step that wrote
// target token t + 1).

import { postJSON, decodeAttention } from "../api.js";

const cache = new Map(); // model, source and target -> Promise<TranslationSet>

/** What the axes call the decoder's first input (its start token's own text is e.g. <|endoftext|>). */
export const START_LABEL = "⟨start⟩";

export class TranslationSet {
  constructor(resp) {
    this.source = resp.tokens; // [{id, text}]
    const [start, ...rest] = resp.translation.target_tokens; // [{id, text}]: start token first
    this.target = [{ ...start, text: START_LABEL, start: start.text }, ...rest];
    this.generated = resp.translation.generated;
    this.L = resp.layers.length;
    this.H = resp.heads.length;
    this.S = this.source.length;
    this.T = this.target.length;
    this.groups = {
      encoder: { data: decodeAttention(resp), rows: this.S, cols: this.S },
      decoder: { data: decodeAttention(resp.translation.decoder), rows: this.T, cols: this.T },
      cross: { data: decodeAttention(resp.translation.cross), rows: this.T, cols: this.S },
    };
  }

  /** One head's (rows × cols) matrix of a group, a view into the fetched data. */
  head(group, layer, head) {
    const g = this.groups[group];
    const n = g.rows * g.cols;
    const at = (layer * this.H + head) * n;
    return g.data.subarray(at, at + n);
  }

  /** The mean over heads of one layer (layer given) or over every layer and head (layer null). */
  mean(group, layer = null) {
    const g = this.groups[group];
    const n = g.rows * g.cols;
    const out = new Float32Array(n);
    const layers = layer == null ? [...Array(this.L).keys()] : [layer];
    for (const l of layers) for (let h = 0; h < this.H; h++) {
      const m = this.head(group, l, h);
      for (let i = 0; i < n; i++) out[i] += m[i];
    }
    const k = layers.length * this.H;
    for (let i = 0; i < n; i++) out[i] /= k;
    return out;
  }

  /** The matrix the settings ask for: "head", "layer" (mean of its heads) or "all" (mean of everything). */
  pick(group, avg, layer, head) {
    if (avg === "layer") return this.mean(group, layer);
    if (avg === "all") return this.mean(group, null);
    return this.head(group, layer, head);
  }
}

// A document that embeds its answer (a notebook view, inline.js) keeps it here: it has one
// source and one target, and every view of it reads those without a request.
let kept = null;

/** Keep an /attention answer already in hand as the one translation this document shows. */
export function keepTranslation(resp) {
  kept = Promise.resolve(new TranslationSet(resp));
}

/**
 * The translation maps of an analysed source (an AttentionSet: its text or ids, and its target
 * ids if it has them) by model `name`: one request each, every layer and head, JSON.
 */
export function translationFor(att, name = "") {
  if (kept) return kept;
  const source = att.ids ? { ids: att.ids } : { text: att.text };
  const target = att.targetIds ? { target_ids: att.targetIds } : {};
  const key = JSON.stringify([name, source, target]);
  if (!cache.has(key)) {
    const p = postJSON("/attention", { ...source, ...target, format: "json" }).then((resp) => {
      if (!resp.translation) throw new Error("this model is not an encoder-decoder: it has no cross-attention");
      return new TranslationSet(resp);
    });
    p.catch(() => cache.delete(key));
    cache.set(key, p);
  }
  return cache.get(key);
}

/** Whether a model (its description) analyses a target: its family declares a target axis. */
export const isTranslator = (meta) => !!meta?.capabilities?.has("target");

export function describeAvg(avg, layer, head) {
  if (avg === "layer") return `layer ${layer}, mean of its heads`;
  if (avg === "all") return "mean of every layer and head";
  return `layer ${layer}, head ${head}`;
}
