// attnlens page: wires the prompt and generation panel, the attention views, the URL state,
// themes and error messages together. Each view lives in views/*.js.

import { ApiError, getModel, postRaw, fetchAttention } from "./api.js";
import { readSSE } from "./sse.js";
import { AttentionSet } from "./attention.js";
import { drawLegend } from "./heatmap.js";
import { lut } from "./colormap.js";
import { readURL, writeURL } from "./state/url.js";
import { showTooltip, hideTooltip } from "./tooltip.js";
import { escapeHTML, visible } from "./tokens.js";
import { HeadView } from "./views/headview.js";
import { ModelView } from "./views/modelview.js";
import { AggregateView } from "./views/aggregateview.js";
import { DiffView } from "./views/diffview.js";
import { LineView } from "./views/lineview.js";
import { GenView } from "./views/genview.js";

const $ = (sel) => document.querySelector(sel);
const VIEWS = { head: HeadView, model: ModelView, aggregate: AggregateView, diff: DiffView, lines: LineView, gen: GenView };
const DEFAULTS = {
  view: "head",
  layer: 0,
  head: 0,
  sink: false,
  cmap: "viridis",
  dcmap: "RdBu",
  scale: "p99",
  op: "mean",
  diff: "heads",
  layerB: 0,
  headB: 1,
  step: 0,
};

// Exposed for tests and for poking around in the console.
window.__attnlens = { perf: {}, renders: 0, errors: [] };

// ---------------------------------------------------------------------------------------
// App state
// ---------------------------------------------------------------------------------------
const app = {
  meta: null,
  att: null, // AttentionSet of the analysed text
  gen: null, // {promptTokens, tokens, attention, text}
  view: null,
  seq: 0,
  state: { ...DEFAULTS, pinned: new Set(), layers: [], heads: [], prompt: "", text: "", promptB: "" },

  async setState(patch, { quiet = false, render = true } = {}) {
    Object.assign(this.state, patch);
    syncControls();
    saveURL();
    if (!quiet && render) await renderView();
  },

  selectHead(layer, head, { view = null, quiet = false } = {}) {
    const patch = { layer, head };
    if (view) patch.view = view;
    if (view && view !== this.state.view) {
      Object.assign(this.state, patch);
      return switchView(view);
    }
    return this.setState(patch, { quiet });
  },

  setPinned(rows) {
    this.state.pinned = new Set(rows);
    if (this.view?.onPinnedChange) this.view.onPinnedChange();
  },

  setLegend(spec) {
    const wrap = $("#legend-wrap");
    if (!spec) {
      wrap.hidden = true;
      return;
    }
    wrap.hidden = false;
    drawLegend($("#legend"), spec);
    $("#legend-label").textContent = spec.label || "";
  },

  setCaption(html) {
    $("#caption").innerHTML = html;
  },

  /** Show the spinner while a promise runs. */
  async track(promise) {
    busy(+1);
    try {
      return await promise;
    } finally {
      busy(-1);
    }
  },

  showError(err, context) {
    showError(err, context);
  },

  markGeneratedStep(step) {
    document.querySelectorAll("#output .tok.gen.current").forEach((el) => el.classList.remove("current"));
    const el = document.querySelector(`#output .tok.gen[data-step="${step}"]`);
    if (el) {
      el.classList.add("current");
      el.scrollIntoView({ block: "nearest" });
    }
  },
};
window.__attnlens.app = app;

let busyCount = 0;
function busy(d) {
  busyCount = Math.max(0, busyCount + d);
  $("#spinner").hidden = busyCount === 0;
  document.documentElement.toggleAttribute("data-busy", busyCount > 0);
}

