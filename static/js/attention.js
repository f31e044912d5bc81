// Attention data and the arithmetic the views need: per-head matrices, aggregates,
// rollout (Abnar & Zuidema 2020), first-token-sink removal, differences and row sums.
// Matrices are flat Float32Arrays, row-major, rows = queries, cols = keys.

import { fetchAttention, fetchAttentionWindow, ApiError } from "./api.js";

/** Compact transfer formats for long inputs: JSON up to this many tokens, then f16. */
export const JSON_MAX_TOKENS = 64;

/**
 * Every layer comes in the first request when all of them are at most this many bytes (f16):
 * one forward on the server either way, and then no view waits for the network (the bundled
 * default model at its full 256 tokens is 2 MB). Larger models are fetched layer by layer.
 */
export const ALL_LAYERS_BYTES = 16 * 1024 * 1024;

/**
 * Past this many tokens the page never fetches whole maps (2,048 tokens: 38 MB a layer in f16):
 * it reads every head pooled (`overview`, the model view) and one head a window at a time
 * (`window`, the head view), each reduced on the server (POST /attention's pool, rows, cols).
 */
export const LONG_TOKENS = 512;
/** The overview's bins a side: 270 heads of 64 × 64 in f16 are 2.2 MB. */
export const OVERVIEW_BINS = 64;
/** The windows a long input's head view keeps (zooming back needs no request). */
const WINDOWS_KEPT = 24;

/**
 * All attention for one text, fetched layer by layer as views need them.
 * `ensure(layers)` fetches what is missing (in one request); `head(l, h)` is a T×T view.
 * With `ids` (token ids) the server analyses exactly those tokens and `text` is only a label:
 * used for prompt + generated tokens, whose text may not re-tokenise to the same ids.
 * An encoder-decoder's maps here are its encoder's over the source (`text` / `ids`); its
 * `targetIds` (a generated translation) are the target the translator views read
 * (translator/translation.js), or null for the model's own greedy translation.
 * `ablate` (the request field, explain/ablation.js's ablateField) makes it the maps of the run
 * with those heads ablated (the Difference view's "with / without the ablation").
 * `fetch` answers like api.js's fetchAttention (the notebook views pass one that reads the
 * answer embedded in their document: inline.js).
 */
export class AttentionSet {
  constructor(text, meta, { format = "auto", ids = null, targetIds = null, messages = null, ablate = null, fetch = fetchAttention, fetchWindow = fetchAttentionWindow } = {}) {
    this.fetch = fetch;
    this.fetchWindow = fetchWindow;
    this.long = false; // more than LONG_TOKENS tokens: read reduced (overview, window), never whole
    this.overviewMaps = null; // {bins, rowEdges, colEdges, data}: every head pooled
    this.windows = new Map(); // "layer.head:rows:cols:pool" -> a window (the last WINDOWS_KEPT)
    this.bytesFetched = 0; // attention payload bytes received (base64), for the perf readout
    this.ablate = ablate;
    this.text = text;
    this.messages = messages; // a conversation (chat.js) that `text` writes as turns: the server renders it
    this.ids = ids && ids.length ? ids.slice() : null;
    this.targetIds = targetIds && targetIds.length ? targetIds.slice() : null;
    this.meta = meta; // {n_layers, n_heads, ...} from /model
    this.nLayers = meta.n_layers;
    this.nHeads = meta.n_heads;
    this.format = format;
    this.tokens = null;
    this.T = 0;
    this.layers = new Map(); // layer -> Float32Array(H*T*T)
    this.pending = new Map(); // layer -> Promise
    this.lastFormat = null;
    // a causal model's maps are sent as their lower triangle; others (an encoder's) in full
    this.packing = meta.attention && meta.attention !== "causal" ? "full" : "tril";
    this.causal = this.packing === "tril"; // confirmed by the answer's `direction`
  }

  chooseFormat(T) {
    if (this.format !== "auto") return this.format;
    return T != null && T <= JSON_MAX_TOKENS ? "json" : "f16";
  }

  has(layer) {
    return this.layers.has(layer);
  }

  hasAll() {
    for (let l = 0; l < this.nLayers; l++) if (!this.layers.has(l)) return false;
    return true;
  }

  /** Whether every layer fits in one request (ALL_LAYERS_BYTES), judged by the longest the text can be. */
  smallEnough() {
    const T = this.T || this.ids?.length || this.meta.context_length || Infinity;
    const cells = this.nLayers * this.nHeads * T * T * (this.packing === "tril" ? 0.5 : 1);
    return 2 * cells <= ALL_LAYERS_BYTES;
  }

  /** What a request names: the ids, the conversation, or the text. */
  source() {
    return this.ids ?? (this.messages ? { messages: this.messages } : this.text);
  }

  /** Whether the input may be longer than LONG_TOKENS (before an answer says how long it is). */
  mayBeLong() {
    if (this.T) return this.T > LONG_TOKENS;
    if (this.ids) return this.ids.length > LONG_TOKENS;
    if (this.targetIds) return false; // a translator's source and target: short by construction
    const text = this.messages ? this.messages.map((m) => m.content).join("") : this.text;
    return new TextEncoder().encode(text).length > LONG_TOKENS - 16; // a token is a byte at least; framing adds a few
  }

