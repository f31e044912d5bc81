// Thin client for the attnlens HTTP API. Every failure becomes an ApiError whose
// message is fit to show a person: field + reason for 422, size for 413, retry hint for 429.

export class ApiError extends Error {
  constructor(message, { status = 0, fields = [], retryAfter = null, detail = null, code = null } = {}) {
    super(message);
    this.name = "ApiError";
    this.status = status; // 0 = no HTTP answer (server down, network, aborted)
    this.code = code; // the server's machine-readable reason, e.g. "context_length_exceeded"
    this.fields = fields; // names of request fields the server rejected
    this.retryAfter = retryAfter;
    this.detail = detail;
  }
}

/** The server's `detail`: a message, or pydantic's list of {loc, msg, type} for a 422. */
export function describeDetail(detail) {
  if (detail == null) return "";
  if (typeof detail === "string") return detail;
  if (Array.isArray(detail)) {
    return detail
      .map((d) => {
        const field = (d.loc || []).filter((p) => p !== "body").join(".");
        const msg = String(d.msg || "").replace(/^Value error, /, "");
        return field ? `${field}: ${msg}` : msg;
      })
      .join("; ");
  }
  return JSON.stringify(detail);
}

/**
 * Build an ApiError from a non-OK Response. The field to mark comes from the server's
 * `param` (every native error that blames a field names it there), plus, for a 422 with
 * several problems, each one's `loc`.
 */
export async function errorFromResponse(res) {
  let body = null;
  let raw = "";
  try {
    raw = await res.text();
    body = raw ? JSON.parse(raw) : null;
  } catch {
    body = null;
  }
  const detail = body && typeof body === "object" ? body.detail : raw;
  const text = describeDetail(detail);
  const fields = [];
  if (typeof body?.param === "string" && body.param) fields.push(body.param.split(".")[0]);
  if (Array.isArray(detail)) for (const d of detail) fields.push(...(d.loc || []).filter((p) => p !== "body").slice(0, 1).map(String));
  const retryAfter = res.headers.get("Retry-After");
  let message;
  switch (res.status) {
    case 422:
    case 400:
      message = `Invalid request — ${text || res.statusText}`;
      break;
    case 401:
    case 403:
      message = `Not allowed — ${text || "the server wants an API key"}`;
      break;
    case 413:
      message = `Input too large — ${text || "the request body or text is over the server's limit"}`;
      break;
    case 429:
      message = `The server is busy (too many requests)${retryAfter ? ` — try again in ${retryAfter} s` : ""}${text ? `: ${text}` : ""}`;
      break;
    case 503:
      message = `Service unavailable${retryAfter ? ` — try again in ${retryAfter} s` : ""}${text ? `: ${text}` : ""}`;
      break;
    default:
      message = `Server error ${res.status}${text ? ` — ${text}` : res.statusText ? ` — ${res.statusText}` : ""}`;
  }
  const code = typeof body?.code === "string" ? body.code : null;
  return new ApiError(message, { status: res.status, fields: [...new Set(fields)], retryAfter, detail, code });
}

const KEY_STORAGE = "attnlens-api-key";

/** The API key this browser sends (localStorage, never the URL), or "". */
export function apiKey() {
  try {
    return localStorage.getItem(KEY_STORAGE) || "";
  } catch {
    return "";
  }
}

export function setApiKey(key) {
  try {
    if (key) localStorage.setItem(KEY_STORAGE, key);
    else localStorage.removeItem(KEY_STORAGE);
  } catch {
    /* private mode: nothing kept */
  }
}

function headers(extra) {
  const key = apiKey();
  return key ? { ...extra, Authorization: `Bearer ${key}` } : extra;
}

function networkError(err) {
  if (err && err.name === "AbortError") return new ApiError("Stopped.", { status: 0, detail: "aborted" });
  return new ApiError("Cannot reach the attnlens server — is `attnlens serve` running?", { status: 0 });
}

