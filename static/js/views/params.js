// The one object a view reads: built from the store's state, checked once here, so views
// never see the store, the page or an out-of-range index.

import { capabilities, primaryGroup } from "../family.js";
import { SEQUENTIAL, DIVERGING } from "../colormap.js";
import { SCALES } from "../scales.js";
import { OPS } from "./aggregateview.js";
import { parseAblation, constrainAblation, defaultGroup } from "../explain/ablation.js";
import { chatMode } from "../chat.js";
import { CAUSES_METHODS, CAUSES_COMPONENTS } from "../explain/causesview.js";

const clamp = (v, n) => Math.max(0, Math.min(n - 1, v | 0));

/** Keep the state's choices in range for a model with `meta` (used as the store's constraint). */
export function constrainState(s, meta, viewIds) {
  const out = { ...s };
  if (!viewIds.includes(out.view)) out.view = viewIds[0];
  if (!Object.hasOwn(SCALES, out.scale)) out.scale = "p99";
  if (!SEQUENTIAL.includes(out.cmap)) out.cmap = "viridis";
  if (!DIVERGING.includes(out.dcmap)) out.dcmap = "RdBu";
  if (!Object.hasOwn(OPS, out.op)) out.op = "mean";
  if (!["heads", "prompts", "ablation"].includes(out.diff)) out.diff = "heads";
  if (!["head", "layer", "all"].includes(out.xavg)) out.xavg = "head";
  if (!CAUSES_METHODS.includes(out.method)) out.method = "exact";
  if (!CAUSES_COMPONENTS.includes(out.component)) out.component = "heads";
  // [layer, head], or an encoder-decoder's [layer, head, group index]
  if (out.sender && !(out.sender.length === 2 || (out.sender.length === 3 && out.sender[2] >= 0 && out.sender[2] <= 2))) out.sender = null;
  out.zoom = Math.max(0.25, Math.min(8, out.zoom || 1));
  out.fillk = Math.max(1, Math.min(100, out.fillk || 5));
  if (meta) {
    const { n_layers: L, n_heads: H } = meta;
    // a model with a shorter context (or a lower server limit) than the asked-for length: half of what it allows
    const maxNew = Math.max(1, Math.min(meta.max_new_tokens ?? Infinity, meta.context_length - 1));
    if (+out.max_new_tokens > maxNew) out.max_new_tokens = String(Math.max(1, Math.floor(maxNew / 2)));
    out.layer = clamp(out.layer, L);
    out.head = clamp(out.head, H);
    out.layerB = clamp(out.layerB, L);
    out.headB = clamp(out.headB, H);
    if (out.layers) out.layers = out.layers.filter((l) => l < L);
    if (out.heads) out.heads = out.heads.filter((h) => h < H);
    if (out.lheads) out.lheads = out.lheads.filter((h) => h < H);
    if (out.sender && !(out.sender[0] < L && out.sender[1] < H && (out.sender.length === 2) === !(meta.family_info?.axes ?? []).includes("target"))) out.sender = null;
    out.ablate = constrainAblation(out.ablate, meta, (meta.family_info?.groups ?? []).map((g) => g.name), defaultGroup(meta.family_info));
  }
  if (out.gen) out.step = Math.min(out.step, Math.max(0, out.gen.tokens.length - 1));
  if (out.att?.T) out.pin = out.pin.filter((r) => r < out.att.T);
  if (out.att?.T && out.explain != null && out.explain >= out.att.T) out.explain = null;
  return out;
}

/**
 * {model, text, tokens, attention, causal, generation, boundary, selection, settings, axes, scope, live}
 *  - model: name, layer / head counts, family, attention kind, tasks, labels, pooling, head_figures
 *    (each encoder head's held-out figure, /models), classifier_layers
 *  - text: the text the analysis shows (the store's prompt, or the generation's text)
 *  - causal: whether the maps are causal (a decoder's) or full squares (an encoder's)
 *  - attention: the AttentionSet of the analysed sequence ([layer][head][query][key], fetched
 *    per layer on demand: `await attention.ensure([l])`, then `attention.head(l, h)`)
 *  - generation: the GenerationRecord, or null
 *  - boundary: index of the first generated token in `tokens` when they are prompt + generation
 *  - axes: what rows and columns are (a cross-attention view would say target / source)
 *  - scope: "" or what the maps are when the model has several groups (an encoder-decoder's:
 *    its encoder's self-attention over the source; the translator's own views show the rest)
 */