  /** The first request of an analysis: a long input's overview, else the maps of `layer`. */
  async begin(layer, opts = {}) {
    if (this.mayBeLong()) {
      await this.overview(opts);
      if (this.long) return;
    }
    await this.ensure([layer], opts);
  }

  /** Every layer's and head's map pooled to OVERVIEW_BINS a side, in one request: {bins, rowEdges, colEdges, data}. */
  async overview({ signal } = {}) {
    if (this.overviewMaps) return this.overviewMaps;
    if (!this.overviewPending) {
      this.overviewPending = this.fetchWindow(this.source(), { pool: OVERVIEW_BINS, format: "f16", targetIds: this.targetIds, ablate: this.ablate, signal })
        .then((res) => {
          if (!this.tokens) {
            this.tokens = res.tokens;
            this.T = res.T;
            this.causal = res.direction === "causal";
          }
          this.long = res.T > LONG_TOKENS;
          this.bytesFetched += res.bytes;
          this.overviewMaps = { bins: res.shape[2], rowEdges: res.rowEdges, colEdges: res.colEdges, data: res.data };
          return this.overviewMaps;
        })
        .finally(() => {
          this.overviewPending = null;
        });
    }
    return this.overviewPending;
  }

  /** One head's pooled map from the overview (bins × bins), or null before it is here. */
  pooledHead(layer, head) {
    const o = this.overviewMaps;
    if (!o) return null;
    const n = o.bins * o.bins;
    const i = layer * this.nHeads + head;
    return o.data.subarray(i * n, (i + 1) * n);
  }

  /**
   * One head's window, query rows × key cols ([start, end) positions), at full resolution when
   * it spans at most `pixels` positions, else pooled to `pixels` bins a side:
   * {data, nr, nc, rows, cols, rowEdges, colEdges, pooled}. Kept (the last WINDOWS_KEPT).
   */
  async window(layer, head, { rows, cols, pixels, signal } = {}) {
    const span = Math.max(rows[1] - rows[0], cols[1] - cols[0]);
    const pool = span > pixels ? Math.max(1, Math.floor(pixels)) : null;
    const key = `${layer}.${head}:${rows}:${cols}:${pool}`;
    const kept = this.windows.get(key);
    if (kept) return kept;
    const res = await this.fetchWindow(this.source(), { layers: [layer], heads: [head], pool, rows, cols, format: "f16", targetIds: this.targetIds, ablate: this.ablate, signal });
    this.bytesFetched += res.bytes;
    const edges = (w) => Array.from({ length: w[1] - w[0] + 1 }, (_, i) => w[0] + i);
    const out = { data: res.data, nr: res.shape[2], nc: res.shape[3], rows: res.rows, cols: res.cols, rowEdges: res.rowEdges ?? edges(res.rows), colEdges: res.colEdges ?? edges(res.cols), pooled: !!pool };
    this.windows.set(key, out);
    while (this.windows.size > WINDOWS_KEPT) this.windows.delete(this.windows.keys().next().value);
    return out;
  }

  /** Fetch the given layers (all heads) unless already here. Resolves when all are present. */
  async ensure(layers, { signal } = {}) {
    if (this.long)
      throw new ApiError(`This view draws whole maps, and ${this.T} tokens are too many for that (the page reads at most ${LONG_TOKENS} whole): the Model and Head views read long inputs pooled and in windows.`, { status: 0 });
    const absent = (l) => !this.layers.has(l) && !this.pending.has(l);
    let missing = layers.filter(absent);
    if (missing.length && this.smallEnough()) missing = [...Array(this.nLayers).keys()].filter(absent);
    if (missing.length) {
      // The token count is unknown before the first answer: start compact unless told otherwise.
      // (a text of at most 64 UTF-8 bytes has at most 64 tokens)
      const bytes = new TextEncoder().encode(this.text).length;
      const known = this.T || (this.ids ? this.ids.length : null);
      const format = this.chooseFormat(known || (bytes <= JSON_MAX_TOKENS ? bytes : null));
      this.lastFormat = format;
      const p = this.fetch(this.source(), { layers: missing, format, packing: this.packing, targetIds: this.targetIds, ablate: this.ablate, signal }).then((res) => {
        if (!this.tokens) {
          this.tokens = res.tokens;
          this.T = res.T;
          this.causal = res.direction === "causal";
        }
        const T = res.T;
        const H = res.heads.length;
        const per = H * T * T;
        res.layers.forEach((l, i) => {
          let block = res.data.subarray(i * per, (i + 1) * per);
          if (H !== this.nHeads) {
            // heads were filtered: place them at their indices, NaN elsewhere
            const full = new Float32Array(this.nHeads * T * T).fill(NaN);
            res.heads.forEach((h, j) => full.set(block.subarray(j * T * T, (j + 1) * T * T), h * T * T));
            block = full;
          }
          this.layers.set(l, block);
        });
        return res;
      });
      for (const l of missing) this.pending.set(l, p);
      try {
        await p;
      } finally {
        for (const l of missing) this.pending.delete(l);
      }
    }
    await Promise.all(layers.map((l) => this.pending.get(l)).filter(Boolean));
  }