// The model the page's requests name (the model picker sets it); null = the server's default.
let requestModel = null;
export function setRequestModel(name) {
  requestModel = name || null;
}

/** POST JSON; resolves to the raw Response when OK, throws ApiError otherwise. */
export async function postRaw(path, body, { signal } = {}) {
  if (requestModel && body && typeof body === "object" && !Array.isArray(body) && !("model" in body)) {
    body = { ...body, model: requestModel };
  }
  let res;
  try {
    res = await fetch(path, {
      method: "POST",
      headers: headers({ "Content-Type": "application/json", Accept: "application/json, text/event-stream" }),
      body: JSON.stringify(body),
      signal,
    });
  } catch (err) {
    throw networkError(err);
  }
  if (!res.ok) throw await errorFromResponse(res);
  return res;
}

export async function postJSON(path, body, opts) {
  const res = await postRaw(path, body, opts);
  try {
    return await res.json();
  } catch (err) {
    throw networkError(err);
  }
}

export async function getJSON(path, { signal } = {}) {
  let res;
  try {
    res = await fetch(path, { headers: headers({ Accept: "application/json" }), signal });
  } catch (err) {
    throw networkError(err);
  }
  if (!res.ok) throw await errorFromResponse(res);
  return res.json();
}

/** /model: the description of the loaded model `name` (default: the server's default model). */
export const getModel = (name, opts) => getJSON(name ? `/model?model=${encodeURIComponent(name)}` : "/model", opts);
export const getModels = (opts) => getJSON("/models", opts);

// ---- /attention ---------------------------------------------------------------