export function viewParams(s) {
  const meta = s.meta;
  if (!meta || !(meta.n_layers > 0) || !(meta.n_heads > 0)) throw new TypeError("view params need the model's layer and head counts");
  const att = s.att;
  if (att && att.tokens && att.tokens.length !== att.T) throw new TypeError("attention tokens and size disagree");
  const all = (n) => [...Array(n).keys()];
  const gen = s.gen;
  // a decoder's analysis of prompt + generated ids has a boundary; an encoder-decoder's maps here are its encoder's, over the source only
  const fromGeneration = !!(att?.ids && !att.targetIds && s.ids && att.ids.length === s.ids.length && att.ids.every((x, i) => x === s.ids[i]));
  return Object.freeze({
    model: Object.freeze({
      name: meta.name, n_layers: meta.n_layers, n_heads: meta.n_heads, context_length: meta.context_length,
      family: meta.family ?? "decoder", attention: meta.attention ?? "causal", tasks: meta.tasks ?? [], labels: meta.labels ?? null, pooling: meta.pooling ?? null,
      head_figures: meta.head_figures ?? {}, classifier_layers: meta.classifier_layers ?? 0,
      capabilities: meta.capabilities ?? capabilities(meta.family_info, meta.tasks),
      groups: Object.freeze((meta.family_info?.groups ?? [primaryGroup(null)]).map((g) => Object.freeze({ ...g }))),
      d_model: meta.d_model ?? null,
    }),
    // the heads ablated: [{layer, head, how, group}] (ablation.js)
    ablation: Object.freeze(parseAblation(s.ablate).map((a) => Object.freeze(a))),
    text: att ? att.text : s.prompt,
    prompt: s.prompt, // the prompt box (what a generation starts from)
    conversation: chatMode(s), // the box holds a chat model's conversation (chat.js), not plain text
    tokens: att?.tokens ?? [],
    attention: att,
    causal: att ? att.causal : (meta.attention ?? "causal") === "causal",
    generation: gen,
    boundary: fromGeneration && s.plen > 0 && s.plen < att.T ? s.plen : null,
    selection: Object.freeze({
      layer: s.layer,
      head: s.head,
      layerB: s.layerB,
      headB: s.headB,
      step: s.step,
      pinned: s.pin.slice(),
      layers: (s.layers ?? all(meta.n_layers)).slice().sort((a, b) => a - b),
      heads: (s.heads ?? all(meta.n_heads)).slice().sort((a, b) => a - b),
      lineHeads: s.lheads == null ? null : s.lheads.slice().sort((a, b) => a - b), // null: the chosen head alone
      explain: s.explain, // the query row the Head view explains, or null
      sender: s.sender ? s.sender.slice() : null, // the Causes view's head: [layer, head], or null
    }),
    settings: Object.freeze({ cmap: s.cmap, dcmap: s.dcmap, scale: s.scale, sink: s.sink, op: s.op, diff: s.diff, promptB: s.promptB, zoom: s.zoom, fillk: s.fillk, xavg: s.xavg, probe: s.probe, lensat: s.lensat, morder: s.morder, win: s.win,
      clean: s.clean, corrupted: s.corrupted, answer: s.answer, foil: s.foil, method: s.method, component: s.component, ctarget: s.ctarget }),
    axes: Object.freeze({ rows: "query", cols: "key" }),
    // what the shared views' maps are when the family has other groups too: its primary group's
    // (an encoder-decoder's encoder, over the source)
    scope: (meta.family_info?.groups?.length ?? 1) > 1 ? primaryGroup(meta.family_info).description : "",
    live: s.streaming,
  });
}
