// A word-level diff of two texts (longest common subsequence of their words and spaces), for
// the Ablate view's side-by-side generations.

/** The text as words and runs of whitespace, in order. */
export const words = (text) => String(text ?? "").match(/\s+|[^\s]+/g) ?? [];

/**
 * [{text, op}] for `a` and for `b`: op "same" (in both, in order), "del" (only in a) or "ins"
 * (only in b). Joining each side's texts gives `a` and `b` back.
 */
export function diffWords(a, b) {
  const x = words(a);
  const y = words(b);
  const n = x.length;
  const m = y.length;
  // lcs[i][j]: the longest common subsequence of x[i:] and y[j:]
  const lcs = Array.from({ length: n + 1 }, () => new Uint16Array(m + 1));
  for (let i = n - 1; i >= 0; i--) for (let j = m - 1; j >= 0; j--) lcs[i][j] = x[i] === y[j] ? lcs[i + 1][j + 1] + 1 : Math.max(lcs[i + 1][j], lcs[i][j + 1]);
  const left = [];
  const right = [];
  let i = 0;
  let j = 0;
  while (i < n && j < m) {
    if (x[i] === y[j]) {
      left.push({ text: x[i++], op: "same" });
      right.push({ text: y[j++], op: "same" });
    } else if (lcs[i + 1][j] >= lcs[i][j + 1]) left.push({ text: x[i++], op: "del" });
    else right.push({ text: y[j++], op: "ins" });
  }
  while (i < n) left.push({ text: x[i++], op: "del" });
  while (j < m) right.push({ text: y[j++], op: "ins" });
  return { left, right };
}
