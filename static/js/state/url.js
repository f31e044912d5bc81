// The query string <-> the URL keys of the state (state/schema.js). Nothing else decides
// what a link carries.

import { URL_KEYS } from "./schema.js";

function decode(type, v) {
  switch (type) {
    case "int": {
      const n = Number.parseInt(v, 10);
      return Number.isFinite(n) && n >= 0 ? n : undefined;
    }
    case "number": {
      const n = Number(v);
      return Number.isFinite(n) && n > 0 ? n : undefined;
    }
    case "bool":
      return v === "1" || v === "true";
    case "list":
    case "set":
      return v === "" ? [] : v.split(",").map(Number).filter((n) => Number.isInteger(n) && n >= 0);
    default:
      return v;
  }
}

function same(a, b) {
  if (Array.isArray(a) && Array.isArray(b)) return a.length === b.length && a.every((x, i) => x === b[i]);
  return a === b;
}

/** The URL keys present in a query string (default: the page's), decoded. */
export function readURL(search = window.location.search) {
  const q = new URLSearchParams(search);
  const out = {};
  for (const { key, type } of URL_KEYS) {
    if (!q.has(key)) continue;
    const v = decode(type, q.get(key));
    if (v !== undefined) out[key] = v;
  }
  return out;
}

/** The query string for a state: every URL key that differs from its default. */
export function queryFor(state) {
  const q = new URLSearchParams();
  for (const { key, type, def } of URL_KEYS) {
    const v = state[key];
    if (v === undefined || same(v, def)) continue;
    if (v === null) continue;
    if (type === "bool") q.set(key, v ? "1" : "0");
    else if (type === "list" || type === "set") q.set(key, v.join(","));
    else q.set(key, String(v));
  }
  return q.toString();
}

/** Replace the page's URL (no history entry) with the one derived from `state`. */
export function writeURL(state) {
  const s = queryFor(state);
  const url = window.location.pathname + (s ? "?" + s : "") + window.location.hash;
  if (url !== window.location.pathname + window.location.search + window.location.hash) {
    window.history.replaceState(null, "", url);
  }
  return url;
}
