// attnlens page: creates the store, the controls and the output panel, and renders the chosen
// view from the store's state. Views read one params object (views/params.js); the URL is
// derived from the state (state/url.js); everything that changes the state calls store.set.

import { ApiError, fetchAttention, setApiKey, apiKey } from "./api.js";
import { ModelChoice } from "./modelchoice.js";
import { AttentionSet } from "./attention.js";
import { drawLegend } from "./paint.js";
import { createStore } from "./state/store.js";
import { readURL, writeURL } from "./state/url.js";
import { URL_KEYS } from "./state/schema.js";
import { VIEWS, viewById } from "./views/registry.js";
import { viewParams } from "./views/params.js";
import { buildControls, syncControls } from "./controls.js";
import { showError, clearMessages, wireFieldResets, setKeyHandler } from "./messages.js";
import { OutputPanel } from "./output.js";
import { GenerationRecord, readSamplingForm, streamGeneration } from "./generation.js";
import { wireExportButtons } from "./export.js";
import { wireTheme } from "./theme.js";
import { Panels } from "./panels.js";
import { exampleFor } from "./examples.js";
import { translationFor } from "./translator/translation.js";
import { asConversation, chatMode, EXAMPLE_CONVERSATION, parseConversation } from "./chat.js";

const $ = (sel) => document.querySelector(sel);

const store = createStore(readURL());
window.__attnlens = { perf: {}, renders: 0, errors: [], store, views: VIEWS, urlKeys: URL_KEYS.map((k) => k.key), current: () => current?.view ?? null, pendingTokens: () => 0 };

// keys whose change means a view must draw again, by what the view draws from
const SHOWN = ["view", "layer", "head", "pin", "sink", "cmap", "dcmap", "scale", "zoom", "op", "layers", "heads", "diff", "layerB", "headB", "promptB", "meta", "xavg"];
const RENDER_KEYS = { analysis: new Set([...SHOWN, "att"]), generation: new Set([...SHOWN, "gen", "step", "streaming"]) };

// ---------------------------------------------------------------------------------------
// The view on screen
// ---------------------------------------------------------------------------------------
let current = null; // {id, view}
let seq = 0;
let busyCount = 0;

function busy(d) {
  busyCount = Math.max(0, busyCount + d);
  $("#spinner").hidden = busyCount === 0;
  document.documentElement.toggleAttribute("data-busy", busyCount > 0);
}

async function track(promise) {
  busy(+1);
  try {
    return await promise;
  } finally {
    busy(-1);
  }
}

const ctx = {
  select: (patch) => store.set(patch),
  views: VIEWS, // the registry, for a view that opens another (the atlas opens a head where its group is drawn)
  setCaption: (html) => ($("#caption").innerHTML = html),
  setLegend(spec) {
    $("#legend-wrap").hidden = !spec;
    if (!spec) return;
    drawLegend($("#legend"), spec);
    $("#legend-label").textContent = spec.label || "";
  },
  track,
  showError,
  /** Make `text` the prompt and analyse it (a panel's action, e.g. masking a token). */
  analyse(text) {
    $("#prompt").value = text;
    store.set({ prompt: text });
    return analyse({ text });
  },
};
const panels = new Panels(ctx, { sidebar: $("#panels"), frame: $("#frame-panels") });
const models = new ModelChoice(store, panels);

function clearFrame() {
  current?.view.unmount();
  current = null;
  ctx.setLegend(null);
  ctx.setCaption("");
}

async function renderView(changed = null) {
  const s = store.state;
  const entry = viewById(s.view);
  const source = entry.source;
  $(".view-frame").classList.toggle("stale", s.streaming && source === "analysis");
  if (changed && current?.id === entry.id && ![...changed].some((k) => RENDER_KEYS[source].has(k) || entry.keys?.includes(k))) return;
  const mine = ++seq;
  const empty = !s.meta || (source === "analysis" && !s.att);
  $("#view-empty").hidden = !empty;
  if (empty) return clearFrame();
  if (current?.id !== entry.id) {
    clearFrame();
    current = { id: entry.id, view: new entry.View(ctx) };
    current.view.mount($("#view-host"));
    changed = null; // a new view draws everything
  }
  const view = current.view;
  busy(+1);
  try {
    await view.render(viewParams(s), changed, () => mine === seq && current?.view === view);
    if (mine === seq) {
      window.__attnlens.renders++;
      $("#view-host").dataset.rendered = `${s.view}:${s.layer}:${s.head}:${s.att?.T ?? 0}:${window.__attnlens.renders}`;
    }
  } catch (err) {
    if (mine === seq) showError(err, "Drawing the view");
  } finally {
    busy(-1);
  }
}

let pending = null;
function scheduleRender(changed) {
  if (pending) {
    for (const k of changed) pending.add(k);
    return;
  }
  pending = new Set(changed);
  queueMicrotask(() => {
    const c = pending;
    pending = null;
    renderView(c);
  });
}

