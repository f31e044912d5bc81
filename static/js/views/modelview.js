// Model view: every layer × head as a small heatmap. Each thumbnail is a button holding a
// canvas of T×T pixels (one per cell) that CSS scales; layers are fetched as they scroll
// into view when the input is long. Past LONG_TOKENS every head comes pooled in one request
// (the AttentionSet's overview, OVERVIEW_BINS a side), and the heads can be ordered by the
// atlas's scores on its probe, or grouped by its roles (state key `morder`: grid | first_token |
// previous_token | induction | role), so hundreds of thumbnails are browsable.

import { paintMatrix, cssVar, parseColor } from "../paint.js";
import { removeSink, headStats, JSON_MAX_TOKENS } from "../attention.js";
import { fetchHeads, probeFor } from "../explain/explain_api.js";
import { colourScale, SCALES } from "../scales.js";
import { showTooltip, hideTooltip } from "../tooltip.js";
import { isAblated, toggleAblation, formatAblation } from "../explain/ablation.js";

export class ModelView {
  constructor(ctx) {
    this.ctx = ctx;
    this.params = null;
    this.thumbs = []; // [layer][head] -> {button, canvas}
    this.observer = null;
    this.wanted = new Set();
    this.flushTimer = null;
  }

  mount(host) {
    this.host = host;
    this.root = document.createElement("div");
    this.root.className = "model-grid";
    host.append(this.root);
  }

  unmount() {
    hideTooltip();
    this.observer?.disconnect();
    this.orderBar?.remove();
    this.root?.remove();
  }

  thumbSize(H) {
    const avail = (this.host.clientWidth || 800) - 56;
    return Math.max(44, Math.min(150, Math.floor(avail / H) - 8));
  }

  build() {
    const att = this.params.attention;
    const L = att.nLayers;
    const H = att.nHeads;
    const size = this.thumbSize(H);
    this.root.replaceChildren();
    this.orderBar?.remove();
    this.orderBar = null;
    this.root.classList.remove("model-list");
    this.root.style.setProperty("--thumb", `${size}px`);
    this.root.style.gridTemplateColumns = `40px repeat(${H}, var(--thumb))`;
    const corner = document.createElement("div");
    corner.className = "grid-corner";
    corner.textContent = "L \\ H";
    this.root.append(corner);
    for (let h = 0; h < H; h++) {
      const d = document.createElement("div");
      d.className = "grid-col-label";
      d.textContent = `H${h}`;
      this.root.append(d);
    }
    this.thumbs = [];
    this.rowEls = [];
    for (let l = 0; l < L; l++) {
      const lab = document.createElement("div");
      lab.className = "grid-row-label";
      lab.textContent = `L${l}`;
      lab.dataset.layer = l;
      this.root.append(lab);
      this.rowEls.push(lab);
      const row = [];
      for (let h = 0; h < H; h++) {
        const t = this.thumb(l, h, att.long ? att.overviewMaps.bins : att.T);
        this.root.append(t.button);
        row.push(t);
      }
      this.thumbs.push(row);
    }
    this.markSelected();
  }

