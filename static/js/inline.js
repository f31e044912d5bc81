// Inline views for notebooks (attnlens.show in Python): one of the page's own views, drawn from
// an answer embedded in the document, with no server and no network. The Python side
// (attnlens/inline.py) writes the document: this module and every module it imports (inlined as
// data: URLs behind an import map), the page's CSS and the data. Each view is a document of its
// own (an iframe), so two views in one notebook share nothing.
//
// The views read the same params object as on the page (views/params.js); their attention comes
// from an AttentionSet whose fetch reads the embedded answer, and a translator's three groups are
// kept by translation.js before any view asks for them.

import { VIEWS, viewFits } from "./views/registry.js";
import { capabilities } from "./family.js";
import { viewParams, constrainState } from "./views/params.js";
import { defaults } from "./state/schema.js";
import { AttentionSet } from "./attention.js";
import { decodeAttention } from "./api.js";
import { GenerationRecord } from "./generation.js";
import { keepTranslation } from "./translator/translation.js";
import { drawLegend } from "./paint.js";
import { showError } from "./messages.js";
import { FillMaskPanel } from "./encoder/fillmask.js";
import { probRow } from "./encoder/probs.js";
import { escapeHTML } from "./tokens.js";

const STYLE = `
  body { background: var(--bg); }
  .inline-view { border: 1px solid var(--border); border-radius: 8px; overflow: hidden; background: var(--surface, var(--bg)); }
  .inline-view .toolbar { padding: 8px 12px; }
  .inline-view .inline-title { font-size: 12.5px; font-weight: 600; color: var(--text); }
  .inline-view .view-frame { min-height: 0; padding: 10px 12px 12px; }
  .inline-view .messages { padding: 0 12px; margin-top: 8px; }
  .inline-view .enc-results { padding: 10px 14px 14px; max-width: 560px; }
  .inline-view [hidden] { display: none !important; }
  /* the iframe is as tall as its document: nothing in it may be sized by the viewport (vh), or the
     two would chase each other; long pictures scroll inside these boxes instead */
  .inline-view .line-scroller, .inline-view .gen-heat { max-height: 720px; }
  .inline-view .view-host { max-height: none; }
`;

/** The views that can show an answer of this model here (its description, with capabilities): the
 * page's analysis views for an /attention answer, its generation view for a generation (comparing
 * two prompts needs a server). */
export const inlineViews = (meta, source = "analysis") => VIEWS.filter((v) => v.source === source && viewFits(v, meta));

function el(tag, attrs = {}, html = "") {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (html) e.innerHTML = html;
  return e;
}

/** Keep the iframe as tall as its document (same origin: srcdoc inherits the notebook's). */
function fitFrame() {
  let frame = null;
  try {
    frame = window.frameElement;
  } catch {
    return; // a cross-origin host: the iframe keeps the height attnlens.show gave it
  }
  if (frame) frame.style.height = `${Math.ceil(document.documentElement.getBoundingClientRect().height) + 2}px`;
}

/** An AttentionSet fetch that answers from the embedded /attention answer (layers it does not hold: NaN). */
function embeddedFetch(answer) {
  const data = decodeAttention(answer); // [layers][heads][T][T] of the held layers and heads
  const T = answer.tokens.length;
  const per = answer.heads.length * T * T;
  return async (_source, { layers }) => {
    const want = layers ?? answer.layers;
    const out = new Float32Array(want.length * per).fill(NaN);
    want.forEach((l, i) => {
      const at = answer.layers.indexOf(l);
      if (at >= 0) out.set(data.subarray(at * per, (at + 1) * per), i * per);
    });
    return { tokens: answer.tokens, nLayers: answer.n_layers, nHeads: answer.n_heads, layers: want, heads: answer.heads, direction: answer.direction, T, data: out };
  };
}

/** A pooled answer's overview, as AttentionSet.overview asks for it (fetchAttentionWindow's shape). */
function embeddedOverview(answer) {
  const data = decodeAttention(answer);
  return async () => ({ tokens: answer.tokens, T: answer.tokens.length, data, shape: answer.shape, rows: answer.rows, cols: answer.cols,
    rowEdges: answer.row_edges, colEdges: answer.col_edges, direction: answer.direction, bytes: 0 });
}

const same = (a, b) => (Array.isArray(a) && Array.isArray(b) ? a.length === b.length && a.every((x, i) => x === b[i]) : a === b);

/** One view with its own small state (the page's keys, constrained as the page does), drawn
 * from an embedded /attention answer (`spec.answer`) or generation (`spec.generation`). */