// ---------------------------------------------------------------------------------------
// Analysis and generation
// ---------------------------------------------------------------------------------------
const translates = () => !!store.get("meta")?.capabilities?.has("target"); // its analysis has a target: a translator

/** What the analysis label says: tokens, and for an encoder-decoder the target its views read. */
function analysedLabel(set, note = "") {
  const fmt = set.long ? " · pooled and in windows" : set.lastFormat && set.lastFormat !== "json" ? ` · ${set.lastFormat}` : "";
  if (!translates()) return `${set.T} tokens analysed${note}${fmt}`;
  const target = set.targetIds ? `the generated translation (${set.targetIds.length} tokens)` : "the model's greedy translation";
  return `${set.T} source tokens → ${target}${note}${fmt}`;
}

/**
 * Fetch the attention of a text (or of exact token ids; an encoder-decoder's with the target
 * ids its decoder reads) and make it the analysed sequence. `orExample`: a text longer than
 * the model's context is replaced by the model's example (the page chose the model, the
 * user's text did not fit it), with a note saying so.
 */
async function analyse({ text, ids = null, targetIds = null, source = "prompt", keepPin = false, orExample = false }) {
  const meta = store.get("meta");
  if (!meta) return showError(new ApiError("the model description (/model) is not loaded — is the server running?"), "Analysis");
  if (!text && !ids) return showError(new ApiError("Type a prompt first."), "Analysis", { warn: true });
  let messages = null; // a chat model's conversation: the server renders it with the model's template
  try {
    if (!ids && chatMode(store.state)) messages = parseConversation(text);
  } catch (err) {
    return showError(err, "Analysis", { warn: true });
  }
  const set = new AttentionSet(text, meta, { ids, targetIds, messages });
  try {
    await track(set.begin(store.get("layer"))); // errors leave the old picture; a long input: its overview
  } catch (err) {
    if (orExample && err.code === "context_length_exceeded" && !ids && text !== exampleFor(meta)) {
      showError(new Error(`The text in the box is longer than ${meta.name} reads (${meta.context_length} tokens): here is its example instead.`), "Analysing your text", { warn: true });
      return useExample();
    }
    showError(err, "Attention");
    return null;
  }
  store.set(keepPin ? { att: set, source } : { att: set, source, pin: [], win: null });
  $("#analysed").textContent = analysedLabel(set);
  if (source === "prompt") $("#prompt-hint").textContent = `${set.T} tokens · ${Math.max(0, meta.context_length - set.T)} free in the context`;
  return set;
}

/** Put the model's example (a chat model's example conversation, in chat mode) in the box and analyse it. */
function useExample() {
  const text = chatMode(store.state) ? EXAMPLE_CONVERSATION : exampleFor(store.get("meta"));
  $("#prompt").value = text;
  store.set({ prompt: text });
  return analyse({ text });
}

let run = null; // the generation in flight: {controller}
const output = new OutputPanel((step) => store.set({ step, view: "gen" }));

function setRunning(on) {
  $("#generate").disabled = on;
  $("#stop-btn").disabled = !on;
}

/** Stop the generation in flight: nothing that arrives after this is drawn, and the server stops it. */
function stopGeneration() {
  run?.controller.abort();
}

/**
 * Calls `fn` once per frame however often `request()` is called in between (a stream's tokens
 * arrive many to a frame; drawing each would make the page fall behind the server).
 */
function perFrame(fn) {
  let raf = 0;
  let timer = 0;
  const fire = () => {
    cancelAnimationFrame(raf);
    clearTimeout(timer);
    raf = timer = 0;
    fn();
  };
  return {
    request() {
      if (raf || timer) return;
      raf = requestAnimationFrame(fire);
      timer = setTimeout(fire, 100); // frames pause in a hidden tab: the stream still lands
    },
    now: fire,
  };
}

