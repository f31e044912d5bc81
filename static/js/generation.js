// The generation client: reads the sampling form, streams /generate (SSE) and reports each
// token as it arrives; and the GenerationRecord every view reads a generation from, built
// either from that stream or, for a shared link, from an analysis of the same token ids.

import { postRaw, ApiError } from "./api.js";
import { readSSE } from "./sse.js";

const $ = (sel) => document.querySelector(sel);
export const SAMPLING_FIELDS = ["max_new_tokens", "temperature", "top_k", "top_p", "seed", "logprobs"];

export function parseStops(raw) {
  raw = raw.trim();
  if (!raw) return [];
  if (raw.startsWith("[")) {
    try {
      const v = JSON.parse(raw);
      if (Array.isArray(v)) return v.map(String);
    } catch {
      /* not JSON: a comma-separated list */
    }
  }
  return raw
    .split(",")
    .map((s) => s.trim().replace(/\\n/g, "\n").replace(/\\t/g, "\t"))
    .filter((s) => s.length);
}

/** The /generate body from the form. Values the browser cannot parse go as typed: the server names them. */
export function readSamplingForm(prompt) {
  const body = { prompt };
  for (const f of SAMPLING_FIELDS) {
    const el = $("#" + f);
    const v = el.value.trim();
    if (el.validity?.badInput) body[f] = el.value;
    else if (v !== "") body[f] = Number(v);
  }
  body.top_k ??= null;
  body.seed ??= null;
  body.stop = parseStops($("#stop").value);
  body.return_attention = $("#return_attention").checked;
  body.stream = true;
  return body;
}

/**
 * A generation as the views see it: the prompt's tokens, the generated tokens, and for step s
 * the attention of the position that produced token s (query = position P + s − 1) over the
 * P + s earlier positions, as [layer][head] rows. `recorded` is false when no attention came.
 */
export class GenerationRecord {
  constructor({ promptTokens = [], tokens = [], rows = null, source = "stream", done = false } = {}) {
    this.promptTokens = promptTokens;
    this.tokens = tokens;
    this.rows = rows; // stream: [step][layer][head][key] | null
    this.source = source; // "stream" | "analysis" (a decoder's link) | "translation" (an encoder-decoder's link)
    this.done = done;
    this.analysis = null; // AttentionSet over the same ids (source "analysis")
    this.translation = null; // TranslationSet of the source and the generated target (source "translation")
  }

  /** Prompt length: known from the first token's attention before the prompt's tokens arrive. */
  get promptLength() {
    return this.promptTokens.length || this.rows?.[0]?.[0]?.[0]?.length || 0;
  }

  /** The tokens before generated token `step` … and up to it: prompt tokens not yet known are "…". */
  keyTokens() {
    const P = this.promptLength;
    const prompt = this.promptTokens.length ? this.promptTokens : Array.from({ length: P }, () => ({ id: -1, text: "…" }));
    return prompt.concat(this.tokens);
  }

  get recorded() {
    return this.source !== "stream" || (this.rows != null && this.rows.length === this.tokens.length && this.tokens.length > 0);
  }

  /**
   * [layer][head] -> Float32Array(P + step): what the producing position attended to; for an
   * encoder-decoder, Float32Array(S): that decoder step's cross-attention over the source.
   */
  attentionAt(step) {
    if (this.source === "stream") return this.rows?.[step] ?? null;
    if (this.source === "translation") {
      const x = this.translation;
      if (!x || step >= x.T - 1) return null;
      return [...Array(x.L).keys()].map((l) => [...Array(x.H).keys()].map((h) => x.head("cross", l, h).slice(step * x.S, (step + 1) * x.S)));
    }
    const att = this.analysis;
    const q = this.promptTokens.length + step - 1;
    if (!att || q < 0) return null;
    const out = [];
    for (let l = 0; l < att.nLayers; l++) {
      const heads = [];
      for (let h = 0; h < att.nHeads; h++) heads.push(att.head(l, h).slice(q * att.T, q * att.T + q + 1));
      out.push(heads);
    }
    return out;
  }

  with(patch) {
    const r = new GenerationRecord({ ...this, ...patch });
    r.analysis = patch.analysis ?? this.analysis;
    r.translation = patch.translation ?? this.translation;
    return r;
  }

  /** Rebuild an encoder-decoder's generation (e.g. for a link) from its TranslationSet: source and generated target. */
  static fromTranslation(set) {
    const r = new GenerationRecord({ promptTokens: set.source, tokens: set.target.slice(1), source: "translation", done: true });
    r.translation = set;
    return r;
  }

  /** Rebuild from an analysis of prompt + generated ids (every layer fetched), e.g. for a link. */
  static fromAnalysis(att, promptLength) {
    const P = Math.max(1, Math.min(promptLength, att.T - 1));
    const r = new GenerationRecord({ promptTokens: att.tokens.slice(0, P), tokens: att.tokens.slice(P), source: "analysis", done: true });
    r.analysis = att;
    return r;
  }
}

/**
 * Stream one generation. Calls onToken(token, index) per SSE token event; resolves to
 * {done, stopped, error} (done: the `done` event's data).
 */
export async function streamGeneration(body, { signal, onToken }) {
  let done = null;
  let error = null;
  let stopped = false;
  let n = 0;
  try {
    const res = await postRaw("/generate", body, { signal });
    await readSSE(res, ({ event, data }) => {
      if (event === "token") onToken(data, n++);
      else if (event === "done") done = data;
      else if (event === "error") error = new ApiError(data?.message || data?.detail || String(data), { status: 500 });
    }, { signal });
  } catch (err) {
    if (err?.detail === "aborted" || err?.name === "AbortError") stopped = true;
    else error = err;
  }
  return { done, stopped, error };
}