// ---------------------------------------------------------------------------------------
// Messages
// ---------------------------------------------------------------------------------------
const FIELD_INPUTS = ["prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "logprobs"];

function clearFieldErrors() {
  for (const f of FIELD_INPUTS) $("#" + f)?.removeAttribute("aria-invalid");
}

function showError(err, context = "", { warn = false } = {}) {
  if (err?.detail === "aborted") return;
  const msg = err instanceof ApiError ? err.message : err?.message || String(err);
  window.__attnlens.errors.push(`${context}: ${msg}`);
  const box = document.createElement("div");
  box.className = "message" + (warn ? " warn" : "");
  box.innerHTML = `<span class="icon" aria-hidden="true">${warn ? "!" : "✕"}</span><div class="body"><span class="title"></span><span class="text"></span></div><button type="button" class="close" aria-label="Dismiss">×</button>`;
  box.querySelector(".title").textContent = context ? `${context} failed` : "Error";
  box.querySelector(".text").textContent = msg;
  box.querySelector(".close").addEventListener("click", () => box.remove());
  const host = $("#messages");
  while (host.children.length >= 3) host.firstElementChild.remove();
  host.append(box);
  if (err instanceof ApiError) {
    for (const f of err.fields || []) {
      const el = $("#" + f);
      if (el) el.setAttribute("aria-invalid", "true");
    }
    // the server names max_new_tokens for "prompt + max_new_tokens > context"
    if (err.status === 400 && /max_new_tokens/.test(msg)) $("#max_new_tokens")?.setAttribute("aria-invalid", "true");
  }
}

function clearMessages() {
  $("#messages").replaceChildren();
  clearFieldErrors();
}

// ---------------------------------------------------------------------------------------
// Model info and controls
// ---------------------------------------------------------------------------------------
function normaliseMeta(m) {
  const arch = (m && typeof m.architecture === "object" && m.architecture) || m.config || {};
  return {
    ...m,
    n_layers: m.n_layers ?? arch.n_layers,
    n_heads: m.n_heads ?? arch.n_heads,
    d_model: m.d_model ?? arch.d_model,
    context_length: m.context_length ?? arch.context_length,
    vocab_size: m.vocab_size ?? arch.vocab_size,
    max_new_tokens: m.limits?.max_new_tokens ?? m.max_new_tokens ?? 512,
  };
}

function showModelInfo(meta) {
  const el = $("#model-info");
  el.classList.remove("down");
  const params = meta.parameters ? `${(meta.parameters / 1e6).toFixed(meta.parameters < 1e6 ? 3 : 1)} M params` : "";
  const pills = [
    ["model", meta.name],
    ["layers", meta.n_layers],
    ["heads", meta.n_heads],
    ["d_model", meta.d_model],
    ["context", meta.context_length],
    ["vocab", meta.vocab_size],
  ]
    .filter(([, v]) => v != null)
    .map(([k, v]) => `<span class="pill${k === "d_model" || k === "vocab" ? " minor" : ""}">${k} <b>${escapeHTML(v)}</b></span>`);
  if (params) pills.push(`<span class="pill minor">${params}</span>`);
  if (meta.device) pills.push(`<span class="pill minor">${escapeHTML(meta.device)}</span>`);
  el.innerHTML = pills.join("");
}

function fillSelect(sel, n, prefix) {
  const cur = sel.value;
  sel.replaceChildren(...Array.from({ length: n }, (_, i) => new Option(`${prefix}${i}`, String(i))));
  if (cur && +cur < n) sel.value = cur;
}

function toggleSet(host, n, prefix, key) {
  host.replaceChildren();
  for (let i = 0; i < n; i++) {
    const label = document.createElement("label");
    label.innerHTML = `<input type="checkbox" value="${i}" aria-label="${key === "layers" ? "layer" : "head"} ${i}"><span>${prefix}${i}</span>`;
    label.querySelector("input").addEventListener("change", () => {
      const values = [...host.querySelectorAll("input:checked")].map((x) => +x.value);
      app.setState({ [key]: values });
    });
    host.append(label);
  }
  const all = document.createElement("button");
  all.type = "button";
  all.className = "btn small ghost";
  all.textContent = "all";
  all.addEventListener("click", () => app.setState({ [key]: [...Array(n).keys()] }));
  host.append(all);
}

function buildControls() {
  const { n_layers: L, n_heads: H } = app.meta;
  fillSelect($("#layer"), L, "L");
  fillSelect($("#head"), H, "H");
  fillSelect($("#layerB"), L, "L");
  fillSelect($("#headB"), H, "H");
  toggleSet($("#agg-layers"), L, "L", "layers");
  toggleSet($("#agg-heads"), H, "H", "heads");
  const s = app.state;
  s.layer = Math.min(s.layer, L - 1);
  s.head = Math.min(s.head, H - 1);
  s.layerB = Math.min(s.layerB, L - 1);
  s.headB = Math.min(s.headB, H - 1);
  if (!s.layers.length) s.layers = [...Array(L).keys()];
  if (!s.heads.length) s.heads = [...Array(H).keys()];
  const maxNew = Math.max(1, Math.min(app.meta.max_new_tokens, (app.meta.context_length || 1024) - 1));
  $("#max_new_tokens").max = String(maxNew);
  if (+$("#max_new_tokens").value > maxNew) $("#max_new_tokens").value = String(Math.max(1, Math.floor(maxNew / 2)));
  syncControls();
}

/** Make every control show the state. */
function syncControls() {
  const s = app.state;
  const setVal = (sel, v) => {
    const el = $(sel);
    if (el && v != null && el.value !== String(v)) el.value = String(v);
  };
  setVal("#layer", s.layer);
  setVal("#head", s.head);
  setVal("#layerB", s.layerB);
  setVal("#headB", s.headB);
  setVal("#cmap", s.cmap);
  setVal("#dcmap", s.dcmap);
  setVal("#scale", s.scale);
  setVal("#op", s.op);
  $("#sink").checked = !!s.sink;
  for (const input of $("#agg-layers").querySelectorAll("input")) input.checked = s.layers.includes(+input.value);
  for (const input of $("#agg-heads").querySelectorAll("input")) input.checked = s.heads.includes(+input.value);
  for (const r of document.querySelectorAll('input[name="diff"]')) r.checked = r.value === s.diff;
  const dg = document.querySelector('.opt-group[data-view="diff"]');
  dg.dataset.mode = s.diff;
  $("#diff-a-layer").textContent = s.layer;
  $("#diff-a-head").textContent = s.head;
  if (document.activeElement !== $("#promptB")) $("#promptB").value = s.promptB || "";
  for (const tab of document.querySelectorAll('[role="tab"]')) {
    const on = tab.dataset.view === s.view;
    tab.setAttribute("aria-selected", on ? "true" : "false");
    tab.tabIndex = on ? 0 : -1;
  }
  for (const g of document.querySelectorAll(".opt-group")) g.classList.toggle("active", g.dataset.view === s.view);
  for (const ctl of document.querySelectorAll(".toolbar [data-for]")) ctl.hidden = !ctl.dataset.for.split(" ").includes(s.view);
  $("#cmap").closest(".ctl").hidden = s.view === "diff" || s.view === "lines";
  $("#scale").closest(".ctl").hidden = s.view === "lines";
  app.view?.markSelected?.();
}

function saveURL() {
  const s = app.state;
  const defaults = { ...DEFAULTS, prompt: "", text: s.prompt };
  if (app.meta) {
    defaults.layers = [...Array(app.meta.n_layers).keys()];
    defaults.heads = [...Array(app.meta.n_heads).keys()];
  }
  writeURL({ ...s, prompt: s.prompt, text: s.text !== s.prompt ? s.text : "" }, defaults);
}

// ---------------------------------------------------------------------------------------
// Views
// ---------------------------------------------------------------------------------------
async function switchView(name) {
  if (!VIEWS[name]) name = "head";
  app.view?.unmount();
  app.view = null;
  app.state.view = name;
  syncControls();
  saveURL();
  await renderView();
}

async function renderView() {
  const seq = ++app.seq;
  const host = $("#view-host");
  const needsText = app.state.view !== "gen";
  $("#view-empty").hidden = !needsText || !!app.att;
  if (needsText && !app.att) {
    app.view?.unmount();
    app.view = null;
    app.setLegend(null);
    app.setCaption("");
    return;
  }
  if (!app.view || !(app.view instanceof VIEWS[app.state.view])) {
    app.view?.unmount();
    app.view = new VIEWS[app.state.view](app);
    app.view.mount(host);
  }
  const view = app.view;
  busy(+1);
  try {
    await view.render(seq);
    if (seq === app.seq) {
      window.__attnlens.renders++;
      host.dataset.rendered = `${app.state.view}:${app.state.layer}:${app.state.head}:${app.att?.T ?? 0}:${window.__attnlens.renders}`;
    }
  } catch (err) {
    if (seq === app.seq) showError(err, "Loading attention");
  } finally {
    busy(-1);
  }
}

/**
 * Analyse a new text: fetch its attention (lazily, per view) and redraw. With `ids` (the token
 * ids of prompt + generation) the server analyses exactly those tokens and `text` is the label.
 */
async function analyse(text, { ids = null } = {}) {
  if (!app.meta) {
    showError(new ApiError("the model description (/model) is not loaded — is the server running?"), "Analysis");
    return;
  }
  if (!text) {
    showError(new ApiError("Type a prompt first."), "Analysis", { warn: true });
    return;
  }
  const set = new AttentionSet(text, app.meta, { ids });
  // Get the tokens (and the layer on screen) before swapping in, so errors leave the old view.
  try {
    await app.track(set.ensure([Math.min(app.state.layer, app.meta.n_layers - 1)]));
  } catch (err) {
    showError(err, "Attention");
    if (!ids && err instanceof ApiError && /text/.test(err.message)) $("#prompt").setAttribute("aria-invalid", "true");
    return;
  }
  app.att = set;
  app.state.text = text;
  app.state.pinned = new Set();
  const T = set.T;
  $("#analysed").textContent = `${T} tokens analysed${set.lastFormat && set.lastFormat !== "json" ? ` · ${set.lastFormat}` : ""}`;
  $("#analysed").title = text;
  if (text === $("#prompt").value && app.meta.context_length) {
    const room = app.meta.context_length - T;
    $("#prompt-hint").textContent = `${T} tokens · ${Math.max(0, room)} free in the context`;
  }
  saveURL();
  await renderView();
}

// ---------------------------------------------------------------------------------------
// Generation
// ---------------------------------------------------------------------------------------
let controller = null;

function parseStops(raw) {
  raw = raw.trim();
  if (!raw) return [];
  if (raw.startsWith("[")) {
    try {
      const v = JSON.parse(raw);
      if (Array.isArray(v)) return v.map(String);
    } catch {
      /* fall through */
    }
  }
  return raw
    .split(",")
    .map((s) => s.trim().replace(/\\n/g, "\n").replace(/\\t/g, "\t"))
    .filter((s) => s.length);
}

function numberField(id) {
  const el = $("#" + id);
  if (el.validity?.badInput) return NaN;
  const v = el.value.trim();
  if (v === "") return undefined;
  return Number(v);
}

function readParams() {
  const body = { prompt: $("#prompt").value };
  for (const f of ["max_new_tokens", "temperature", "top_k", "top_p", "seed", "logprobs"]) {
    const v = numberField(f);
    if (v === undefined) continue;
    body[f] = Number.isNaN(v) ? $("#" + f).value : v;
  }
  if (body.top_k === undefined) body.top_k = null;
  if (body.seed === undefined) body.seed = null;
  body.stop = parseStops($("#stop").value);
  body.return_attention = $("#return_attention").checked;
  body.stream = true;
  return body;
}

function tokenChip(t, step) {
  const el = document.createElement("span");
  el.className = "tok gen fresh";
  el.tabIndex = 0;
  el.dataset.step = step;
  const p = Math.exp(t.logprob ?? 0);
  const table = lut("viridis");
  const i = Math.max(0, Math.min(255, Math.round(p * 255))) * 3;
  el.style.setProperty("--chip-rgb", `${table[i]}, ${table[i + 1]}, ${table[i + 2]}`);
  const text = t.text ?? t.delta ?? "";
  // newlines stay line breaks but get a visible ↵ marker
  const parts = text.split("\n");
  parts.forEach((part, k) => {
    if (k > 0) {
      const ws = document.createElement("span");
      ws.className = "ws";
      ws.textContent = "↵";
      el.append(ws, "\n");
    }
    if (part) el.append(part);
  });
  if (!text) el.textContent = "∅";
  el.setAttribute("aria-label", `${visible(text)}: probability ${(p * 100).toFixed(1)}%`);
  return el;
}

function chipTooltipHTML(t) {
  if (t.logprob == null) return `<div class="tt-cell"><span class="tt-tok">${escapeHTML(visible(t.text))}</span></div><div class="tt-muted">no probability reported</div>`;
  const p = Math.exp(t.logprob);
  let rows = "";
  const alts = t.top_logprobs || [];
  const maxP = Math.max(p, ...alts.map((a) => Math.exp(a.logprob)));
  for (const a of alts) {
    const ap = Math.exp(a.logprob);
    const chosen = a.id === t.id;
    rows += `<span class="tt-tok ${chosen ? "chosen" : ""}">${escapeHTML(visible(a.text))}</span><span class="bar" style="width:${Math.max(1, (ap / maxP) * 100)}%"></span><span class="num ${chosen ? "chosen" : ""}">${(ap * 100).toFixed(1)}%</span>`;
  }
  return (
    `<div class="tt-cell"><span class="tt-tok">${escapeHTML(visible(t.text))}</span> p = <b>${(p * 100).toFixed(2)}%</b> <span class="tt-muted">logprob ${t.logprob.toFixed(3)}</span></div>` +
    (rows ? `<div class="tt-muted" style="margin-top:4px">top alternatives</div><div class="tt-alts">${rows}</div>` : "") +
    `<div class="tt-muted" style="margin-top:4px">click: what it attended to</div>`
  );
}

function bindChip(el, t, step) {
  const show = () => {
    const r = el.getBoundingClientRect();
    showTooltip(chipTooltipHTML(t), r.left, r.bottom);
  };
  el.addEventListener("mouseenter", show);
  el.addEventListener("focus", show);
  el.addEventListener("mouseleave", hideTooltip);
  el.addEventListener("blur", hideTooltip);
  const open = () => {
    app.state.step = step;
    if (app.state.view !== "gen") switchView("gen");
    else app.view?.draw?.();
  };
  el.addEventListener("click", open);
  el.addEventListener("keydown", (e) => {
    if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      open();
    }
  });
}