  head(layer, head) {
    const block = this.layers.get(layer);
    if (!block) return null;
    const n = this.T * this.T;
    return block.subarray(head * n, (head + 1) * n);
  }
}

/** Hide key 0 (the usual "attention sink") and renormalise each row over the remaining keys. */
export function removeSink(m, T, cols = T) {
  const rows = m.length / cols;
  const out = new Float32Array(m.length);
  for (let r = 0; r < rows; r++) {
    let s = 0;
    const b = r * cols;
    for (let c = 1; c < cols; c++) s += m[b + c] || 0;
    out[b] = NaN; // hidden
    if (s > 0) for (let c = 1; c < cols; c++) out[b + c] = m[b + c] / s;
    else for (let c = 1; c < cols; c++) out[b + c] = 0;
  }
  return out;
}

/** Reduce several T×T matrices cell-wise: "mean" | "max" | "sum". */
export function reduce(mats, op) {
  const n = mats[0].length;
  const out = new Float32Array(n);
  if (op === "max") {
    out.fill(-Infinity);
    for (const m of mats) for (let i = 0; i < n; i++) if (m[i] > out[i]) out[i] = m[i];
    return out;
  }
  for (const m of mats) for (let i = 0; i < n; i++) out[i] += m[i];
  if (op === "mean") for (let i = 0; i < n; i++) out[i] /= mats.length;
  return out;
}

/** C = A · B for T×T matrices (lower-triangular inputs stay lower-triangular). */
export function matmul(A, B, T) {
  const C = new Float32Array(T * T);
  for (let i = 0; i < T; i++) {
    const ci = i * T;
    for (let k = 0; k < T; k++) {
      const a = A[ci + k];
      if (a === 0) continue;
      const bk = k * T;
      for (let j = 0; j < T; j++) C[ci + j] += a * B[bk + j];
    }
  }
  return C;
}

/**
 * Attention rollout (Abnar & Zuidema 2020): for each layer average the heads,
 * A' = 0.5·A + 0.5·I, renormalise rows, and multiply through the layers:
 * R = A'_L · … · A'_1. `layerMats` is a list (first layer first) of lists of head matrices.
 */
export function rollout(layerMats, T) {
  let R = null;
  for (const heads of layerMats) {
    const A = reduce(heads, "mean");
    for (let i = 0; i < T; i++) {
      A[i * T + i] = A[i * T + i] * 0.5 + 0.5;
      let s = 0;
      for (let j = 0; j < T; j++) {
        if (j !== i) A[i * T + j] *= 0.5;
        s += A[i * T + j];
      }
      if (s > 0) for (let j = 0; j < T; j++) A[i * T + j] /= s;
    }
    R = R ? matmul(A, R, T) : A;
  }
  return R;
}

/** Cell-wise a − b over the top-left n×n block both share; returns {data, n}. */
export function difference(a, Ta, b, Tb) {
  const n = Math.min(Ta, Tb);
  const out = new Float32Array(n * n);
  for (let r = 0; r < n; r++) {
    for (let c = 0; c < n; c++) {
      const x = a[r * Ta + c];
      const y = b[r * Tb + c];
      out[r * n + c] = x !== x || y !== y ? NaN : x - y;
    }
  }
  return { data: out, n };
}

/** Sum of the chosen rows of a rows×cols matrix (NaN counts as 0). */
export function sumRows(m, cols, rows) {
  const out = new Float32Array(cols);
  for (const r of rows) {
    const b = r * cols;
    for (let c = 0; c < cols; c++) {
      const v = m[b + c];
      if (v === v) out[c] += v;
    }
  }
  return out;
}

/** Largest finite value (0 if none). */
export function maxOf(m) {
  let mx = 0;
  for (let i = 0; i < m.length; i++) {
    const v = m[i];
    if (v > mx) mx = v;
  }
  return mx;
}

export function maxAbs(m) {
  let mx = 0;
  for (let i = 0; i < m.length; i++) {
    const v = Math.abs(m[i]);
    if (v > mx) mx = v;
  }
  return mx;
}

/**
 * How much a head attends to the query itself, the previous token and the first token,
 * each averaged over the same query rows 1 … T−1 (row 0 can only attend to itself, which
 * would count 1.0 for both "itself" and "first token"). NaN when T < 2.
 */
export function headStats(m, T) {
  let self = 0;
  let first = 0;
  let prev = 0;
  for (let r = 1; r < T; r++) {
    self += m[r * T + r] || 0;
    first += m[r * T] || 0;
    prev += m[r * T + r - 1] || 0;
  }
  const n = T - 1;
  return n > 0 ? { self: self / n, first: first / n, previous: prev / n, rows: n } : { self: NaN, first: NaN, previous: NaN, rows: 0 };
}

export const HEAD_STATS_ROWS = "averaged over query rows 1 … T−1 (row 0 can only attend to itself)";