class InlineView {
  constructor(root, spec) {
    this.spec = spec;
    const { name, family, family_info, attention, n_layers, n_heads } = spec.model;
    this.meta = {
      name,
      n_layers,
      n_heads,
      family,
      family_info,
      capabilities: capabilities(family_info, []),
      attention,
      architecture: { family, n_layers, n_heads },
      tasks: [],
      labels: null,
      pooling: null,
    };
    const a = spec.answer;
    // a pooled answer (pool=N: every head as N x N bins) is the model view's overview, and only that
    this.pooled = !!a?.row_edges;
    this.views = inlineViews(this.meta, spec.generation ? "generation" : "analysis").filter((v) => !this.pooled || v.id === "model");
    this.viewIds = this.views.map((v) => v.id);
    this.att = a ? new AttentionSet(spec.text ?? "", this.meta, { fetch: embeddedFetch(a), fetchWindow: this.pooled ? embeddedOverview(a) : undefined }) : null;
    if (a?.translation) keepTranslation(a);
    const g = spec.generation;
    this.gen = g ? new GenerationRecord({ promptTokens: g.prompt_tokens, tokens: g.tokens, rows: g.rows, done: true }) : null;
    this.layers = a ? a.layers : [...Array(n_layers).keys()];
    this.heads = a ? a.heads : [...Array(n_heads).keys()];
    this.seq = 0;
    this.current = null;
    this.build(root);
    this.ctx = {
      select: (patch) => this.select(patch),
      setCaption: (html) => (this.caption.innerHTML = html),
      setLegend: (legend) => {
        this.legendWrap.hidden = !legend;
        if (!legend) return;
        drawLegend(this.legendCanvas, legend);
        this.legendLabel.textContent = legend.label || "";
      },
      track: (promise) => promise,
      showError,
      analyse: async () => null, // a panel's "analyse this text" needs a server
    };
  }

  build(root) {
    const box = el("div", { class: "inline-view" });
    const bar = el("div", { class: "toolbar", role: "group", "aria-label": "Display options" });
    const what = this.att ? `${this.spec.answer.tokens.length} tokens` : `${this.gen.tokens.length} generated tokens`;
    bar.append(el("span", { class: "inline-title" }, escapeHTML(`${this.meta.name} · ${this.meta.family} · ${what}`)));
    const select = (key, label, options) => {
      const s = el("select", { "data-key": key, "aria-label": label });
      for (const [value, text] of options) s.append(new Option(text, value));
      s.addEventListener("change", () => this.select({ [key]: key === "view" ? s.value : +s.value, pin: [] }));
      const wrap = el("label", { class: "ctl", "data-ctl": key }, escapeHTML(label) + " ");
      wrap.append(s);
      bar.append(wrap);
      return s;
    };
    this.selects = {
      view: select("view", "View", this.views.map((v) => [v.id, v.label])),
      layer: select("layer", "Layer", this.layers.map((l) => [l, l])),
      head: select("head", "Head", this.heads.map((h) => [h, h])),
    };
    const frame = el("div", { class: "view-frame" });
    const legendRow = el("div", { class: "legend-row" });
    this.caption = el("div", { class: "caption" });
    this.legendWrap = el("div", { class: "legend" });
    this.legendCanvas = el("canvas", { width: "220", height: "34" });
    this.legendLabel = el("span", { class: "legend-label" });
    this.legendWrap.append(this.legendCanvas, this.legendLabel);
    legendRow.append(this.caption, this.legendWrap);
    // the cross view steps through the translation with these (found by id, as on the page)
    this.steps = el("div", { class: "view-options", hidden: "" },
      '<span id="translation-steps" class="translation-steps" role="group" aria-label="Step through the translation">' +
        '<button type="button" class="btn small" data-step="prev">◀ Prev</button> <button type="button" class="btn small" data-step="next">Next ▶</button></span>' +
        '<span id="translation-step-note" class="translation-step-note" role="status"></span>');
    this.host = el("div", { class: "view-host", role: "tabpanel" });
    frame.append(legendRow, this.steps, this.host);
    box.append(bar, el("div", { id: "messages", class: "messages", role: "alert" }), frame);
    root.append(box);
  }

  async start() {
    if (this.att && this.pooled) {
      await this.att.overview(); // the embedded pooled maps, drawn as a long input's are
      this.att.long = true;
    } else if (this.att) await this.att.ensure([...Array(this.meta.n_layers).keys()]); // every layer now: nothing is fetched later
    const first = { layer: this.layers[0], head: this.heads[0], step: this.gen ? this.gen.tokens.length - 1 : 0 };
    const state = { ...defaults(), ...first, ...this.spec.state, view: this.spec.view, meta: this.meta, att: this.att, gen: this.gen,
      prompt: this.att?.text ?? this.spec.text ?? "", diff: "heads" };
    this.state = constrainState(state, this.meta, this.viewIds);
    await this.render(null);
  }