function setGenerating(on) {
  $("#generate").disabled = on;
  $("#stop-btn").disabled = !on;
  const st = $("#gen-status");
  st.classList.toggle("running", on);
}

async function generate() {
  if (controller) return;
  clearMessages();
  const body = readParams();
  const out = $("#output");
  out.replaceChildren();
  const promptSpan = document.createElement("span");
  promptSpan.className = "tok prompt";
  promptSpan.textContent = body.prompt;
  out.append(promptSpan);
  $("#gen-stats").replaceChildren();
  const st = $("#gen-status");
  st.textContent = "waiting…";
  setGenerating(true);
  controller = new AbortController();
  const tokens = [];
  const attention = [];
  let done = null;
  let streamError = null;
  let stopped = false;
  const addToken = (t) => {
    const step = tokens.length;
    tokens.push(t);
    if (t.attention) attention.push(t.attention);
    const chip = tokenChip(t, step);
    bindChip(chip, t, step);
    out.append(chip);
    if (out.scrollHeight - out.scrollTop - out.clientHeight < 80) out.scrollTop = out.scrollHeight;
    st.textContent = `${tokens.length} token${tokens.length === 1 ? "" : "s"}…`;
  };
  try {
    const res = await postRaw("/generate", body, { signal: controller.signal });
    const type = res.headers.get("content-type") || "";
    if (type.includes("text/event-stream")) {
      await readSSE(res, ({ event, data }) => {
        if (event === "token") addToken(data);
        else if (event === "done") done = data;
        else if (event === "error") streamError = new ApiError(data?.message || String(data), { status: 500 });
      });
    } else {
      const j = await res.json();
      (j.tokens || []).forEach((t, i) => addToken({ ...t, attention: j.attention?.[i] }));
      done = j;
    }
  } catch (err) {
    if (err?.detail === "aborted" || err?.name === "AbortError") stopped = true;
    else {
      st.textContent = "failed";
      showError(err, "Generation");
      setGenerating(false);
      controller = null;
      out.dataset.done = "error";
      if (!tokens.length) {
        out.replaceChildren(Object.assign(document.createElement("p"), { className: "empty-note", textContent: "Nothing generated — see the message above." }));
        return;
      }
    }
  }
  setGenerating(false);
  controller = null;
  if (streamError) showError(streamError, "Generation");
  const text = done?.text ?? tokens.map((t) => t.delta ?? t.text).join("");
  if (done) {
    const u = done.usage || {};
    const tm = done.timings || {};
    st.textContent = `finished: ${done.finish_reason}`;
    $("#gen-stats").innerHTML = [
      `<span><b>${u.completion_tokens ?? tokens.length}</b> tokens</span>`,
      u.prompt_tokens != null ? `<span>prompt <b>${u.prompt_tokens}</b></span>` : "",
      tm.tokens_per_second != null ? `<span><b>${Number(tm.tokens_per_second).toFixed(1)}</b> tok/s</span>` : "",
      tm.prefill_ms != null ? `<span>prefill <b>${Number(tm.prefill_ms).toFixed(0)}</b> ms</span>` : "",
      tm.queue_ms != null ? `<span>queue <b>${Number(tm.queue_ms).toFixed(0)}</b> ms</span>` : "",
    ].join("");
  } else if (stopped) {
    st.textContent = `stopped after ${tokens.length} token${tokens.length === 1 ? "" : "s"}`;
  }
  out.dataset.done = "1";
  if (!tokens.length) return;
  // The prompt's tokens come with the answer (the stream's `done` event, or the JSON answer).
  // Only a generation stopped before its end has none: then ask /attention for them (1 head).
  let promptTokens = done?.prompt_tokens;
  if (!promptTokens) {
    try {
      promptTokens = (await fetchAttention(body.prompt, { layers: [0], heads: [0], format: "u8" })).tokens;
    } catch {
      promptTokens = null;
    }
  }
  app.gen = {
    promptTokens: promptTokens || [],
    tokens,
    attention: attention.length === tokens.length ? attention : null,
    text,
  };
  app.state.step = Math.min(app.state.step, tokens.length - 1);
  app.state.prompt = body.prompt;
  // Analyse the very tokens the model saw (prompt + generated ids), not a re-tokenised text:
  // a generation can end in part of a UTF-8 character, whose text (U+FFFD) encodes differently.
  const ids = promptTokens ? promptTokens.map((t) => t.id).concat(tokens.map((t) => t.id)) : null;
  await analyse(body.prompt + text, { ids });
}

