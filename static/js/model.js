// The model being explained: /model, read into the few numbers the page uses, and the pills
// in the top bar. (A model picker would call loadModel again when the state's `model` changes.)

import { getModel } from "./api.js";
import { showError } from "./messages.js";
import { escapeHTML } from "./tokens.js";

const $ = (sel) => document.querySelector(sel);

function showModelInfo(meta) {
  const el = $("#model-info");
  el.classList.remove("down");
  const pills = [
    ["model", meta.name],
    ["layers", meta.n_layers],
    ["heads", meta.n_heads],
    ["d_model", meta.d_model],
    ["context", meta.context_length],
    ["vocab", meta.vocab_size],
  ].map(([k, v]) => `<span class="pill${k === "d_model" || k === "vocab" ? " minor" : ""}">${k} <b>${escapeHTML(v)}</b></span>`);
  pills.push(`<span class="pill minor">${(meta.parameters / 1e6).toFixed(meta.parameters < 1e6 ? 3 : 1)} M params</span>`);
  pills.push(`<span class="pill minor">${escapeHTML(meta.device)}</span>`);
  el.innerHTML = pills.join("");
}

/** The model's description for the views ({name, n_layers, n_heads, …}), or null if unreachable. */
export async function loadModel() {
  let raw;
  try {
    raw = await getModel();
  } catch (err) {
    $("#model-info").textContent = "server unreachable";
    $("#model-info").classList.add("down");
    showError(err, "Loading the model description");
    return null;
  }
  const a = raw.architecture;
  const meta = { ...raw, n_layers: a.n_layers, n_heads: a.n_heads, d_model: a.d_model, max_new_tokens: raw.limits.max_new_tokens };
  showModelInfo(meta);
  return meta;
}
