// Token display helpers: whitespace made visible so tokens stay distinguishable on axes.

const VISIBLE = { " ": "␣", "\n": "↵", "\t": "⇥", "\r": "␍" };

/** The token's text with spaces, newlines and tabs shown as ␣ ↵ ⇥. */
export function visible(text) {
  if (text == null) return "";
  const out = String(text).replace(/[ \n\t\r]/g, (c) => VISIBLE[c]);
  return out === "" ? "∅" : out;
}

/** A short label for an axis: visible text cut to `max` characters. */
export function axisLabel(text, max = 12) {
  const v = visible(text);
  const chars = Array.from(v);
  return chars.length > max ? chars.slice(0, max - 1).join("") + "…" : v;
}

/** “text” with visible whitespace and its position, for tooltips. */
export function quoted(token, index) {
  const t = visible(token?.text ?? token);
  return index == null ? `“${t}”` : `“${t}” (#${index})`;
}

export function escapeHTML(s) {
  return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
}