  /** One head's thumbnail: a button holding a canvas of px × px. */
  thumb(l, h, px) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = "thumb loading";
    b.dataset.layer = l;
    b.dataset.head = h;
    b.setAttribute("aria-label", `Layer ${l}, head ${h}: open in head view`);
    const c = document.createElement("canvas");
    c.width = px;
    c.height = px;
    b.append(c);
    b.addEventListener("click", (e) => {
      // Alt- or Shift-click: add the head to the ablation (or remove it), of the primary group
      if (e.altKey || e.shiftKey) this.ctx.select({ ablate: formatAblation(toggleAblation(this.params.ablation, l, h, this.ablationGroup())) });
      else this.ctx.select({ layer: l, head: h, view: "head", pin: [] });
    });
    b.addEventListener("mouseenter", () => this.tip(b, l, h));
    b.addEventListener("focus", () => this.tip(b, l, h));
    b.addEventListener("mouseleave", hideTooltip);
    b.addEventListener("blur", hideTooltip);
    return { button: b, canvas: c, drawn: false };
  }

  /**
   * A long input's heads as one list ordered by an atlas score (highest first), each thumbnail
   * captioned with its layer, head and score: `heads` [{l, h, score, role?}] (score null: none).
   * With roles, the heads are grouped under a heading per role (the strongest group first,
   * "mixed" last), each group in the order of its role's score.
   */
  buildOrdered(heads, name) {
    const att = this.params.attention;
    this.root.replaceChildren();
    this.orderBar?.remove();
    this.orderBar = null;
    this.root.classList.add("model-list");
    this.root.style.gridTemplateColumns = "";
    this.root.style.setProperty("--thumb", `${Math.max(56, Math.min(96, this.thumbSize(att.nHeads)))}px`);
    const byScore = (a, b) => (b.score ?? -Infinity) - (a.score ?? -Infinity);
    const groups = new Map();
    for (const e of [...heads].sort(byScore)) {
      const key = e.role ?? "";
      if (!groups.has(key)) groups.set(key, []);
      groups.get(key).push(e);
    }
    const order = [...groups.keys()].sort((a, b) => (a === "mixed") - (b === "mixed") || byScore(groups.get(a)[0], groups.get(b)[0]));
    this.thumbs = [...Array(att.nLayers)].map(() => []);
    this.rowEls = [];
    for (const key of order) {
      const members = groups.get(key);
      if (key) {
        const heading = document.createElement("h4");
        heading.className = "role-heading";
        heading.textContent = `${key.replace("_", " ")} · ${members.length} head${members.length === 1 ? "" : "s"}`;
        this.root.append(heading);
      }
      for (const { l, h, score, role } of members) {
        const t = this.thumb(l, h, att.overviewMaps.bins);
        const fig = document.createElement("figure");
        fig.className = "thumb-item";
        const cap = document.createElement("figcaption");
        cap.textContent = `L${l}H${h} ${score == null ? "—" : score.toFixed(2)}`;
        cap.title = `layer ${l}, head ${h}: ${role ? `role ${role}, ` : ""}${name} score ${score == null ? "undefined" : score.toFixed(3)}`;
        fig.append(t.button, cap);
        this.root.append(fig);
        this.thumbs[l][h] = t;
      }
    }
    this.markSelected();
  }

  /** The order control of a long input's overview (state key `morder`). */
  orderControl(order) {
    const bar = document.createElement("div");
    bar.className = "model-order";
    bar.innerHTML = '<label>Order heads <select aria-label="Order heads"><option value="grid">by layer and head</option><option value="first_token">by attention to the first token (sinks)</option><option value="previous_token">by previous-token score</option><option value="induction">by induction score</option><option value="role">grouped by role</option></select></label> <span class="tt-muted">scores: the atlas\'s, on its repeated-random probe</span>';
    const select = bar.querySelector("select");
    select.value = order;
    select.addEventListener("change", () => this.ctx.select({ morder: select.value }));
    return bar;
  }

  tip(b, l, h) {
    const att = this.params.attention;
    if (att.long) {
      const r = b.getBoundingClientRect();
      const o = att.overviewMaps;
      showTooltip(`<div class="tt-cell"><b>Layer ${l} · head ${h}</b></div><div class="tt-muted">${att.T} tokens pooled to ${o.bins} × ${o.bins} bins of about ${Math.round(att.T / o.bins)} tokens; click to open it in the head view (zoom there for every token); Alt/Shift-click to ablate it</div>`, r.right - 6, r.top + 4);
      return;
    }
    const m = att.head(l, h);
    const r = b.getBoundingClientRect();
    let body = '<div class="tt-muted">loading…</div>';
    if (m) {
      const s = headStats(m, att.T);
      const pct = (x) => `${(100 * x).toFixed(0)}%`;
      body = `<div class="tt-muted">self ${pct(s.self)} · previous ${pct(s.previous)} · first token ${pct(s.first)}</div><div class="tt-muted">means over query rows 1 … ${att.T - 1}; click to open in the head view; Alt/Shift-click to ablate it</div>`;
    }
    showTooltip(`<div class="tt-cell"><b>Layer ${l} · head ${h}</b></div>${body}`, r.right - 6, r.top + 4);
  }

  /** The group the maps here belong to, as an ablation names it (null: the family has one). */
  ablationGroup() {
    const groups = this.params.model.groups;
    return groups.length > 1 ? groups[0].name : null;
  }

  markSelected() {
    const { layer, head } = this.params.selection;
    const group = this.ablationGroup();
    for (const row of this.thumbs)
      for (const t of row) {
        const l = +t.button.dataset.layer;
        const h = +t.button.dataset.head;
        const sel = l === layer && h === head;
        t.button.classList.toggle("selected", sel);
        t.button.classList.toggle("ablated", isAblated(this.params.ablation, l, h, group));
        t.button.setAttribute("aria-pressed", sel ? "true" : "false");
      }
  }

  /** Paint every thumbnail of the given layers; returns milliseconds spent. */
  paintLayers(layers) {
    const att = this.params.attention;
    const state = this.params.settings;
    const T = att.long ? att.overviewMaps.bins : att.T;
    const maskColor = parseColor(cssVar("--heat-masked", "#e5e7eb"));
    const t0 = performance.now();
    for (const l of layers) {
      if (!att.long && !att.has(l)) continue;
      for (let h = 0; h < att.nHeads; h++) {
        let m = att.long ? att.pooledHead(l, h) : att.head(l, h);
        if (state.sink) m = removeSink(m, T);
        const sc = colourScale(m, T, state.scale);
        const t = this.thumbs[l][h];
        paintMatrix(sc.data, T, T, { cmap: state.cmap, vmin: sc.vmin, vmax: sc.vmax, gamma: sc.gamma, causal: this.params.causal, maskColor, canvas: t.canvas });
        t.drawn = true;
        t.button.classList.remove("loading");
      }
    }
    return performance.now() - t0;
  }

  async render(params, changed, isCurrent = () => true) {
    const prev = this.params;
    this.params = params;
    if (prev && prev.attention === params.attention && changed && [...changed].every((k) => ["layer", "head", "pin", "step", "zoom", "ablate", "explain", "probe"].includes(k))) {
      this.markSelected();
      return true;
    }
    const att = params.attention;
    const started = performance.now();
    const perf = (window.__attnlens.perf.modelView = { started, T: 0, drawMs: null, totalMs: null, layers: 0, heads: 0 });
    if (att.mayBeLong()) await att.overview();
    if (!isCurrent()) return false;
    if (att.long) return this.renderLong(params, perf, started, isCurrent);
    // We need T to size the canvases: fetch the first layer (or all of them for short inputs).
    const lazy = att.T ? att.T > JSON_MAX_TOKENS : att.text.length > 3 * JSON_MAX_TOKENS;
    if (!att.T) await att.ensure(lazy ? [0] : [...Array(att.nLayers).keys()]);
    if (!lazy) await att.ensure([...Array(att.nLayers).keys()]);
    if (!isCurrent()) return false;
    this.build();
    const scale = params.settings.scale;
    const perMap = scale !== "unit" && scale !== "row";
    this.legend = { cmap: params.settings.cmap, vmin: 0, vmax: 1, gamma: scale === "sqrt" ? 0.5 : 1, label: perMap ? `attention weight, 0 → each map's own top (${SCALES[scale]})` : `attention weight, ${SCALES[scale]}` };
    this.ctx.setLegend(this.legend);
    this.ctx.setCaption(
      `<b>All ${att.nLayers} layers × ${att.nHeads} heads</b>${params.scope ? ` of ${params.scope}` : ""} on ${att.T} tokens; colours ${perMap ? `per map (${SCALES[scale]})` : SCALES[scale]}. Click a map to open it in the head view; Alt- or Shift-click to add the head to the ablation (Ablate view).`,
    );
    const present = [...Array(att.nLayers).keys()].filter((l) => att.has(l));
    perf.drawMs = this.paintLayers(present);
    perf.T = att.T;
    perf.heads = att.nHeads;
    perf.layers = present.length;
    if (att.hasAll()) perf.totalMs = performance.now() - started;
    else this.observe(perf, started);
    return true;
  }

  /** A long input: every head from the pooled overview, in the order the state asks for. */
  async renderLong(params, perf, started, isCurrent) {
    const att = params.attention;
    const order = params.settings.morder;
    const o = att.overviewMaps;
    let scores = null;
    const scored = params.model.capabilities?.has?.("server"); // the atlas's scores need the live page's server
    if (order !== "grid" && scored) {
      let atlas;
      try {
        atlas = await this.ctx.track(fetchHeads(att, { probe: probeFor(params.model) }));
      } catch (err) {
        this.ctx.showError(err, "Scoring the heads");
      }
      if (!isCurrent()) return false;
      const rows = atlas?.groups?.[0]?.heads;
      if (rows) {
        scores = [];
        rows.forEach((row, l) =>
          row.forEach((h, i) => scores.push(order === "role" ? { l, h: i, score: h.role_score ?? null, role: h.role } : { l, h: i, score: h.scores?.[order] ?? null })),
        );
      }
    }
    if (scores) this.buildOrdered(scores, order === "role" ? "role" : order.replace("_", " "));
    else this.build();
    if (scored) {
      this.orderBar = this.orderControl(scores ? order : "grid");
      this.root.before(this.orderBar);
    }
    const scale = params.settings.scale;
    const perMap = scale !== "unit" && scale !== "row";
    this.legend = { cmap: params.settings.cmap, vmin: 0, vmax: 1, gamma: scale === "sqrt" ? 0.5 : 1, label: perMap ? `pooled attention, 0 → each map's own top (${SCALES[scale]})` : `pooled attention, ${SCALES[scale]}` };
    this.ctx.setLegend(this.legend);
    this.ctx.setCaption(
      `<b>All ${att.nLayers} layers × ${att.nHeads} heads</b>${params.scope ? ` of ${params.scope}` : ""} on ${att.T} tokens, each pooled to ${o.bins} × ${o.bins} bins of about ${Math.round(att.T / o.bins)} token${Math.round(att.T / o.bins) === 1 ? "" : "s"}: a cell is the mean, over the queries of its row bin, of the attention they give to the keys of its column bin (rows still sum to 1).${scored ? " Click a map to open it in the head view, where zooming fetches every token." : ""}`,
    );
    perf.drawMs = this.paintLayers([...Array(att.nLayers).keys()]);
    perf.T = att.T;
    perf.heads = att.nHeads;
    perf.layers = att.nLayers;
    perf.bytes = att.bytesFetched;
    perf.totalMs = performance.now() - started;
    return true;
  }

  observe(perf, started) {
    const att = this.params.attention;
    this.observer?.disconnect();
    this.observer = new IntersectionObserver(
      (entries) => {
        for (const e of entries) if (e.isIntersecting) this.wanted.add(+e.target.dataset.layer);
        clearTimeout(this.flushTimer);
        this.flushTimer = setTimeout(() => this.flush(perf, started), 30);
      },
      { root: null, rootMargin: "200px" },
    );
    this.rowEls.forEach((el, l) => {
      if (!att.has(l)) this.observer.observe(el);
    });
  }

  async flush(perf, started) {
    const att = this.params.attention;
    const layers = [...this.wanted].filter((l) => !att.has(l));
    this.wanted.clear();
    if (!layers.length) return;
    try {
      await this.ctx.track(att.ensure(layers));
    } catch (err) {
      this.ctx.showError(err, "Loading attention");
      return;
    }
    if (this.params.attention !== att || !this.root.isConnected) return;
    perf.drawMs += this.paintLayers(layers);
    perf.layers = [...Array(att.nLayers).keys()].filter((l) => att.has(l)).length;
    layers.forEach((l) => this.observer?.unobserve(this.rowEls[l]));
    if (att.hasAll()) perf.totalMs = performance.now() - started;
  }

  /** Every map with layer and head labels, each at least 64 px, for the PNG export. */
  exportPicture(scale = 1) {
    const att = this.params?.attention;
    if (!att?.T || !this.thumbs.length) return null;
    const H = att.nHeads;
    const L = att.nLayers;
    const cell = Math.max(64, Math.min(160, att.T)) * scale;
    const gap = 8 * scale;
    const left = 40 * scale;
    const top = 24 * scale;
    const c = document.createElement("canvas");
    c.width = left + H * (cell + gap);
    c.height = top + L * (cell + gap);
    const ctx = c.getContext("2d");
    ctx.fillStyle = cssVar("--text", "#111");
    ctx.font = `${12 * scale}px system-ui, sans-serif`;
    ctx.textBaseline = "middle";
    ctx.imageSmoothingEnabled = false;
    for (let h = 0; h < H; h++) ctx.fillText(`H${h}`, left + h * (cell + gap) + cell / 2 - 8 * scale, top / 2);
    for (let l = 0; l < L; l++) {
      ctx.fillText(`L${l}`, 8 * scale, top + l * (cell + gap) + cell / 2);
      for (let h = 0; h < H; h++) {
        const t = this.thumbs[l]?.[h];
        if (t?.drawn) ctx.drawImage(t.canvas, left + h * (cell + gap), top + l * (cell + gap), cell, cell);
      }
    }
    return { canvas: c, title: `all ${L} layers × ${H} heads`, legend: this.legend };
  }

  exportData() {
    const att = this.params?.attention;
    if (!att?.T) return null;
    if (att.long) {
      const o = att.overviewMaps;
      const n = o.bins;
      const heads = [];
      for (let l = 0; l < att.nLayers; l++)
        for (let h = 0; h < att.nHeads; h++) {
          const m = att.pooledHead(l, h);
          const rows = [];
          for (let r = 0; r < n; r++) rows.push(Array.from(m.subarray(r * n, (r + 1) * n), (v) => +v.toFixed(5)));
          heads.push({ layer: l, head: h, pooled: rows });
        }
      return { title: `all heads pooled to ${n} × ${n}`, tokens: att.tokens, row_edges: o.rowEdges, col_edges: o.colEdges, heads };
    }
    const state = this.params.settings;
    const T = att.T;
    const heads = [];
    for (let l = 0; l < att.nLayers; l++) {
      if (!att.has(l)) continue;
      for (let h = 0; h < att.nHeads; h++) {
        let m = att.head(l, h);
        if (state.sink) m = removeSink(m, T);
        const rows = [];
        for (let r = 0; r < T; r++) rows.push(Array.from(m.subarray(r * T, (r + 1) * T), (v) => (v !== v ? null : +v.toFixed(5))));
        heads.push({ layer: l, head: h, matrix: rows });
      }
    }
    return { title: "all heads", tokens: att.tokens, heads };
  }
}
