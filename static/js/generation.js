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
    this.source = source;
    this.done = done;
    this.analysis = null; // AttentionSet over the same ids (source "analysis")
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
    return this.source === "analysis" || (this.rows != null && this.rows.length === this.tokens.length && this.tokens.length > 0);
  }

  /** [layer][head] -> Float32Array(P + step): what the producing position attended to. */
  attentionAt(step) {
    if (this.source === "stream") return this.rows?.[step] ?? null;
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
    });
  } catch (err) {
    if (err?.detail === "aborted" || err?.name === "AbortError") stopped = true;
    else error = err;
  }
  return { done, stopped, error };
}
