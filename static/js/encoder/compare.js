// Compare panel (an encoder that answers /v1/embeddings): two sentences, A (the analysed text
// until the user edits it) and B. Compare (or Enter in a field) posts both in one
// POST /v1/embeddings and shows their cosine similarity (the dot product of the two unit
// vectors) with a bar; below it, each sentence's attention in the layer and head chosen on the
// page, side by side (POST /attention for just that map), redrawn when the layer, head, colour
// map, scale or first-token-sink setting changes.

import { ApiError, fetchAttention, postJSON } from "../api.js";
import { Heatmap } from "../heatmap.js";
import { colourScale } from "../scales.js";
import { removeSink } from "../attention.js";
import { escapeHTML, quoted } from "../tokens.js";
import { showTooltip, hideTooltip } from "../tooltip.js";

const SIDES = ["a", "b"];
const MAP_KEYS = ["layer", "head"]; // a new map to fetch
const PAINT_KEYS = ["cmap", "scale", "sink"]; // the same maps, coloured again

/** Cosine similarity of two vectors: their dot product over their norms (1 for unit vectors). */
export function cosine(a, b) {
  let dot = 0;
  let na = 0;
  let nb = 0;
  for (let i = 0; i < a.length; i++) {
    dot += a[i] * b[i];
    na += a[i] * a[i];
    nb += b[i] * b[i];
  }
  return na > 0 && nb > 0 ? dot / Math.sqrt(na * nb) : NaN;
}

export class ComparePanel {
  /** ctx: {showError(err, what, opts)} */
  constructor(ctx) {
    this.ctx = ctx;
    this.params = null;
    this.pair = null; // {a, b}: the texts last compared
    this.maps = null; // {layer, head, a, b}: their attention answers (api.js fetchAttention)
    this.wanted = null; // "layer:head" of the maps last asked for
    this.edited = false; // sentence A was typed in: it no longer follows the analysed text
    this.pending = 0; // requests in flight: the button waits for them
    this.runSeq = 0;
    this.mapSeq = 0;
    this.heat = {};
  }

