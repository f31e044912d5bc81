// The model being explained: GET /models (every loaded model, for the picker) and /model (the
// chosen one's description), read into the few numbers the page uses, and the pills in the top
// bar. The choice is the store's `model` key ("" = the server's default); main.js calls
// loadModel again when it changes.

import { getModel, getModels } from "./api.js";
import { showError } from "./messages.js";
import { escapeHTML } from "./tokens.js";
import { VIEWS, viewFits } from "./views/registry.js";
import { capabilities } from "./family.js";

const $ = (sel) => document.querySelector(sel);

function showModelInfo(meta) {
  const el = $("#model-info");
  el.classList.remove("down");
  const pills = [
    ["layers", meta.n_layers],
    ["heads", meta.n_heads],
    ["d_model", meta.d_model],
    ["context", meta.context_length],
    ["vocab", meta.vocab_size],
  ].map(([k, v]) => `<span class="pill${k === "d_model" || k === "vocab" ? " minor" : ""}">${k} <b>${escapeHTML(v)}</b></span>`);
  pills.unshift(`<span class="pill">${escapeHTML(meta.family)}${meta.attention === "bidirectional" ? " · bidirectional" : ""}</span>`);
  if (meta.models < 2) pills.unshift(`<span class="pill">model <b>${escapeHTML(meta.name)}</b></span>`);
  if (meta.parameters) pills.push(`<span class="pill minor">${(meta.parameters / 1e6).toFixed(meta.parameters < 1e6 ? 3 : 1)} M params</span>`);
  if (meta.device) pills.push(`<span class="pill minor">${escapeHTML(meta.device)}</span>`);
  el.innerHTML = pills.join("");
}

/** Fill the <select data-key="model"> with the loaded models (hidden when there is only one). */
function fillPicker(list) {
  const select = $("select[data-key='model']");
  if (!select || select.options.length) return;
  select.dataset.default = list.default; // the default model's option stands for "" (whatever the server's default is)
  for (const m of list.models) {
    // short enough to show whole in the top bar; the labels a classifier has are in its title
    const option = new Option(`${m.name} · ${m.family}`, m.name === list.default ? "" : m.name);
    option.title = `${m.name}: ${m.family}${m.labels?.length ? ` (labels: ${m.labels.join(", ")})` : ""}`;
    select.append(option);
  }
  select.closest("[data-ctl='model']").hidden = list.models.length < 2;
}

let modelList; // undefined: not asked yet; null: the server has no /models
async function models() {
  if (modelList === undefined) {
    try {
      modelList = await getModels();
      fillPicker(modelList);
    } catch {
      modelList = null; // an older server: the one model /model describes
    }
  }
  return modelList;
}

/** The picked model's name if the server has it, else "" (its default): the store's constraint. */
export function validModel(name) {
  if (!name || modelList === null) return name; // no list to check against: the server will say
  if (modelList === undefined) return "";
  return modelList.models.some((m) => m.name === name) ? name : "";
}

/** The name of the model that state value `name` picks ("" = the server's default). */
export function resolveModel(name) {
  return validModel(name) || modelList?.default || name;
}

/** /models's summary of a model, shaped as /model's answer (device and limits: the server's). */
function fromSummary(m, raw) {
  const { name, family, n_layers, n_heads, d_model, context_length, vocab_size, parameters } = m;
  return { name, architecture: { family, n_layers, n_heads, d_model }, context_length, vocab_size, parameters, device: raw.device, limits: raw.limits };
}

/**
 * The description of model `name` ("" = the default) for the views: {name, family, attention
 * ("causal" | "bidirectional" | …), tasks, labels, pooling, n_layers, n_heads, …}, or null if
 * the server cannot be reached.
 */
export async function loadModel(name = "") {
  let raw;
  const list = await models();
  name = validModel(name); // an unknown name: the default model
  try {
    raw = await getModel(name);
  } catch (err) {
    $("#model-info").textContent = "server unreachable";
    $("#model-info").classList.add("down");
    showError(err, "Loading the model description");
    return null;
  }
  const summary = list?.models.find((m) => m.name === (name || list.default));
  // a server whose /model ignores ?model= describes its default: then /models says the rest
  const described = !summary || raw.name === summary.name ? raw : fromSummary(summary, raw);
  const a = described.architecture;
  const meta = {
    ...described,
    n_layers: a.n_layers,
    n_heads: a.n_heads,
    d_model: a.d_model,
    max_new_tokens: raw.limits.max_new_tokens,
    family: summary?.family ?? a.family ?? "decoder",
    attention: summary?.attention ?? "causal",
    tasks: summary?.tasks ?? ["generate", "attention"],
    labels: summary?.labels ?? null,
    pooling: summary?.pooling ?? null,
    head_figures: summary?.head_figures ?? {},
    classifier_layers: summary?.classifier_layers ?? 0,
    sampling_defaults: summary?.sampling_defaults ?? raw.sampling_defaults ?? null,
    family_info: summary?.family_info ?? null,
    models: list?.models.length ?? 1,
  };
  meta.capabilities = capabilities(meta.family_info, meta.tasks);
  meta.capabilities.add("server"); // the live page: the views that ask the server's analysis routes fit (registry `needs`)
  showModelInfo(meta);
  document.body.dataset.family = meta.family; // for display only; what the page does follows `capabilities`
  return meta;
}

/**
 * Fit the page to the model's family and tasks: the tabs of the views it has (registry
 * `needs`, against its capabilities), and what the sidebar offers ([data-task] elements: sampling and Generate only
 * for a model that generates; an encoder's text is analysed, not continued).
 */
export function fitPageToModel(meta) {
  for (const v of VIEWS) {
    const tab = document.getElementById(`tab-${v.id}`);
    if (tab) tab.hidden = !viewFits(v, meta);
  }
  const generates = meta.tasks.includes("generate");
  for (const el of document.querySelectorAll("[data-task]")) el.hidden = !meta.tasks.includes(el.dataset.task);
  $("label[for='prompt']").textContent = generates ? "Prompt" : "Text";
  $("#analyse").textContent = generates ? "Analyse prompt" : "Analyse";
  $("#analyse").classList.toggle("primary", !generates);
}