function base64ToBytes(b64) {
  const bin = atob(b64);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

/** IEEE 754 half (as uint16) -> float32 via a 65536-entry table built once. */
let HALF_TABLE = null;
function halfTable() {
  if (HALF_TABLE) return HALF_TABLE;
  HALF_TABLE = new Float32Array(65536);
  for (let h = 0; h < 65536; h++) {
    const s = h & 0x8000 ? -1 : 1;
    const e = (h >> 10) & 0x1f;
    const f = h & 0x3ff;
    let v;
    if (e === 0) v = s * 2 ** -14 * (f / 1024);
    else if (e === 31) v = f ? NaN : s * Infinity;
    else v = s * 2 ** (e - 15) * (1 + f / 1024);
    HALF_TABLE[h] = v;
  }
  return HALF_TABLE;
}

/**
 * Decode the payload of an /attention answer into a flat Float32Array [L][H][T][T] (row-major).
 * Handles format json (nested lists in `attention`), f16 and u8 (base64 in `data`, with
 * `dtype`, `scale`), and packing "tril" (only cells on or below each diagonal are sent).
 */
export function decodeAttention(resp) {
  const payload = resp.data ?? resp.attention;
  if (typeof payload !== "string") {
    const flat = [];
    const walk = (x) => {
      if (Array.isArray(x)) for (const y of x) walk(y);
      else flat.push(x);
    };
    walk(payload);
    return Float32Array.from(flat);
  }
  const bytes = base64ToBytes(payload);
  const dtype = resp.dtype || (resp.format === "u8" ? "uint8" : "float16");
  let values;
  if (dtype === "uint8") {
    const scale = resp.scale ?? 1 / 255;
    values = new Float32Array(bytes.length);
    for (let i = 0; i < bytes.length; i++) values[i] = bytes[i] * scale;
  } else {
    const n = bytes.length >> 1;
    const table = halfTable();
    values = new Float32Array(n);
    for (let i = 0; i < n; i++) values[i] = table[bytes[2 * i] | (bytes[2 * i + 1] << 8)];
  }
  if (resp.packing === "tril") {
    const shape = resp.shape;
    const T = shape[shape.length - 1];
    const mats = shape.slice(0, -2).reduce((a, b) => a * b, 1);
    const per = (T * (T + 1)) / 2;
    const out = new Float32Array(mats * T * T);
    for (let m = 0; m < mats; m++) {
      let src = m * per;
      const base = m * T * T;
      for (let r = 0; r < T; r++) {
        out.set(values.subarray(src, src + r + 1), base + r * T);
        src += r + 1;
      }
    }
    return out;
  }
  return values;
}

/**
 * Fetch attention for `source`: a text (the server tokenises it) or an array of token ids
 * (used as they are, e.g. a prompt's tokens plus the generated ones, so nothing is re-tokenised).
 * An encoder-decoder's `targetIds` are the target its decoder reads (e.g. a generated
 * translation); without them the server translates greedily. `ablate` (explain/ablation.js's
 * ablateField) asks for the maps of the run with those heads ablated.
 * Returns { tokens, nLayers, nHeads, layers, heads, T, data }
 * where data is Float32Array [layers.length][heads.length][T][T].
 */
/** An /attention request's body: what it analyses (`source`), in `format`, and the fields given. */
function attentionBody(source, { format, layers = null, heads = null, targetIds = null, ablate = null }) {
  // token ids, a text, or {messages} (a conversation, rendered by the model's chat template)
  const body = Array.isArray(source) ? { ids: source, format } : source?.messages ? { messages: source.messages, format } : { text: source, format };
  if (targetIds?.length) body.target_ids = targetIds;
  if (ablate?.length) body.ablate = ablate; // [{layer, head, how, group}]: the maps of the run with those heads ablated
  if (layers) body.layers = layers;
  if (heads) body.heads = heads;
  return body;
}

export async function fetchAttention(source, { layers = null, heads = null, format = "json", packing = "tril", targetIds = null, ablate = null, signal } = {}) {
  const body = attentionBody(source, { format, layers, heads, targetIds, ablate });
  if (format !== "json") body.packing = packing;
  const resp = await postJSON("/attention", body, { signal });
  const data = decodeAttention(resp);
  const T = resp.tokens.length;
  const [L, H] = resp.shape;
  if (data.length !== L * H * T * T) {
    throw new ApiError(
      `Unexpected attention payload: ${data.length} values for ${L} layers × ${H} heads × ${T}² tokens`,
      { status: 0 },
    );
  }
  return {
    tokens: resp.tokens,
    nLayers: resp.n_layers,
    nHeads: resp.n_heads,
    layers: resp.layers,
    heads: resp.heads,
    direction: resp.direction ?? "causal", // "bidirectional": an encoder's full T x T maps
    T,
    data,
  };
}

/**
 * A reduced /attention answer (long inputs, longmaps.js): `pool` bins, or a window `rows` × `cols`
 * ([start, end) positions), or both, of the given layers and heads. Returns {tokens, T, data
 * (Float32Array, [layers][heads][rows][cols]), shape, rows, cols, rowEdges, colEdges, direction,
 * bytes (the answer's size as received)}.
 */
export async function fetchAttentionWindow(source, { layers = null, heads = null, pool = null, rows = null, cols = null, format = "f16", targetIds = null, ablate = null, signal } = {}) {
  const body = attentionBody(source, { format, layers, heads, targetIds, ablate });
  if (pool) body.pool = pool;
  if (rows) body.rows = rows;
  if (cols) body.cols = cols;
  const resp = await postJSON("/attention", body, { signal });
  const data = decodeAttention(resp);
  const cells = resp.shape.reduce((a, b) => a * b, 1);
  if (data.length !== cells) throw new ApiError(`Unexpected attention payload: ${data.length} values for shape ${resp.shape.join(" × ")}`, { status: 0 });
  return {
    tokens: resp.tokens,
    T: resp.tokens.length,
    data,
    shape: resp.shape,
    rows: resp.rows,
    cols: resp.cols,
    rowEdges: resp.row_edges ?? null,
    colEdges: resp.col_edges ?? null,
    direction: resp.direction ?? "causal",
    bytes: (resp.data ?? "").length,
  };
}