function stop() {
  controller?.abort();
}

// ---------------------------------------------------------------------------------------
// Export, theme, wiring
// ---------------------------------------------------------------------------------------
function download(blob, name) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 2000);
}

function exportName(ext) {
  const s = app.state;
  const part = { head: `L${s.layer}H${s.head}`, lines: `lines-L${s.layer}H${s.head}`, model: "all-heads", aggregate: s.op, diff: "difference", gen: `gen-step${s.step}` }[s.view];
  return `attnlens-${part}${s.sink ? "-nosink" : ""}.${ext}`;
}

function exportPNG() {
  const c = app.view?.exportCanvas?.();
  if (!c) return showError(new Error("nothing to export yet"), "Export", { warn: true });
  c.toBlob((b) => download(b, exportName("png")), "image/png");
}

function exportJSON() {
  const data = app.view?.exportData?.();
  if (!data) return showError(new Error("nothing to export yet"), "Export", { warn: true });
  const s = app.state;
  const doc = {
    model: app.meta?.name,
    text: s.text,
    view: s.view,
    layer: s.layer,
    head: s.head,
    first_token_sink_hidden: s.sink,
    url: window.location.href,
    ...data,
  };
  download(new Blob([JSON.stringify(doc, null, 1)], { type: "application/json" }), exportName("json"));
}

