// The display controls: view tabs (from the view registry), the toolbar, and the views'
// option panels. Every input with data-key="<state key>" is bound to that key of the store
// both ways, so a new option is a schema key plus an input in index.html.

import { VIEWS, viewById } from "./views/registry.js";
import { parseAblation, describeHead } from "./explain/ablation.js";

const $ = (sel) => document.querySelector(sel);
const $$ = (sel) => [...document.querySelectorAll(sel)];

function buildTabs(store) {
  const host = $("#tabs");
  const tabs = VIEWS.map((v) => {
    const b = document.createElement("button");
    b.type = "button";
    b.setAttribute("role", "tab");
    b.id = `tab-${v.id}`;
    b.dataset.view = v.id;
    b.setAttribute("aria-controls", "view-host");
    b.textContent = v.label;
    if (v.title) b.title = v.title;
    b.addEventListener("click", () => store.set({ view: v.id }));
    b.addEventListener("keydown", (e) => {
      const shown = tabs.filter((t) => !t.hidden); // a family's own tabs hide for other models
      const i = shown.indexOf(b);
      const n = shown.length;
      const j = { ArrowRight: (i + 1) % n, ArrowLeft: (i - 1 + n) % n, Home: 0, End: n - 1 }[e.key];
      if (j == null) return;
      e.preventDefault();
      shown[j].focus();
      store.set({ view: shown[j].dataset.view });
    });
    return b;
  });
  host.prepend(...tabs);
}

function readInput(el) {
  if (el.type === "checkbox") return el.checked;
  return el.value;
}

/** Bind every [data-key] input to the store (radio groups: the checked one's value). */
function bindInputs(store) {
  for (const el of $$("[data-key]")) {
    el.addEventListener("change", () => {
      if (el.type === "radio" && !el.checked) return;
      store.set({ [el.dataset.key]: readInput(el) });
    });
  }
}

function toggleSet(host, n, prefix, key, store) {
  host.replaceChildren();
  const all = () => [...Array(n).keys()];
  for (let i = 0; i < n; i++) {
    const label = document.createElement("label");
    label.innerHTML = `<input type="checkbox" value="${i}" aria-label="${key === "layers" ? "layer" : "head"} ${i}"><span>${prefix}${i}</span>`;
    label.querySelector("input").addEventListener("change", () => {
      const values = [...host.querySelectorAll("input:checked")].map((x) => +x.value);
      store.set({ [key]: values.length === n ? null : values });
    });
    host.append(label);
  }
  const btn = document.createElement("button");
  btn.type = "button";
  btn.className = "btn small ghost";
  btn.textContent = "all";
  btn.addEventListener("click", () => store.set({ [key]: null }));
  host.append(btn);
  return all;
}

function fillSelect(sel, n, prefix) {
  sel.replaceChildren(...Array.from({ length: n }, (_, i) => new Option(`${prefix}${i}`, String(i))));
}

export function buildControls(store) {
  buildTabs(store);
  bindInputs(store);
  $("#compare").addEventListener("click", () => store.set({ promptB: $("#promptB").value, diff: "prompts" }));
  $("#promptB").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) store.set({ promptB: $("#promptB").value, diff: "prompts" });
  });
  $("#zoom-in").addEventListener("click", () => store.set({ zoom: store.get("zoom") * 1.25 }));
  $("#zoom-out").addEventListener("click", () => store.set({ zoom: store.get("zoom") * 0.8 }));
  $("#zoom-fit").addEventListener("click", () => store.set({ zoom: 1 }));
}

/** Fill the controls whose options depend on the model (layer and head counts). */
export function modelControls(store, meta) {
  for (const id of ["layer", "layerB"]) fillSelect($("#" + id), meta.n_layers, "L");
  for (const id of ["head", "headB"]) fillSelect($("#" + id), meta.n_heads, "H");
  toggleSet($("#agg-layers"), meta.n_layers, "L", "layers", store);
  toggleSet($("#agg-heads"), meta.n_heads, "H", "heads", store);
  // the value itself is kept in range by the store's constraint (views/params.js)
  $("#max_new_tokens").max = String(Math.max(1, Math.min(meta.max_new_tokens, meta.context_length - 1)));
  // what an empty sampling box means, and shows: the model's recommended value, else /generate's default
  for (const [key, value] of Object.entries(samplingDefaults(meta))) $("#" + key).dataset.fallback = value;
}

// /generate's own defaults, for a field the model recommends nothing for ("" = top-k off)
const GENERATE_DEFAULTS = { temperature: "0.8", top_k: "", top_p: "1" };

/** The sampling form's values when left empty: GET /models `sampling_defaults`, else /generate's own. */
export function samplingDefaults(meta) {
  const given = meta.sampling_defaults ?? {};
  const out = {};
  for (const [key, def] of Object.entries(GENERATE_DEFAULTS)) {
    const v = given[key];
    out[key] = v == null || (key === "top_k" && v <= 0) ? def : String(v);
  }
  return out;
}

/** Make every control show the state. */
export function syncControls(s) {
  for (const el of $$("[data-key]")) {
    const v = s[el.dataset.key];
    if (el.type === "checkbox") el.checked = !!v;
    else if (el.type === "radio") el.checked = el.value === String(v);
    else if (document.activeElement !== el && v != null) {
      // "" stands for the default; a sampling box shows the value that stands for (data-fallback)
      const shown = v === "" && el.dataset.fallback ? el.dataset.fallback : el.dataset.default != null && v === el.dataset.default ? "" : String(v);
      if (el.value !== shown) el.value = shown;
    }
  }
  const ticked = (host, list) => {
    for (const input of host.querySelectorAll("input")) input.checked = list == null || list.includes(+input.value);
  };
  ticked($("#agg-layers"), s.layers);
  ticked($("#agg-heads"), s.heads);
  $(".opt-group[data-view='diff']").dataset.mode = s.diff;
  $("#diff-a-layer").textContent = s.layer;
  $("#diff-a-head").textContent = s.head;
  const ablated = parseAblation(s.ablate);
  $("#diff-ablation").textContent = ablated.length ? ablated.map(describeHead).join(", ") : "no heads";
  if (document.activeElement !== $("#promptB")) $("#promptB").value = s.promptB;
  $("#zoom-level").textContent = `${Math.round(s.zoom * 100)}%`;
  for (const tab of $$('[role="tab"]')) {
    const on = tab.dataset.view === s.view;
    tab.setAttribute("aria-selected", on ? "true" : "false");
    tab.tabIndex = on ? 0 : -1;
  }
  const view = viewById(s.view);
  for (const g of $$(".opt-group")) g.classList.toggle("active", g.dataset.view.split(" ").includes(s.view)); // a group may serve several views
  const caps = s.meta?.capabilities ?? new Set();
  for (const ctl of $$(".toolbar [data-ctl]")) {
    const fits = !ctl.dataset.needs || ctl.dataset.needs.split(" ").every((n) => caps.has(n)); // e.g. the classifier's pooled rows
    ctl.hidden = !view.controls.includes(ctl.dataset.ctl) || !fits;
  }
  $(".toolbar").classList.toggle("empty", !view.controls.length); // a view with controls of its own (the atlas, lens, ablate)
}
