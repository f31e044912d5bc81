// How values become colours: the Scale menu's choices for attention weights (non-negative)
// and for differences (signed, centred on 0), each returning the numbers to paint, the range
// and an honest legend label.

import { maxOf, maxAbs } from "./attention.js";

/** The q-th quantile (0..1) of the finite values of `m`, estimated from at most ~4096 samples. */
export function quantile(m, q, { from = 0 } = {}) {
  const n = m.length - from;
  if (n <= 0) return 0;
  const stride = Math.max(1, Math.floor(n / 4096));
  const sample = [];
  for (let i = from; i < m.length; i += stride) {
    const v = m[i];
    if (v === v && v > 0) sample.push(v);
  }
  if (!sample.length) return 0;
  const s = Float32Array.from(sample).sort();
  return s[Math.min(s.length - 1, Math.floor(q * (s.length - 1)))];
}

/** Each row divided by its own maximum (NaN stays NaN). */
export function rowNormalise(m, cols) {
  const rows = m.length / cols;
  const out = new Float32Array(m.length);
  for (let r = 0; r < rows; r++) {
    const b = r * cols;
    let mx = 0;
    for (let c = 0; c < cols; c++) if (m[b + c] > mx) mx = m[b + c];
    for (let c = 0; c < cols; c++) {
      const v = m[b + c];
      out[b + c] = v !== v ? NaN : mx > 0 ? v / mx : 0;
    }
  }
  return out;
}

export const SCALES = {
  p99: "0 – 99th percentile",
  max: "0 – max",
  unit: "0 – 1",
  row: "each row to its max",
  sqrt: "√, 0 – max",
};

/**
 * How to colour a non-negative matrix: returns {data, vmin, vmax, gamma, label}.
 * "p99" ignores the first row (a causal model's first query always puts 1.0 on itself,
 * which would otherwise make every map's maximum 1).
 */
export function colourScale(m, cols, mode, { skipFirstRow = true, what = "attention weight" } = {}) {
  const from = skipFirstRow && m.length > cols ? cols : 0;
  switch (mode) {
    case "unit":
      return { data: m, vmin: 0, vmax: 1, gamma: 1, label: `${what}, 0 – 1` };
    case "row":
      return { data: rowNormalise(m, cols), vmin: 0, vmax: 1, gamma: 1, label: `${what} ÷ its row's maximum` };
    case "sqrt":
      return { data: m, vmin: 0, vmax: maxOf(m) || 1, gamma: 0.5, label: `${what} (√ scale), 0 – max` };
    case "max":
      return { data: m, vmin: 0, vmax: maxOf(m) || 1, gamma: 1, label: `${what}, 0 – max` };
    default: {
      const v = quantile(m, 0.99, { from }) || maxOf(m) || 1;
      return { data: m, vmin: 0, vmax: v, gamma: 1, label: `${what}, colour clipped at its 99th pct.` };
    }
  }
}

/**
 * How to colour a signed matrix (a difference) on a diverging map centred on 0:
 * returns {data, vmin, vmax, gamma, label}. Each Scale choice means the same as for weights.
 */
export function divergingScale(m, cols, mode) {
  const abs = Float32Array.from(m, (v) => Math.abs(v));
  const top = maxAbs(m) || 1;
  switch (mode) {
    case "unit":
      return { data: m, vmin: -1, vmax: 1, gamma: 1, label: "A − B, −1 … 1" };
    case "row": {
      const rows = m.length / cols;
      const out = new Float32Array(m.length);
      for (let r = 0; r < rows; r++) {
        let mx = 0;
        for (let c = 0; c < cols; c++) mx = Math.max(mx, Math.abs(m[r * cols + c]) || 0);
        for (let c = 0; c < cols; c++) out[r * cols + c] = mx > 0 ? m[r * cols + c] / mx : m[r * cols + c] === m[r * cols + c] ? 0 : NaN;
      }
      return { data: out, vmin: -1, vmax: 1, gamma: 1, label: "A − B ÷ each row's largest |A − B|" };
    }
    case "sqrt":
      return { data: m, vmin: -top, vmax: top, gamma: 0.5, label: "A − B (√ scale), ± largest |A − B|" };
    case "max":
      return { data: m, vmin: -top, vmax: top, gamma: 1, label: "A − B, ± largest |A − B|" };
    default: {
      const v = quantile(abs, 0.99, { from: m.length > cols ? cols : 0 }) || top;
      return { data: m, vmin: -v, vmax: v, gamma: 1, label: "A − B, colour clipped at the 99th pct. of |A − B|" };
    }
  }
}