const THEMES = ["auto", "light", "dark"];
function applyTheme(t) {
  if (t === "light" || t === "dark") document.documentElement.dataset.theme = t;
  else delete document.documentElement.dataset.theme;
  try {
    if (t === "auto") localStorage.removeItem("attnlens-theme");
    else localStorage.setItem("attnlens-theme", t);
  } catch {
    /* private mode */
  }
  const btn = $("#theme-toggle");
  btn.querySelector(".theme-name").textContent = t[0].toUpperCase() + t.slice(1);
  btn.setAttribute("aria-label", `Colour theme: ${t === "auto" ? "follow the system" : t} (click to change)`);
  if (app.att || app.gen) renderView();
}

function currentTheme() {
  return document.documentElement.dataset.theme || "auto";
}

function wire() {
  $("#generate-form").addEventListener("submit", (e) => {
    e.preventDefault();
    generate();
  });
  $("#stop-btn").addEventListener("click", stop);
  $("#analyse").addEventListener("click", () => {
    clearMessages();
    app.state.prompt = $("#prompt").value;
    analyse($("#prompt").value);
  });
  $("#prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      generate();
    }
  });
  $("#prompt").addEventListener("input", () => {
    $("#prompt").removeAttribute("aria-invalid");
    $("#prompt-hint").textContent = "Ctrl+Enter generates";
  });
  for (const f of FIELD_INPUTS) $("#" + f)?.addEventListener("input", () => $("#" + f).removeAttribute("aria-invalid"));

  for (const tab of document.querySelectorAll('[role="tab"]')) {
    tab.addEventListener("click", () => switchView(tab.dataset.view));
    tab.addEventListener("keydown", (e) => {
      const tabs = [...document.querySelectorAll('[role="tab"]')];
      const i = tabs.indexOf(tab);
      let j = null;
      if (e.key === "ArrowRight") j = (i + 1) % tabs.length;
      else if (e.key === "ArrowLeft") j = (i - 1 + tabs.length) % tabs.length;
      else if (e.key === "Home") j = 0;
      else if (e.key === "End") j = tabs.length - 1;
      if (j == null) return;
      e.preventDefault();
      tabs[j].focus();
      switchView(tabs[j].dataset.view);
    });
  }
  $("#layer").addEventListener("change", (e) => app.setState({ layer: +e.target.value }));
  $("#head").addEventListener("change", (e) => app.setState({ head: +e.target.value }));
  $("#layerB").addEventListener("change", (e) => app.setState({ layerB: +e.target.value }));
  $("#headB").addEventListener("change", (e) => app.setState({ headB: +e.target.value }));
  $("#sink").addEventListener("change", (e) => app.setState({ sink: e.target.checked }));
  $("#cmap").addEventListener("change", (e) => app.setState({ cmap: e.target.value }));
  $("#dcmap").addEventListener("change", (e) => app.setState({ dcmap: e.target.value }));
  $("#scale").addEventListener("change", (e) => app.setState({ scale: e.target.value }));
  $("#op").addEventListener("change", (e) => app.setState({ op: e.target.value }));
  for (const r of document.querySelectorAll('input[name="diff"]')) r.addEventListener("change", () => app.setState({ diff: r.value }));
  $("#compare").addEventListener("click", () => app.setState({ promptB: $("#promptB").value, diff: "prompts" }));
  $("#promptB").addEventListener("keydown", (e) => {
    if (e.key === "Enter") app.setState({ promptB: $("#promptB").value });
  });
  $("#export-png").addEventListener("click", exportPNG);
  $("#export-json").addEventListener("click", exportJSON);
  $("#copy-link").addEventListener("click", async () => {
    saveURL();
    try {
      await navigator.clipboard.writeText(window.location.href);
      const b = $("#copy-link");
      const label = b.querySelector("span");
      label.textContent = "Copied ✓";
      setTimeout(() => (label.textContent = "Copy link"), 1500);
    } catch {
      showError(new Error(window.location.href), "Copying (copy the link by hand)", { warn: true });
    }
  });
  $("#theme-toggle").addEventListener("click", () => applyTheme(THEMES[(THEMES.indexOf(currentTheme()) + 1) % THEMES.length]));
  window.matchMedia?.("(prefers-color-scheme: dark)").addEventListener?.("change", () => currentTheme() === "auto" && renderView());
  let resizeTimer = null;
  let lastWidth = window.innerWidth;
  window.addEventListener("resize", () => {
    if (window.innerWidth === lastWidth) return;
    lastWidth = window.innerWidth;
    clearTimeout(resizeTimer);
    resizeTimer = setTimeout(() => renderView(), 150);
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && controller) stop();
  });
}

async function init() {
  wire();
  applyTheme(currentTheme());
  const url = readURL();
  Object.assign(app.state, DEFAULTS, url, { pinned: new Set() });
  if (url.prompt != null) $("#prompt").value = url.prompt;
  app.state.prompt = $("#prompt").value;
  $("#prompt-hint").textContent = "Ctrl+Enter generates";
  syncControls();
  try {
    app.meta = normaliseMeta(await getModel());
  } catch (err) {
    $("#model-info").textContent = "server unreachable";
    $("#model-info").classList.add("down");
    showError(err, "Loading the model description");
    return;
  }
  showModelInfo(app.meta);
  buildControls();
  await analyse(url.text || app.state.prompt);
}

init();
