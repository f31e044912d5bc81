// The one owner of the page state. Every change goes through `set`, which coerces values to
// their declared type, writes the URL (derived from the URL keys only) and tells subscribers
// which keys changed. Nothing else assigns to the state.

import { STATE_KEYS, URL_KEYS, defaults } from "./schema.js";
import { writeURL } from "./url.js";

const TYPES = new Map(STATE_KEYS.map((k) => [k.key, k]));

function coerce(key, v) {
  const spec = TYPES.get(key);
  if (!spec) throw new Error(`unknown state key: ${key}`);
  if (v == null) return spec.def === null ? null : spec.def;
  switch (spec.type) {
    case "int":
      return Math.max(0, Math.trunc(Number(v)) || 0);
    case "number":
      return Number.isFinite(+v) && +v > 0 ? +v : spec.def;
    case "bool":
      return !!v;
    case "string":
      return String(v);
    case "list":
    case "set": {
      const xs = [...v].map(Number).filter((n) => Number.isInteger(n) && n >= 0);
      return spec.type === "set" ? [...new Set(xs)] : xs;
    }
    default:
      return v;
  }
}

function equal(a, b) {
  if (Array.isArray(a) && Array.isArray(b)) return a.length === b.length && a.every((x, i) => x === b[i]);
  return a === b;
}

const URL_KEY_SET = new Set(URL_KEYS.map((k) => k.key));

/**
 * Writes the URL at once, except while a generation streams in: then at most every 150 ms (the
 * stream changes `step` per token, and browsers throttle history.replaceState when it is
 * called hundreds of times a second).
 */
function throttledURLWriter() {
  let last = 0;
  let timer = null;
  return {
    write(state) {
      const now = performance.now();
      clearTimeout(timer);
      if (!state.streaming || now - last > 150) {
        last = now;
        writeURL(state);
      } else timer = setTimeout(() => ((last = performance.now()), writeURL(state)), 150);
    },
  };
}

export function createStore(initial = {}) {
  const urlWriter = throttledURLWriter();
  const state = defaults();
  for (const [k, v] of Object.entries(initial)) state[k] = coerce(k, v);
  const listeners = new Set();
  let constrain = (s) => s; // set by the page once the model is known (ranges of layer, head …)

  return {
    /** A read-only snapshot; change it with set(). */
    get state() {
      return state;
    },
    get(key) {
      return state[key];
    },
    /** Apply a patch; returns the set of keys whose value changed. */
    set(patch) {
      const next = { ...state };
      for (const [k, v] of Object.entries(patch)) next[k] = coerce(k, v);
      const fixed = constrain(next);
      const changed = new Set();
      for (const { key } of STATE_KEYS) {
        if (!equal(state[key], fixed[key])) {
          state[key] = fixed[key];
          changed.add(key);
        }
      }
      if (!changed.size) return changed;
      if ([...changed].some((k) => URL_KEY_SET.has(k))) urlWriter.write(state);
      for (const fn of listeners) fn(changed, state);
      return changed;
    },
    subscribe(fn) {
      listeners.add(fn);
      return () => listeners.delete(fn);
    },
    /** Install the rule that keeps values in range (e.g. layer < n_layers) and apply it. */
    setConstraint(fn) {
      constrain = fn;
      this.set({});
    },
  };
}