  mount(host) {
    this.root = document.createElement("section");
    this.root.className = "panel enc-panel compare-panel";
    this.root.id = "compare-panel";
    this.root.innerHTML = `
      <div class="panel-head"><h2>Compare</h2><span class="hint">cosine of the sentence embeddings</span></div>
      <form class="compare-form" novalidate>
        <label class="compare-field"><span class="compare-tag">A</span>
          <textarea id="compare-a" rows="2" spellcheck="false" placeholder="a sentence" aria-label="Sentence A"></textarea></label>
        <label class="compare-field"><span class="compare-tag">B</span>
          <textarea id="compare-b" rows="2" spellcheck="false" placeholder="another sentence" aria-label="Sentence B"></textarea></label>
        <div class="actions"><button type="submit" id="compare" class="btn primary" title="Embed both sentences (Enter in a field)">Compare</button></div>
      </form>
      <div id="compare-results" class="enc-results" aria-live="polite"></div>
      <div id="compare-maps" class="compare-maps" hidden>
        <h3 class="compare-title"></h3>
        <div class="compare-pair">
          ${SIDES.map((s) => `<figure class="compare-map" data-side="${s}"><figcaption><span class="compare-tag">${s.toUpperCase()}</span> <span class="compare-text"></span></figcaption><div class="compare-heat"></div></figure>`).join("")}
        </div>
        <p class="compare-note"></p>
      </div>`;
    host.append(this.root);
    this.inputs = { a: this.root.querySelector("#compare-a"), b: this.root.querySelector("#compare-b") };
    this.button = this.root.querySelector("#compare");
    this.results = this.root.querySelector("#compare-results");
    this.mapsBox = this.root.querySelector("#compare-maps");
    this.root.querySelector("form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.run();
    });
    for (const el of Object.values(this.inputs)) {
      el.addEventListener("keydown", (e) => {
        if (e.key !== "Enter" || e.shiftKey || e.isComposing) return; // Shift+Enter: a new line
        e.preventDefault();
        this.run();
      });
    }
    // typed in, A stops following the analysed text; emptied, it follows it again
    this.inputs.a.addEventListener("input", () => (this.edited = this.inputs.a.value !== ""));
    for (const side of SIDES) {
      const host = this.root.querySelector(`.compare-map[data-side="${side}"] .compare-heat`);
      this.heat[side] = new Heatmap(host, {
        maxCell: 16,
        labelMax: 6,
        minWidth: 120,
        onHover: (h) => this.onHover(side, h),
        onLabelHover: (h) => this.onLabelHover(side, h),
      });
      this.heat[side].clear();
    }
    this.repaint = () => this.paint();
    this.onResize = () => {
      if (window.innerWidth === this.lastWidth) return;
      this.lastWidth = window.innerWidth;
      clearTimeout(this.resizeTimer);
      this.resizeTimer = setTimeout(this.repaint, 150);
    };
    this.lastWidth = window.innerWidth;
    window.addEventListener("resize", this.onResize);
    this.themeWatch = new MutationObserver(this.repaint); // the theme's colours are read as it paints
    this.themeWatch.observe(document.documentElement, { attributes: true, attributeFilter: ["data-theme"] });
  }

  unmount() {
    window.removeEventListener("resize", this.onResize);
    clearTimeout(this.resizeTimer);
    this.themeWatch?.disconnect();
    this.runSeq++;
    this.mapSeq++;
    hideTooltip();
    for (const h of Object.values(this.heat)) h.destroy();
    this.root?.remove();
  }

  render(params, changed) {
    const model = this.params?.model.name;
    this.params = params;
    const a = this.inputs.a;
    if (!this.edited && document.activeElement !== a && a.value !== params.text) a.value = params.text ?? "";
    if (!changed || (changed.has("meta") && params.model.name !== model)) return this.reset(); // another model: nothing of the old one stays
    if (!this.pair) return;
    const { layer, head } = params.selection;
    if (MAP_KEYS.some((k) => changed.has(k)) && `${layer}:${head}` !== this.wanted) this.drawMaps();
    else if (PAINT_KEYS.some((k) => changed.has(k))) this.paint();
  }

  reset() {
    this.runSeq++;
    this.mapSeq++;
    this.pair = this.maps = this.wanted = null;
    this.results.replaceChildren();
    this.mapsBox.hidden = true;
  }

  /** Count a request in flight while `promise` runs; the button is disabled until none is. */
  async track(promise) {
    this.button.disabled = ++this.pending > 0;
    this.root.classList.add("busy");
    try {
      return await promise;
    } finally {
      this.button.disabled = --this.pending > 0;
      this.root.classList.toggle("busy", this.pending > 0);
    }
  }

  run() {
    const p = this.params;
    if (!p || this.pending) return;
    const a = this.inputs.a.value;
    const b = this.inputs.b.value;
    const empty = !a.trim() ? this.inputs.a : !b.trim() ? this.inputs.b : null;
    if (empty) {
      this.ctx.showError(new ApiError(`Type ${empty === this.inputs.a ? "a sentence in A" : "another sentence in B"} to compare.`), "Compare", { warn: true });
      empty.focus();
      return;
    }
    this.pair = { a, b };
    this.maps = null;
    this.similarity(a, b, p.model.name);
    this.drawMaps();
  }

  async similarity(a, b, model) {
    const mine = ++this.runSeq;
    this.results.classList.add("loading");
    try {
      const res = await this.track(postJSON("/v1/embeddings", { model, input: [a, b], encoding_format: "float" }));
      if (mine !== this.runSeq) return;
      const [ea, eb] = [...res.data].sort((x, y) => x.index - y.index).map((d) => d.embedding);
      this.showCosine(cosine(ea, eb));
    } catch (err) {
      if (mine !== this.runSeq) return;
      this.results.replaceChildren();
      this.ctx.showError(err, "Compare");
    } finally {
      if (mine === this.runSeq) this.results.classList.remove("loading");
    }
  }

  /** The cosine, 3 decimals, on a bar from −1 to 1 filled from 0 towards it. */
  showCosine(c) {
    const x = Math.max(-1, Math.min(1, c || 0));
    const left = 50 * (1 + Math.min(0, x));
    const width = 50 * Math.abs(x);
    this.results.innerHTML = `
      <div class="cos-row" data-cosine="${c}" title="cosine similarity of the two sentence embeddings: 1 = the same direction, 0 = unrelated, −1 = opposite">
        <span class="cos-label">cosine</span>
        <span class="cos-track"><span class="cos-fill${x < 0 ? " neg" : ""}" style="left:${left.toFixed(1)}%;width:${width.toFixed(1)}%"></span></span>
        <span class="cos-value" id="compare-cosine">${c === c ? c.toFixed(3) : "—"}</span>
        <span class="cos-ticks" aria-hidden="true"><span>−1</span><span>0</span><span>1</span></span>
      </div>`;
  }

  /** Both sentences' map for the page's layer and head, fetched as a pair, then painted. */
  async drawMaps() {
    const pair = this.pair;
    if (!pair || !this.params) return;
    const { layer, head } = this.params.selection;
    const mine = ++this.mapSeq;
    this.wanted = `${layer}:${head}`; // the map asked for last: an older answer is dropped
    this.mapsBox.hidden = false;
    this.mapsBox.classList.add("loading");
    try {
      const fetched = await this.track(
        Promise.all(SIDES.map((s) => fetchAttention(pair[s], { layers: [layer], heads: [head], format: "f16", packing: "full" }))),
      );
      if (mine !== this.mapSeq) return;
      this.maps = { layer, head, a: fetched[0], b: fetched[1] };
      this.paint();
    } catch (err) {
      if (mine !== this.mapSeq) return;
      this.maps = this.wanted = null;
      this.mapsBox.hidden = true;
      this.ctx.showError(err, "Compare");
    } finally {
      if (mine === this.mapSeq) this.mapsBox.classList.remove("loading");
    }
  }

  /** Colour the two maps on one scale (the page's colour map, scale and sink setting). */
  paint() {
    const m = this.maps;
    if (!m || !this.params || this.mapsBox.hidden) return;
    const { cmap, scale, sink } = this.params.settings;
    const scaled = SIDES.map((s) => {
      const data = sink ? removeSink(m[s].data, m[s].T) : m[s].data;
      return { raw: data, ...colourScale(data, m[s].T, scale) };
    });
    const vmin = Math.min(...scaled.map((x) => x.vmin));
    const vmax = Math.max(...scaled.map((x) => x.vmax));
    this.mapsBox.querySelector(".compare-title").textContent = `Layer ${m.layer} · head ${m.head}${sink ? " (first-token sink hidden)" : ""}`;
    this.shown = {};
    SIDES.forEach((s, i) => {
      const { tokens, T } = m[s];
      const fig = this.mapsBox.querySelector(`.compare-map[data-side="${s}"]`);
      const text = fig.querySelector(".compare-text");
      text.textContent = this.pair[s];
      text.title = this.pair[s];
      fig.dataset.tokens = String(T);
      this.shown[s] = { tokens, data: scaled[i].raw, T };
      this.heat[s].set({
        data: scaled[i].data,
        rows: T,
        cols: T,
        rowLabels: tokens.map((t) => t.text),
        colLabels: tokens.map((t) => t.text),
        cmap,
        vmin,
        vmax,
        gamma: scaled[i].gamma,
        causal: false, // an encoder's maps are full squares
      });
      this.heat[s].overlay.setAttribute("aria-label", `Sentence ${s.toUpperCase()}: attention of layer ${m.layer}, head ${m.head}, ${T} × ${T} tokens`);
    });
    // as the head view says it: when cells are too narrow for every label, which ones are
    const step = Math.max(...SIDES.map((s) => Math.max(this.heat[s].layout?.colStep ?? 1, this.heat[s].layout?.rowStep ?? 1)));
    const nth = step === 2 ? "2nd" : step === 3 ? "3rd" : `${step}th`;
    this.mapsBox.querySelector(".compare-note").textContent =
      "rows: queries · columns: keys · one colour scale for both" + (step > 1 ? ` · every ${nth} token labelled: hover or tap a cell for its tokens` : "");
    this.mapsBox.dataset.drawn = `${m.layer}:${m.head}`;
  }

  onHover(side, h) {
    const shown = this.shown?.[side];
    if (!h || !shown) return hideTooltip();
    const v = shown.data[h.row * shown.T + h.col];
    const value = v === v ? `<b>${v.toFixed(3)}</b>` : '<span class="tt-muted">hidden (first-token sink)</span>';
    showTooltip(
      `<div class="tt-cell">${side.toUpperCase()}: <span class="tt-tok">${escapeHTML(quoted(shown.tokens[h.row], h.row))}</span> → <span class="tt-tok">${escapeHTML(quoted(shown.tokens[h.col], h.col))}</span>: ${value}</div>`,
      h.x,
      h.y,
    );
  }

  onLabelHover(side, h) {
    const t = h && this.shown?.[side]?.tokens[h.index];
    if (!t) return hideTooltip();
    showTooltip(`<div class="tt-cell"><span class="tt-tok">${escapeHTML(quoted(t, h.index))}</span></div><div class="tt-muted">token id ${t.id}</div>`, h.x, h.y);
  }
}