  select(patch) {
    const next = constrainState({ ...this.state, ...patch, diff: "heads" }, this.meta, this.viewIds);
    const changed = new Set(Object.keys(next).filter((k) => !same(next[k], this.state[k])));
    this.state = next;
    if (changed.size) this.render(changed).catch((err) => showError(err, "Drawing the view"));
  }

  syncControls() {
    const entry = this.views.find((v) => v.id === this.state.view);
    for (const [key, s] of Object.entries(this.selects)) {
      s.value = String(this.state[key]);
      if (key !== "view") s.closest("label").hidden = !entry.controls.includes(key);
    }
    this.steps.hidden = entry.id !== "cross";
  }

  async render(changed) {
    const entry = this.views.find((v) => v.id === this.state.view) ?? this.views[0];
    if (this.current?.id !== entry.id) {
      this.current?.view.unmount();
      this.ctx.setLegend(null);
      this.ctx.setCaption("");
      this.current = { id: entry.id, view: new entry.View(this.ctx) };
      this.current.view.mount(this.host);
      changed = null;
    }
    this.syncControls();
    const view = this.current.view;
    const mine = ++this.seq;
    const drawn = await view.render(viewParams(this.state), changed, () => mine === this.seq && this.current?.view === view);
    if (mine === this.seq) {
      window.__attnlens.renders++;
      window.__attnlens.drawn = drawn !== false;
      this.host.dataset.rendered = `${entry.id}:${this.state.layer}:${this.state.head}:${window.__attnlens.renders}`;
    }
    fitFrame();
  }
}

/** A fill-mask answer: each [MASK]'s candidates as the page's fill-mask panel shows them. */
function renderFillMask(root, spec) {
  const panel = new FillMaskPanel({});
  const box = el("div", { class: "inline-view" });
  box.append(el("div", { class: "toolbar" }, `<span class="inline-title">${escapeHTML(`${spec.model} · fill-mask`)}</span><span class="caption">${escapeHTML(spec.text)}</span>`));
  const results = el("div", { class: "enc-results" });
  results.replaceChildren(...spec.masks.map((cands, i) => panel.maskBox(cands, i, spec.masks.length)));
  box.append(results);
  root.append(box);
}

/** A classify answer: every label with its probability bar, as the page's classify panel. */
function renderClassify(root, spec) {
  const box = el("div", { class: "inline-view" });
  box.append(el("div", { class: "toolbar" }, `<span class="inline-title">${escapeHTML(`${spec.model} · classify`)}</span><span class="caption">${escapeHTML(spec.text)}</span>`));
  box.append(el("div", { class: "enc-results" }, spec.labels.map((l) => probRow(l.label, l.score, { attrs: `data-label="${escapeHTML(l.label)}"` })).join("")));
  root.append(box);
}

/**
 * Draw `spec` into `root`: {kind: "attention", model: {name, family, n_layers, n_heads},
 * answer (an /attention answer, any format), text, view, state (page state keys: layer, head,
 * cmap, scale, sink, …), theme?}; {kind: "generation", model, generation: {prompt_tokens,
 * tokens, rows: [step][layer][head][key]}, view, state}; {kind: "fill-mask", model, text,
 * masks}; {kind: "classify", model, text, labels}.
 * window.__attnlens says how it went (renders, drawn, errors), as on the page.
 */
export async function mountInline(root, spec) {
  window.__attnlens = { perf: {}, renders: 0, drawn: false, errors: [] };
  document.head.append(el("style", {}, STYLE));
  if (spec.theme === "light" || spec.theme === "dark") document.documentElement.dataset.theme = spec.theme;
  new ResizeObserver(fitFrame).observe(document.documentElement);
  try {
    if (spec.kind === "fill-mask") renderFillMask(root, spec);
    else if (spec.kind === "classify") renderClassify(root, spec);
    else await new InlineView(root, spec).start();
    if (spec.kind === "fill-mask" || spec.kind === "classify") window.__attnlens.drawn = true;
  } catch (err) {
    console.error("attnlens:", err);
    if (!document.getElementById("messages")) root.append(el("div", { id: "messages", class: "messages", role: "alert" }));
    showError(err, "Drawing the view");
  }
  fitFrame();
}
