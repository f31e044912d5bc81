// The analysis routes the views call: POST /heads (the atlas), /lens (the logit lens),
// /logits (next-token predictions, with an ablation's effect) and /attention/explain (one
// attention row computed step by step) (issue 18); POST /patch (activation and path patching)
// and /logit-attribution (each head's and MLP's direct effect) for the Causes view (issue 46). Answers are kept per request body (a few), so a view
// drawn again, or another view on the same text, does not ask twice.

import { postJSON } from "../api.js";
import { ablateField } from "./ablation.js";

/**
 * The analysed sequence as these routes read it: its ids (or text) and an encoder-decoder's
 * target. A conversation (a set with `messages`, rendered by the server's chat template) goes
 * as the token ids its analysis came back with, so every route reads the same tokens.
 */
export function sequenceBody(att) {
  const body = att.ids ? { ids: att.ids } : att.messages && att.tokens ? { ids: att.tokens.map((t) => t.id) } : { text: att.text };
  if (att.targetIds) body.target_ids = att.targetIds;
  return body;
}

const KEEP = 24;
const cache = new Map(); // path + body -> Promise of the answer

/** POST once per distinct body (a failed request is forgotten, so trying again asks again). */
function cachedPost(path, body) {
  const key = path + " " + JSON.stringify(body);
  if (cache.has(key)) {
    const hit = cache.get(key);
    cache.delete(key);
    cache.set(key, hit); // most recently used last
    return hit;
  }
  const p = postJSON(path, body);
  p.catch(() => cache.delete(key));
  cache.set(key, p);
  while (cache.size > KEEP) cache.delete(cache.keys().next().value);
  return p;
}

const withAblation = (body, ablation) => {
  const field = ablateField(ablation ?? []);
  return field ? { ...body, ablate: field } : body;
};

/** Per-head scores and roles over the analysed sequence, or over the repeated-random probe. */
export function fetchHeads(att, { probe = null } = {}) {
  return cachedPost("/heads", probe ? { probe } : sequenceBody(att));
}

/** The logit lens: every layer's top-k (and the actual token's rank) at `positions` (null: every position). */
export const fetchLens = (att, { topK = 5, ablation = [], positions = null } = {}) =>
  cachedPost("/lens", withAblation({ ...sequenceBody(att), top_k: topK, ...(positions ? { positions } : {}), rank: true }, ablation));

/** Next-token predictions; with an ablation also the clean run and the per-position effect. */
export const fetchLogits = (att, { topK = 5, ablation = [], positions = "all" } = {}) =>
  cachedPost("/logits", withAblation({ ...sequenceBody(att), top_k: topK, positions }, ablation));

/** One query row of one head, computed step by step. `group`: null = the family's first. */
export function fetchExplain(att, { layer, head, query, group = null }) {
  const body = { ...sequenceBody(att), layer, head, query };
  if (group) body.group = group;
  return cachedPost("/attention/explain", body);
}

/** The top `topK` next tokens after `text` (its last position): the Causes view's answer and foil choices. */
// An encoder-decoder's (`target` given, "" for none): after its target, read with the source `text`;
// after none, at its first position (the model's own translation is the rest of the stream).
export function fetchNextTokens(text, topK = 10, target = null) {
  if (target == null) return cachedPost("/logits", { text, top_k: topK, positions: "last" });
  return target ? cachedPost("/logits", { text, target, top_k: topK, positions: "last" }) : cachedPost("/logits", { text, top_k: topK, positions: "all" });
}

/** A token as the causal routes take it: an id (a number) as `<name>_id`, a typed text as `<name>`. */
function tokenField(name, token) {
  return typeof token === "number" ? { [`${name}_id`]: token } : { [name]: token };
}

/** An encoder-decoder's target as the causal routes take it ("" or null: none, the start token alone). */
const targetField = (target) => (target ? { target } : {});

/**
 * Activation patching of `clean` into `corrupted`, the metric logit(answer) − logit(foil) at the
 * last position: `component` "heads" | "heads_by_position" | "residual" | "layers" | "paths"
 * (with `sender` [layer, head]; an encoder-decoder's [layer, head, group]), `method` "exact" |
 * "attribution". answer / foil: a token id, or a token's text. An encoder-decoder's prompts are
 * sources read with `target`.
 */
export function fetchPatch({ clean, corrupted, answer, foil, component = "heads", method = "exact", sender = null, position = null, target = null }) {
  const body = { clean, corrupted, ...tokenField("answer", answer), ...tokenField("foil", foil), ...targetField(target), component, method };
  if (sender) body.sender = { layer: sender[0], head: sender[1], ...(sender[2] ? { group: sender[2] } : {}) };
  if (position != null) body.position = position;
  return cachedPost("/patch", body);
}

/** Each head's, MLP's, the embedding's and the rest's direct effect on logit(answer) − logit(foil) at the last position of `text` (an encoder-decoder's: of its `target`). */
export function fetchLogitAttribution({ text, answer = null, foil = null, target = null }) {
  const body = { text, ...(answer != null ? tokenField("answer", answer) : {}), ...(foil != null ? tokenField("foil", foil) : {}), ...targetField(target) };
  return cachedPost("/logit-attribution", body);
}

/** The repeated-random probe for a model: as long as its context allows, at most 50. */
export function probeFor(meta, seed = 0) {
  const length = Math.max(2, Math.min(50, Math.floor(((meta.context_length ?? 64) - 3) / 2)));
  return { kind: "repeated_random", length, seed };
}
