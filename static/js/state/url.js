// The page state that a link should reproduce, kept in the query string.

const KEYS = {
  prompt: "string",
  text: "string",
  view: "string",
  layer: "int",
  head: "int",
  sink: "bool",
  cmap: "string",
  scale: "string",
  op: "string",
  layers: "list",
  heads: "list",
  diff: "string",
  layerB: "int",
  headB: "int",
  promptB: "string",
  step: "int",
};

/** Read the known keys from a query string (default: the page's). */
export function readURL(search = window.location.search) {
  const q = new URLSearchParams(search);
  const out = {};
  for (const [k, type] of Object.entries(KEYS)) {
    if (!q.has(k)) continue;
    const v = q.get(k);
    if (type === "int") {
      const n = Number.parseInt(v, 10);
      if (Number.isFinite(n) && n >= 0) out[k] = n;
    } else if (type === "bool") out[k] = v === "1" || v === "true";
    else if (type === "list") out[k] = v === "" ? [] : v.split(",").map(Number).filter((n) => Number.isInteger(n) && n >= 0);
    else out[k] = v;
  }
  return out;
}

/** Write the state into the URL without adding history entries; defaults are left out. */
export function writeURL(state, defaults = {}) {
  const q = new URLSearchParams();
  for (const [k, type] of Object.entries(KEYS)) {
    let v = state[k];
    if (v == null || v === "" || v === defaults[k]) continue;
    if (type === "bool") {
      if (!v) continue;
      v = "1";
    } else if (type === "list") {
      if (Array.isArray(defaults[k]) && v.length === defaults[k].length && v.every((x, i) => x === defaults[k][i])) continue;
      v = v.join(",");
    }
    q.set(k, String(v));
  }
  const s = q.toString();
  const url = window.location.pathname + (s ? "?" + s : "") + window.location.hash;
  if (url !== window.location.pathname + window.location.search + window.location.hash) {
    window.history.replaceState(null, "", url);
  }
  return url;
}