async function generate() {
  if (run) return;
  clearMessages();
  const prompt = $("#prompt").value;
  const body = readSamplingForm(prompt);
  let messages = null; // in chat mode /generate gets the conversation, and its prompt_tokens are the template's
  if (chatMode(store.state)) {
    try {
      messages = parseConversation(prompt);
    } catch (err) {
      return showError(err, "Generation", { warn: true });
    }
    delete body.prompt;
    body.messages = messages;
  }
  const meta = store.get("meta");
  const translation = translates();
  output.start(prompt, { translation, model: meta?.name ?? "" });
  const controller = new AbortController();
  run = { controller };
  setRunning(true);
  store.set({ prompt, streaming: true, step: 0, gen: new GenerationRecord({ rows: body.return_attention ? [] : null }), ids: null, plen: 0, probs: null });
  const started = performance.now();
  let last = started;
  const tokens = [];
  const rows = [];
  let shown = 0; // tokens handed to the output and the store so far
  const ours = () => store.get("meta") === meta && store.get("gen"); // not replaced by another model's page
  const frame = perFrame(() => {
    if (shown === tokens.length || !ours()) return;
    output.addMany(tokens.slice(shown), shown);
    shown = tokens.length;
    const s = store.state;
    const follow = s.step >= s.gen.tokens.length - 1; // the view follows the newest token unless moved back
    store.set({ gen: s.gen.with({ tokens: tokens.slice(), rows: body.return_attention ? rows.slice() : null }), step: follow ? tokens.length - 1 : s.step });
  });
  window.__attnlens.pendingTokens = () => tokens.length - shown; // received, not drawn yet (for tests)
  const { done, stopped, error } = await streamGeneration(body, {
    signal: controller.signal,
    onToken(t) {
      if (controller.signal.aborted) return; // Stop was pressed: what arrives after it is not drawn
      last = performance.now();
      tokens.push(t);
      // an encoder-decoder's step reads its source: the Generation view shows that step's
      // cross-attention row over the prompt (= source) tokens
      if (t.attention) rows.push((t.cross_attention ?? t.attention).map((layer) => layer.map((row) => Float32Array.from(row))));
      delete t.attention; // kept once, compact: a long stream's rows are megabytes of numbers
      delete t.cross_attention;
      frame.request();
    },
  });
  run = null;
  setRunning(false);
  if (!ours()) return; // another model was chosen meanwhile: this output is gone
  frame.now();
  if (error) showError(error, "Generation");
  const seen = { tokens: tokens.length, ms: last - started };
  if (!tokens.length) {
    store.set({ streaming: false, gen: null });
    if (error) output.failed(false);
    else output.finish(stopped ? "stopped before the first token" : `finished: ${done?.finish_reason}`, { done });
    return;
  }
  if (done && !stopped) output.finish(`finished: ${done.finish_reason}`, { done, seen });
  else output.finish(error ? "failed" : `stopped after ${tokens.length} token${tokens.length === 1 ? "" : "s"}`, { seen });
  // The prompt's tokens come with the `done` event; only a stopped generation has to ask.
  let promptTokens = stopped ? null : done?.prompt_tokens;
  if (!promptTokens) {
    try {
      promptTokens = (await fetchAttention(messages ? { messages } : prompt, { layers: [0], heads: [0], format: "u8" })).tokens;
    } catch {
      promptTokens = [];
    }
  }
  const promptIds = promptTokens.map((t) => t.id);
  const genIds = tokens.map((t) => t.id);
  const ids = promptTokens.length ? promptIds.concat(genIds) : null;
  const probs = tokens.every((t) => t.logprob != null) ? tokens.map((t) => Math.round(1000 * Math.exp(t.logprob))) : null;
  store.set({ streaming: false, gen: store.get("gen").with({ promptTokens, done: true }), ids, plen: promptTokens.length, probs });
  if (!ids) return;
  // Analyse the very tokens the model saw, not a re-tokenised text: a generation can end in
  // part of a UTF-8 character, whose text (U+FFFD) encodes differently. An encoder-decoder's
  // prompt is its source and the generated tokens the target its decoder read.
  if (translation) await analyse({ text: prompt, ids: promptIds, targetIds: genIds, source: "gen" });
  else await analyse({ text: prompt + (done?.text ?? tokens.map((t) => t.delta).join("")), ids, source: "gen" });
}

/** A link with token ids: rebuild the generation (and its analysis) from them. */
async function rebuildGeneration(ids, plen) {
  const meta = store.get("meta");
  const translation = translates();
  const P = Math.max(1, Math.min(plen, ids.length - 1));
  const set = translation ? new AttentionSet("", meta, { ids: ids.slice(0, P), targetIds: ids.slice(P) }) : new AttentionSet("", meta, { ids });
  let gen;
  try {
    await track(set.ensure([store.get("layer")]));
    gen = translation ? GenerationRecord.fromTranslation(await track(translationFor(set, meta.name))) : GenerationRecord.fromAnalysis(set, plen);
  } catch (err) {
    showError(err, "Rebuilding the linked generation");
    return;
  }
  const promptText = gen.promptTokens.map((t) => t.text).join("");
  set.text = promptText + (translation ? "" : gen.tokens.map((t) => t.text).join(""));
  output.showTokens(promptText, gen.tokens, { probs: store.get("probs"), translation, model: meta.name });
  store.set({ gen, plen: gen.promptTokens.length });
  if (store.get("source") === "gen") {
    store.set({ att: set });
    $("#analysed").textContent = analysedLabel(set, " (the linked generation)");
  }
}

// ---------------------------------------------------------------------------------------
// Wiring
// ---------------------------------------------------------------------------------------
function currentExportView() {
  const s = store.state;
  return { view: current?.view, opts: { state: s, model: s.meta?.name ?? "attnlens", viewLabel: viewById(s.view).label } };
}

function wire() {
  buildControls(store);
  wireFieldResets();
  $("#generate-form").addEventListener("submit", (e) => {
    e.preventDefault();
    generate();
  });
  $("#stop-btn").addEventListener("click", stopGeneration);
  $("#example").addEventListener("click", () => {
    clearMessages();
    useExample();
  });
  $("#analyse").addEventListener("click", () => {
    clearMessages();
    store.set({ prompt: $("#prompt").value });
    analyse({ text: $("#prompt").value });
  });
  $("#prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
      e.preventDefault();
      if (canGenerate()) generate();
      else $("#analyse").click();
    }
  });
  $("#prompt").addEventListener("input", () => ($("#prompt-hint").textContent = promptHint()));
  $("#chat").addEventListener("change", () => {
    // a conversation from the text in the box (it becomes the user's turn), analysed as the template renders it
    clearMessages();
    if (chatMode(store.state)) $("#prompt").value = asConversation($("#prompt").value);
    store.set({ prompt: $("#prompt").value });
    analyse({ text: $("#prompt").value });
  });
  wireExportButtons(currentExportView, showError);
  $("#copy-link").addEventListener("click", async () => {
    writeURL(store.state);
    try {
      await navigator.clipboard.writeText(window.location.href);
      const label = $("#copy-link span");
      label.textContent = "Copied ✓";
      setTimeout(() => (label.textContent = "Copy link"), 1500);
    } catch {
      showError(new Error(window.location.href), "Copying (copy the link by hand)", { warn: true });
    }
  });
  const askKey = ({ reload = false } = {}) => {
    const key = window.prompt("API key for this server (kept in this browser only; empty to remove):", apiKey());
    if (key == null) return;
    setApiKey(key.trim());
    $("#api-key").classList.toggle("set", !!apiKey());
    if (reload) window.location.reload(); // the state is in the URL: the page comes back as it was
  };
  $("#api-key").addEventListener("click", () => askKey({ reload: !store.get("meta") }));
  setKeyHandler(() => askKey({ reload: true }));
  $("#api-key").classList.toggle("set", !!apiKey());
  wireTheme(() => current && renderView());
  let lastWidth = window.innerWidth;
  let timer = null;
  window.addEventListener("resize", () => {
    if (window.innerWidth === lastWidth) return;
    lastWidth = window.innerWidth;
    clearTimeout(timer);
    timer = setTimeout(() => renderView(), 150);
  });
  document.addEventListener("keydown", (e) => e.key === "Escape" && stopGeneration());
  store.subscribe((changed, s) => {
    if (changed.has("model") && models.differs(s.model)) switchModel(); // "" and the default's name are one model
    syncControls(s);
    if (s.meta && panels.count) panels.render(viewParams(s), changed);
    if (changed.has("step") || changed.has("gen")) output.markStep(s.step);
    scheduleRender(changed);
  });
}

// ---------------------------------------------------------------------------------------
// The model: the store's `model` key picks it (modelchoice.js); the page fits its family
// ---------------------------------------------------------------------------------------
const canGenerate = () => store.get("meta")?.tasks.includes("generate") ?? true;
const promptHint = () => (canGenerate() ? "Ctrl+Enter generates" : "Ctrl+Enter analyses");

/**
 * The picker chose another model: its description, and a fresh analysis of the same text if
 * it fits the new model (else its example). The old model's output, status and figures go:
 * nothing on screen belongs to another model than the one named in the top bar.
 */
async function switchModel() {
  clearMessages();
  stopGeneration();
  output.reset();
  $("#analysed").textContent = "";
  const meta = await models.use(store.get("model"), { att: null, gen: null, ids: null, plen: 0, probs: null, source: "prompt", pin: [], step: 0, streaming: false });
  if (!meta) return;
  $("#prompt-hint").textContent = promptHint();
  await analyse({ text: store.get("prompt"), orExample: true });
}

async function init() {
  wire();
  const s = store.state;
  if (s.prompt) $("#prompt").value = s.prompt;
  syncControls(store.state);
  const meta = await models.use(s.model);
  if (!meta) return;
  if (!s.prompt) {
    // no text in the link: the chosen model's example
    $("#prompt").value = chatMode(store.state) ? EXAMPLE_CONVERSATION : exampleFor(meta);
    store.set({ prompt: $("#prompt").value });
  }
  $("#prompt-hint").textContent = promptHint();
  writeURL(store.state);
  const { ids, plen, source } = store.state;
  if (ids?.length) await rebuildGeneration(ids, plen);
  if (!(ids?.length && source === "gen")) await analyse({ text: store.get("prompt"), keepPin: true, orExample: true });
}

init();
