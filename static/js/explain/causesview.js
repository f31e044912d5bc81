// Causes view (issue 46): which parts of a causal language model carry the difference between a
// clean prompt and a corrupted one (the same number of tokens, a few changed). Each cell of the
// chosen component is patched from the clean run into the corrupted one (POST /patch) and the
// metric logit(answer) − logit(foil) at the last position read, normalised:
// (value − corrupted) / (clean − corrupted), so 0 is the corrupted run and 1 the clean run, drawn
// in a diverging colour map centred on 0. `method` "exact" patches each cell; "attribution" gives
// first-order estimates (one forward, one backward). The answer and foil are picked from the clean
// prompt's top predictions at its last position (POST /logits), or typed.
// A head clicked (the state's `sender`) shows its attention map on both prompts, its direct logit
// attribution (POST /logit-attribution) and its paths: the sender's clean write patched into each
// later head's query, key or value input only (component "paths"). The direct logit attribution
// of every head and MLP is ranked as a bar chart under the map.
// An encoder-decoder's (the translator's) prompts are two sources read with one target (typed
// here; none: the metric is on the first target token), the metric at the target's last position;
// its maps come by group (encoder, decoder and cross heads; each stack's residual stream and
// sub-layers), a head clicked shows that group's map and its paths by receiver group (the sender's
// group sent with it).

import { fetchNextTokens, fetchPatch, fetchLogitAttribution } from "./explain_api.js";
import { Heatmap } from "../heatmap.js";
import { AttentionSet } from "../attention.js";
import { cssVar } from "../paint.js";
import { escapeHTML, visible, axisLabel, quoted } from "../tokens.js";
import { showTooltip, hideTooltip } from "../tooltip.js";
import { translationFor, isTranslator, START_LABEL } from "../translator/translation.js";

export const CAUSES_METHODS = ["exact", "attribution"];
export const CAUSES_COMPONENTS = ["heads", "residual", "layers"];
const COMPONENT_LABELS = { heads: "heads (every position)", residual: "residual stream, by position", layers: "attention and MLP, by position" };
const TOP_K = 10; // answer and foil choices
const BARS = 12; // heads and MLPs in the attribution chart
const KEEP_SETS = 4; // attention sets of prompts kept for the detail's maps
// an encoder-decoder's groups, in the family's order (the sender's third number), and its figures' captions
const GROUPS = ["encoder", "decoder", "cross"];
const GROUP_LABELS = { encoder: "encoder self-attention", decoder: "decoder self-attention", cross: "cross-attention" };

const num = (v, d = 3) => (v == null || !Number.isFinite(v) ? "—" : v.toFixed(d));
const signed = (v, d = 3) => (v == null || !Number.isFinite(v) ? "—" : (v > 0 ? "+" : v < 0 ? "−" : "") + Math.abs(v).toFixed(d));
const pct = (p) => (p == null ? "" : p >= 0.995 ? "100%" : p < 0.001 ? "<0.1%" : `${(100 * p).toFixed(p < 0.1 ? 1 : 0)}%`);

/**
 * The normalised effect of each cell of `rows` ([R][C], null allowed): (v − corrupted) /
 * (clean − corrupted) as a row-major Float32Array; null (a path below its sender), or no
 * difference between the two runs, is NaN (drawn in the masked colour).
 */
export function normalise(rows, clean, corrupted) {
  const R = rows.length;
  const C = rows[0]?.length ?? 0;
  const span = clean - corrupted;
  const out = new Float32Array(R * C);
  for (let r = 0; r < R; r++) {
    const row = rows[r];
    for (let c = 0; c < C; c++) {
      const v = row[c];
      out[r * C + c] = v == null || !span ? NaN : (v - corrupted) / span;
    }
  }
  return out;
}

/** The colour range: symmetric about 0, reaching at least ±1 (the clean run's value). */
function extent(data) {
  let m = 1;
  for (const v of data) if (v === v && Math.abs(v) > m) m = Math.abs(v);
  return m;
}

/** A Heatmap that also outlines one chosen cell (the head whose detail is open). */
class MarkedHeatmap extends Heatmap {
  drawOverlay() {
    super.drawOverlay();
    const L = this.layout;
    const m = this.marked;
    if (!L || !m || !this.model || m.row >= this.model.rows || m.col >= this.model.cols) return;
    const ctx = this.overlay.getContext("2d"); // super left it scaled to CSS pixels
    ctx.strokeStyle = cssVar("--text");
    ctx.lineWidth = 2.5;
    ctx.strokeRect(L.left + m.col * L.cellW + 1.25, L.top + m.row * L.cellH + 1.25, Math.max(2, L.cellW - 2.5), Math.max(2, L.cellH - 2.5));
  }
}

export class CausesView {
  constructor(ctx) {
    this.ctx = ctx;
    this.params = null;
    this.top = []; // the clean prompt's top predictions at its last position: [{id, text, prob}]
    this.patch = null; // the /patch answer drawn
    this.attr = null; // the /logit-attribution answer drawn
    this.maps = []; // the main figure's heatmaps
    this.detailMaps = [];
    this.detailKey = "";
    this.sets = new Map(); // prompt text -> AttentionSet (the detail's maps)
  }

  mount(host) {
    this.root = document.createElement("div");
    this.root.className = "causes";
    const components = CAUSES_COMPONENTS.map((c) => `<option value="${c}">${escapeHTML(COMPONENT_LABELS[c])}</option>`).join("");
    this.root.innerHTML = `
      <form class="cz-form" autocomplete="off">
        <div class="cz-prompts">
          <div class="cz-prompt" data-side="clean">
            <label for="cz-clean">Clean prompt</label>
            <textarea id="cz-clean" name="clean" rows="3" spellcheck="false"></textarea>
            <div class="cz-tokens" data-side="clean" aria-label="The clean prompt's tokens (differing ones marked)"></div>
          </div>
          <div class="cz-prompt" data-side="corrupted">
            <label for="cz-corrupted">Corrupted prompt <span class="hint">as many tokens, a few changed</span></label>
            <textarea id="cz-corrupted" name="corrupted" rows="3" spellcheck="false"></textarea>
            <div class="cz-tokens" data-side="corrupted" aria-label="The corrupted prompt's tokens (differing ones marked)"></div>
          </div>
        </div>
        <div class="cz-prompt cz-target" data-side="target" hidden>
          <label for="cz-target">Target <span class="hint">both sources are read with it; the metric is on the token after it (none: the first)</span></label>
          <input id="cz-target" name="target" type="text" spellcheck="false" placeholder="none: the first target token">
          <div class="cz-tokens" data-side="target" aria-label="The target's tokens (the metric's position marked)"></div>
        </div>
        <div class="cz-choose">
          <span class="cz-pick"><label for="cz-answer">Answer</label> <select id="cz-answer" name="answer"></select>
            <input name="answerTyped" type="text" spellcheck="false" placeholder="or type one" aria-label="Answer token, typed (used instead of the list)"></span>
          <span class="cz-pick"><label for="cz-foil">Foil</label> <select id="cz-foil" name="foil"></select>
            <input name="foilTyped" type="text" spellcheck="false" placeholder="or type one" aria-label="Foil token, typed (used instead of the list)"></span>
          <button type="submit" class="btn small primary cz-run">Patch</button>
        </div>
        <div class="cz-bar" role="group" aria-label="What to patch">
          <span class="segmented" role="radiogroup" aria-label="Method">
            <button type="button" class="btn small" role="radio" data-method="exact" title="One patched run per cell">Exact</button>
            <button type="button" class="btn small" role="radio" data-method="attribution" title="First-order estimates of the same values: one forward and one backward pass">Attribution</button>
          </span>
          <label class="ctl">Component <select name="component" aria-label="Component to patch">${components}</select></label>
        </div>
      </form>
      <p class="cz-metrics" aria-live="polite"></p>
      <div class="cz-maps"></div>
      <section class="cz-detail" aria-label="The chosen head" hidden></section>
      <section class="cz-attr" aria-label="Direct logit attribution"></section>`;
    host.append(this.root);
    const form = (this.form = this.root.querySelector(".cz-form"));
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      this.submit();
    });
    for (const ta of form.querySelectorAll("textarea"))
      ta.addEventListener("keydown", (e) => {
        if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
          e.preventDefault();
          this.submit();
        }
      });
    // every choice applies the whole form: the prompts as typed go with it
    for (const name of ["answer", "foil"]) {
      form.elements[name].addEventListener("change", () => {
        form.elements[name + "Typed"].value = "";
        this.submit();
      });
    }
    for (const b of form.querySelectorAll("[data-method]")) b.addEventListener("click", () => this.submit({ method: b.dataset.method }));
    form.elements.component.addEventListener("change", () => this.submit({ component: form.elements.component.value }));
    this.root.querySelector(".cz-attr").addEventListener("click", (e) => {
      const b = e.target.closest("button[data-layer]");
      if (b) this.open(+b.dataset.layer, +b.dataset.head, b.dataset.group == null ? null : +b.dataset.group);
    });
  }

  unmount() {
    hideTooltip();
    for (const m of [...this.maps, ...this.detailMaps]) m.destroy();
    this.root?.remove();
  }

  /** The form's prompts and tokens (and `extra` keys) into the state (a clean prompt equal to the analysed text follows it: ""). */
  submit(extra = {}) {
    const f = this.form.elements;
    const clean = f.clean.value;
    // a new target: the choices listed were the old position's predictions, so the new ones' top two go (typed ones stay)
    const retarget = this.translator && f.target.value !== this.params.settings.ctarget;
    const pick = (name) => f[name + "Typed"].value || (retarget ? "" : f[name].value);
    const target = this.translator ? { ctarget: f.target.value } : {};
    this.ctx.select({ clean: clean === this.params.text ? "" : clean, corrupted: f.corrupted.value, answer: pick("answer"), foil: pick("foil"), ...target, ...extra });
  }

  /** Open head (l, h)'s detail (an encoder-decoder's of group index g) and make it the page's chosen head. */
  open(l, h, g = null) {
    const s = this.params.selection.sender;
    if (s && s[0] === l && s[1] === h && (s[2] ?? null) === g) this.root.querySelector(".cz-detail")?.scrollIntoView({ block: "nearest" });
    this.ctx.select({ sender: g == null ? [l, h] : [l, h, g], layer: l, head: h });
  }

  /** The prompts as the view reads them, and the answer and foil (their text, and what the routes are sent). */
  inputs() {
    const { settings } = this.params;
    const clean = settings.clean || this.params.text;
    const corrupted = settings.corrupted;
    const answer = settings.answer || this.top[0]?.text || "";
    const foil = settings.foil || this.top.find((t) => t.text !== answer)?.text || "";
    // a token of the list goes as its id; a typed one as its text (the server tokenises it)
    const arg = (text) => this.top.find((t) => t.text === text)?.id ?? text;
    const target = this.translator ? settings.ctarget : null; // an encoder-decoder's ("" none); null: a decoder
    return { clean, corrupted, answer, foil, target, answerArg: arg(answer), foilArg: arg(foil), differs: !!corrupted && corrupted !== clean };
  }

  /** The state into the form; a prompt is rewritten only when the state's changed (an edit not applied yet stays). */
  syncForm(clean, corrupted) {
    const f = this.form.elements;
    const { method, component } = this.params.settings;
    const shown = { clean, corrupted: corrupted || clean }; // the corrupted box starts from the clean prompt: change a few words
    if (this.translator) shown.target = this.params.settings.ctarget;
    for (const k of Object.keys(shown)) if (document.activeElement !== f[k] && shown[k] !== this.shown?.[k]) f[k].value = shown[k];
    this.shown = shown;
    for (const b of this.form.querySelectorAll("[data-method]")) b.setAttribute("aria-checked", String(b.dataset.method === method));
    f.component.value = component;
  }

  fillChoices(answer, foil) {
    const f = this.form.elements;
    for (const [name, value] of [["answer", answer], ["foil", foil]]) {
      const sel = f[name];
      const listed = this.top.some((t) => t.text === value);
      const opts = this.top.map((t) => new Option(`“${visible(t.text)}” ${pct(t.prob)}`, t.text));
      if (value && !listed) opts.push(new Option(`“${visible(value)}” (typed)`, value));
      sel.replaceChildren(...opts);
      sel.value = value;
      const typed = f[name + "Typed"];
      if (document.activeElement !== typed) typed.value = listed ? "" : value;
    }
  }

  async render(params, changed, isCurrent = () => true) {
    this.params = params;
    const { settings } = params;
    this.translator = isTranslator(params.model);
    this.root.querySelector(".cz-target").hidden = !this.translator;
    const word = this.translator ? "source" : "prompt";
    this.root.querySelector('label[for="cz-clean"]').textContent = `Clean ${word}`;
    this.root.querySelector('label[for="cz-corrupted"]').firstChild.textContent = `Corrupted ${word} `;
    const first = this.inputs();
    this.syncForm(first.clean, first.corrupted);
    const what = settings.component === "heads" ? (this.translator ? "head's output (the encoder's, the decoder's and the cross-attention's heads)" : "head's output")
      : settings.component === "residual" ? `block's residual stream at one position${this.translator ? " (the encoder's source positions, the decoder's target positions)" : ""}`
      : this.translator ? "block's self-attention, cross-attention or MLP output at one position" : "block's attention or MLP output at one position";
    this.ctx.setCaption(
      `<b>Causes</b>: each ${what} ` +
        `is patched from the clean run into the corrupted one, and logit(answer) − logit(foil) read at the ${this.translator ? "target's" : ""} last position, normalised: <b>0</b> = the corrupted run, <b>1</b> = the clean run. ` +
        (settings.method === "attribution" ? "Attribution: first-order estimates (one forward, one backward pass). " : "Exact: one patched run per cell. ") +
        (this.translator ? "Click a head for its attention on both sources, its direct logit attribution and its paths." : "Click a head for its attention on both prompts, its direct logit attribution and its paths."),
    );
    // only the chosen head moved (or the page's layer / head with it): the mark and the detail
    if (this.patch !== null && changed && [...changed].every((k) => ["sender", "layer", "head"].includes(k))) {
      this.markChosen();
      await this.showDetail(isCurrent);
      return isCurrent();
    }
    let next;
    try {
      next = await this.ctx.track(fetchNextTokens(first.clean, TOP_K, first.target));
    } catch (err) {
      if (!isCurrent()) return false;
      this.ctx.showError(err, "The clean prompt's predictions (/logits)");
      return false;
    }
    if (!isCurrent()) return false;
    // after the prompt's last token; an encoder-decoder's without a target: at its first target position
    this.top = (first.target === "" ? next.positions?.[0] : next.positions?.[next.positions.length - 1])?.top ?? [];
    const inp = this.inputs();
    this.fillChoices(inp.answer, inp.foil);
    const patching = inp.differs && inp.answer && inp.foil
      ? this.ctx.track(fetchPatch({ clean: inp.clean, corrupted: inp.corrupted, answer: inp.answerArg, foil: inp.foilArg, component: settings.component, method: settings.method, target: inp.target }))
      : Promise.resolve(null);
    const attributing = inp.answer && inp.foil ? this.ctx.track(fetchLogitAttribution({ text: inp.clean, answer: inp.answerArg, foil: inp.foilArg, target: inp.target })) : Promise.resolve(null);
    const [patch, attr] = await Promise.allSettled([patching, attributing]);
    if (!isCurrent()) return false;
    if (patch.status === "rejected") this.ctx.showError(patch.reason, "Patching (/patch)");
    if (attr.status === "rejected") this.ctx.showError(attr.reason, "Logit attribution (/logit-attribution)");
    this.patch = patch.value ?? null;
    this.attr = attr.value ?? null;
    this.inp = inp;
    const t0 = performance.now();
    this.drawMaps();
    this.drawTokens();
    this.drawBars();
    const cells = this.maps.reduce((n, m) => n + (m.model ? m.model.rows * m.model.cols : 0), 0);
    window.__attnlens.perf.causes = { cells, drawMs: performance.now() - t0 };
    this.root.dataset.state = this.patch ? "done" : inp.differs ? "error" : "waiting";
    await this.showDetail(isCurrent);
    return isCurrent();
  }

  /** The component's figure(s): one layers × heads map, or layers × positions (attention and MLP side by side). */
  drawMaps() {
    const host = this.root.querySelector(".cz-maps");
    for (const m of this.maps) m.destroy();
    this.maps = [];
    host.replaceChildren();
    const p = this.patch;
    const metrics = this.root.querySelector(".cz-metrics");
    if (!p) {
      this.ctx.setLegend(null);
      metrics.innerHTML = this.inp.differs
        ? ""
        : `Change a few tokens of the corrupted ${this.translator ? "source" : "prompt"} (keep its length in tokens), choose the answer and the foil, and press <b>Patch</b>.`;
      return;
    }
    const a = p.answer?.text ?? this.inp.answer;
    const f = p.foil?.text ?? this.inp.foil;
    const same = !(p.clean_metric - p.corrupted_metric);
    metrics.innerHTML =
      `logit(“${escapeHTML(visible(a))}”) − logit(“${escapeHTML(visible(f))}”) at ${p.target_tokens ? "target " : ""}#${p.position}: clean <b data-clean>${num(p.clean_metric)}</b>, corrupted <b data-corrupted>${num(p.corrupted_metric)}</b>` +
      ` · ${escapeHTML(p.method)} · ${escapeHTML(COMPONENT_LABELS[this.params.settings.component] ?? p.component)}` +
      (same ? ' · <span class="cz-warn">the two runs give the same value: nothing to normalise; choose another answer, foil or corruption</span>' : "");
    const figures = this.figures(p);
    let m = 1;
    const datas = figures.map((f) => normalise(f.rows, p.clean_metric, p.corrupted_metric));
    for (const d of datas) m = Math.max(m, extent(d));
    const dcmap = this.params.settings.dcmap;
    const wrap = document.createElement("div");
    wrap.className = figures.length > 2 ? "cz-triple" : figures.length > 1 ? "cz-pair" : "cz-single";
    host.append(wrap);
    // every figure in its place first: a map fits the width its column has once all are there
    const figs = figures.map(({ name, caption }) => {
      const fig = document.createElement("figure");
      fig.className = "cz-map";
      fig.dataset.part = name;
      fig.innerHTML = `<figcaption>${escapeHTML(caption)}</figcaption><div class="cz-canvas"></div>`;
      wrap.append(fig);
      return fig;
    });
    figures.forEach(({ rows, caption, tokens, group }, i) => {
      const fig = figs[i];
      const heads = p.component === "heads";
      const R = rows.length;
      const C = rows[0]?.length ?? 0;
      const hm = new MarkedHeatmap(fig.querySelector(".cz-canvas"), {
        maxCell: heads ? 34 : 22,
        maxHeight: heads ? 560 : 420, // SmolLM2's 30 layers: cells of 18 px, not a page of them
        minWidth: 120,
        labelMax: 8,
        onHover: (h) => this.hoverCell(h, rows, datas[i], heads, tokens, caption),
        onCellClick: ({ row, col }) => heads && col != null && this.open(row, col, group),
      });
      hm.group = group; // an encoder-decoder's group index (null: a decoder's one map)
      hm.overlay.setAttribute(
        "aria-label",
        `Normalised effect of patching ${heads ? `each head (${caption})` : `the ${caption} at each layer and position`}: ${R} layers down, ${C} ${heads ? "heads" : "positions"} across, 0 the corrupted run, 1 the clean run. ` +
          `Arrow keys move between cells${heads ? ", Enter opens a head" : ""}.`,
      );
      hm.set({
        data: datas[i],
        rows: R,
        cols: C,
        rowLabels: Array.from({ length: R }, (_, l) => `L${l}`),
        colLabels: heads ? Array.from({ length: C }, (_, h) => `H${h}`) : tokens.slice(0, C),
        plainRowLabels: true,
        cmap: dcmap,
        vmin: -m,
        vmax: m,
        causal: false,
        rowTitle: "layer →",
        colTitle: heads ? "head →" : "position →",
      });
      this.maps.push(hm);
    });
    this.legend = { cmap: dcmap, vmin: -m, vmax: m, gamma: 1, label: "normalised effect: 0 = corrupted run, 1 = clean run", lowNote: "← away from the clean run", highNote: "restores the clean run →" };
    this.ctx.setLegend(this.legend);
    this.markChosen();
  }

  /**
   * The figures of a /patch answer: {name, rows ([L][H] or [L][positions]), caption, tokens (the
   * columns' positions), group (an encoder-decoder's group index, null otherwise)}. A decoder's: one
   * map, or attention and MLP side by side; an encoder-decoder's: one per group, or per stack and
   * sub-layer (its encoder's over the source, its decoder's over the target).
   */
  figures(p) {
    const source = (p.clean_tokens ?? []).map((t) => t.text);
    if (!p.target_tokens) {
      if (p.component === "layers")
        return [
          { name: "attention", rows: p.values.attention, caption: "attention output", tokens: source, group: null },
          { name: "mlp", rows: p.values.mlp, caption: "MLP output", tokens: source, group: null },
        ];
      return [{ name: p.component, rows: p.values, caption: p.component === "heads" ? "heads" : "residual stream (block input)", tokens: source, group: null }];
    }
    const target = p.target_tokens.map((t, i) => (i ? t.text : START_LABEL));
    const along = (stack) => (stack === "encoder" ? source : target);
    if (p.component === "heads")
      return GROUPS.map((g, i) => ({ name: g, rows: p.values[g], caption: `${GROUP_LABELS[g]} heads`, tokens: null, group: i }));
    if (p.component === "residual")
      return ["encoder", "decoder"].map((st) => ({ name: st, rows: p.values[st], caption: `${st} residual stream (${st === "encoder" ? "source" : "target"} positions)`, tokens: along(st), group: null }));
    const names = { attention: "self-attention output", cross: "cross-attention output", mlp: "MLP output" };
    return ["encoder", "decoder"].flatMap((st) =>
      Object.keys(p.values[st]).map((k) => ({ name: `${st}.${k}`, rows: p.values[st][k], caption: `${st} ${names[k]}`, tokens: along(st), group: null })),
    );
  }

  hoverCell(h, rows, data, heads, tokens, what) {
    if (!h) return hideTooltip();
    const raw = rows[h.row]?.[h.col];
    const v = data[h.row * (rows[0]?.length ?? 0) + h.col];
    const groupName = this.translator && heads ? `${escapeHTML(what)} · ` : "";
    const where = heads ? `${groupName}layer ${h.row} · head ${h.col}` : `layer ${h.row} · ${escapeHTML(what)} at ${escapeHTML(quoted(tokens[h.col] ?? "", h.col))}`;
    showTooltip(
      `<div class="tt-cell"><b>${where}</b></div>` +
        `<div class="tt-row"><span>normalised</span><b>${num(v)}</b></div><div class="tt-row"><span>logit difference</span><b>${num(raw)}</b></div>` +
        (heads ? `<div class="tt-muted">click: this head's maps, attribution and paths</div>` : ""),
      h.x,
      h.y,
    );
  }

  markChosen() {
    const s = this.params.selection.sender;
    const group = s?.[2] ?? null; // an encoder-decoder's group index
    for (const hm of this.maps) {
      hm.marked = s && this.patch?.component === "heads" && (hm.group ?? null) === group ? { row: s[0], col: s[1] } : null;
      hm.drawOverlay();
    }
    for (const b of this.root.querySelectorAll(".cz-attr button[data-layer]"))
      b.setAttribute("aria-pressed", String(!!s && +b.dataset.layer === s[0] && +b.dataset.head === s[1] && (b.dataset.group == null ? null : +b.dataset.group) === group));
  }

  /** Both prompts' tokens, the positions where they differ marked. */
  drawTokens() {
    const p = this.patch;
    const differing = new Set(p?.differing ?? []);
    for (const side of ["clean", "corrupted"]) {
      const host = this.root.querySelector(`.cz-tokens[data-side="${side}"]`);
      const toks = p?.[`${side}_tokens`];
      if (!toks) {
        host.replaceChildren();
        continue;
      }
      host.innerHTML = toks
        .map((t, i) => (differing.has(i) ? `<mark class="cz-tok diff" data-pos="${i}" title="#${i}: differs between the prompts">${escapeHTML(visible(t.text))}</mark>` : `<span class="cz-tok" data-pos="${i}">${escapeHTML(visible(t.text))}</span>`))
        .join("");
      host.setAttribute("aria-label", `The ${side} ${this.translator ? "source" : "prompt"}'s ${toks.length} tokens; ${differing.size} differ${differing.size === 1 ? "s" : ""}: positions ${[...differing].join(", ") || "none"}`);
    }
    const target = this.root.querySelector('.cz-tokens[data-side="target"]');
    const toks = p?.target_tokens;
    if (!toks) {
      target.replaceChildren();
      return;
    }
    target.innerHTML = toks
      .map((t, i) => {
        const text = escapeHTML(i ? visible(t.text) : START_LABEL);
        return i === p.position ? `<mark class="cz-tok diff" data-pos="${i}" title="#${i}: the metric is read here">${text}</mark>` : `<span class="cz-tok" data-pos="${i}">${text}</span>`;
      })
      .join("");
    target.setAttribute("aria-label", `The target's ${toks.length} tokens, the start token first; the metric is read at position ${p.position}`);
  }

  /** The heads and MLPs with the largest direct effect on the logit difference, ranked by size. */
  drawBars() {
    const host = this.root.querySelector(".cz-attr");
    const a = this.attr;
    if (!a) {
      host.replaceChildren();
      return;
    }
    const items = [];
    // a decoder's heads [L][H]; an encoder-decoder's {decoder, cross} (its encoder writes no logit directly)
    const grids = Array.isArray(a.heads) ? [[null, a.heads ?? []]] : Object.entries(a.heads ?? {}).map(([g, rows]) => [GROUPS.indexOf(g), rows]);
    for (const [g, rows] of grids) rows.forEach((row, l) => row.forEach((v, h) => items.push({ v, l, h, g })));
    (a.mlps ?? []).forEach((v, l) => items.push({ v, l, h: null, g: null }));
    items.sort((x, y) => Math.abs(y.v) - Math.abs(x.v) || x.l - y.l);
    const shown = items.slice(0, BARS);
    const max = Math.max(1e-9, ...shown.map((x) => Math.abs(x.v)));
    const rows = shown
      .map(({ v, l, h, g }) => {
        const w = ((50 * Math.abs(v)) / max).toFixed(1);
        const prefix = g == null ? "" : g === 2 ? "cross " : "self ";
        const name = h == null ? `MLP ${l}` : `${prefix}L${l} H${h}`;
        const group = g == null ? "" : ` data-group="${g}"`;
        const label = h == null
          ? `<span class="cz-bar-name">${name}</span>`
          : `<button type="button" class="cz-bar-name" data-layer="${l}" data-head="${h}"${group} aria-label="${g == null ? "" : GROUP_LABELS[GROUPS[g]] + " "}layer ${l}, head ${h}: ${signed(v)}; open this head">${name}</button>`;
        return `<li class="cz-bar-row" data-kind="${h == null ? "mlp" : "head"}">${label}<span class="cz-track" aria-hidden="true"><span class="cz-fill ${v < 0 ? "neg" : "pos"}" style="width:${w}%"></span></span><span class="cz-num">${signed(v)}</span></li>`;
      })
      .join("");
    const ans = a.answer?.text ?? this.inp.answer;
    const foil = a.foil?.text ?? this.inp.foil;
    host.innerHTML =
      `<h3>Direct logit attribution <span class="hint">what each ${this.translator ? "decoder and cross-attention head and decoder MLP" : "head and MLP"} writes straight into logit(“${escapeHTML(visible(ans))}”) − logit(“${escapeHTML(visible(foil))}”) on the clean ${this.translator ? "source" : "prompt"}; the ${shown.length} largest of ${items.length}</span></h3>` +
      `<p class="cz-attr-sum">logit difference <b data-logit-difference>${num(a.logit_difference)}</b> = embedding ${signed(a.embedding)} + heads + MLPs + the rest ${signed(a.other)}</p>` +
      `<ol class="cz-bars">${rows}</ol>`;
    this.markChosen();
  }

  /** The chosen head: its attention on both prompts, its values and its paths. */
  async showDetail(isCurrent) {
    const box = this.root.querySelector(".cz-detail");
    const s = this.params.selection.sender;
    if (!s || !this.inp) {
      box.hidden = true;
      this.detailKey = "";
      return;
    }
    const [l, h] = s;
    const group = this.translator ? GROUPS[s[2] ?? 2] ?? "cross" : null; // an encoder-decoder's head is in a group
    const inp = this.inp;
    const { settings } = this.params;
    const key = JSON.stringify([inp.clean, inp.corrupted, inp.target, inp.answer, inp.foil, l, h, group, settings.cmap, settings.dcmap, !!this.patch, !!this.attr]);
    if (key === this.detailKey) return;
    this.detailKey = key;
    for (const m of this.detailMaps) m.destroy();
    this.detailMaps = [];
    const p = this.patch;
    const patched = p?.component === "heads" ? (group ? p.values[group] : p.values)?.[l]?.[h] : undefined;
    const effect = patched === undefined ? null : normalise([[patched ?? null]], p.clean_metric, p.corrupted_metric)[0];
    const heads = this.attr?.heads;
    const dla = group ? heads?.[group]?.[l]?.[h] : heads?.[l]?.[h];
    const noDla = group === "encoder" ? ' <span class="hint">(the encoder writes no logit directly: it reaches them through the cross heads)</span>' : "";
    box.hidden = false;
    box.dataset.state = "loading";
    box.dataset.head = group ? `${group}.${l}.${h}` : `${l}.${h}`;
    const title = group ? `${GROUP_LABELS[group][0].toUpperCase()}${GROUP_LABELS[group].slice(1)}: layer ${l}, head ${h}` : `Layer ${l}, head ${h}`;
    const sides = group ? ["clean source", "corrupted source"] : ["clean", "corrupted"];
    box.innerHTML = `
      <div class="cz-detail-head"><h3>${title}</h3><button type="button" class="btn small ghost cz-close" aria-label="Close the head's detail">✕</button></div>
      <dl class="cz-values">
        <div><dt>patching effect (normalised)</dt><dd data-effect>${effect == null ? '— <span class="hint">(patch the heads to see it)</span>' : num(effect)}</dd></div>
        <div><dt>direct logit attribution</dt><dd data-dla>${signed(dla)}${noDla}</dd></div>
      </dl>
      <h4>Its attention</h4>
      <div class="cz-pair cz-att"><figure data-side="clean"><figcaption>${sides[0]}</figcaption><div class="cz-canvas"></div></figure><figure data-side="corrupted"><figcaption>${sides[1]}</figcaption><div class="cz-canvas"></div></figure></div>
      <h4>Its paths <span class="hint">its clean write patched only into each later head's query, key or value input (normalised as above)</span></h4>
      <div class="cz-paths"></div>`;
    box.querySelector(".cz-close").addEventListener("click", () => this.ctx.select({ sender: null }));
    const map = (text) => (group ? this.groupMap(text, group, l, h) : this.headMap(text, l, h));
    const maps = Promise.allSettled([inp.clean, inp.differs ? inp.corrupted : null].map((text) => (text ? map(text) : Promise.resolve(null))));
    const paths = inp.differs && inp.answer && inp.foil
      ? this.ctx.track(fetchPatch({ clean: inp.clean, corrupted: inp.corrupted, answer: inp.answerArg, foil: inp.foilArg, component: "paths", method: "exact", sender: group ? [l, h, group] : [l, h], target: inp.target }))
      : Promise.resolve(null);
    const [[clean, corrupted], path] = await Promise.all([maps, paths.then((v) => ({ v }), (err) => ({ err }))]);
    if (!isCurrent() || this.detailKey !== key) return;
    [clean, corrupted].forEach((r, i) => {
      const fig = box.querySelectorAll(".cz-att figure")[i];
      if (r.status === "rejected") fig.querySelector(".cz-canvas").innerHTML = `<p class="hint">${escapeHTML(r.reason?.message ?? String(r.reason))}</p>`;
      else if (!r.value) fig.querySelector(".cz-canvas").innerHTML = '<p class="hint">no corrupted prompt yet</p>';
      else this.drawHeadMap(fig.querySelector(".cz-canvas"), r.value, l, h, i ? "corrupted" : "clean");
    });
    const host = box.querySelector(".cz-paths");
    if (path.err) host.innerHTML = `<p class="hint">Could not patch the paths: ${escapeHTML(path.err.message)}</p>`;
    else if (!path.v) host.innerHTML = '<p class="hint">Paths need a corrupted prompt.</p>';
    else this.drawPaths(host, path.v);
    box.dataset.state = "done";
  }

  /** The attention of head (l, h) over `text`, with its tokens ({data, T, tokens, causal}). */
  async headMap(text, l, h) {
    const att = this.params.attention;
    let set = att && att.text === text && !att.long ? att : this.sets.get(text);
    if (!set) {
      set = new AttentionSet(text, this.params.model);
      this.sets.set(text, set);
      while (this.sets.size > KEEP_SETS) this.sets.delete(this.sets.keys().next().value);
    }
    await this.ctx.track(set.ensure([l]));
    const labels = set.tokens.map((t) => t.text);
    return { data: set.head(l, h), rows: set.T, cols: set.T, rowLabels: labels, colLabels: labels, causal: set.causal };
  }

  /**
   * An encoder-decoder's head (l, h) of `group` over source `text` read with the patched target (the
   * answer's target tokens; none: the model's own translation), as headMap gives it.
   */
  async groupMap(text, group, l, h) {
    const targetIds = (this.patch?.target_tokens ?? []).slice(1).map((t) => t.id);
    const set = await this.ctx.track(translationFor({ text, targetIds: targetIds.length ? targetIds : null }, this.params.model.name));
    const source = set.source.map((t) => t.text);
    const target = set.target.map((t) => t.text);
    const rows = group === "encoder" ? source : target; // queries: the encoder's over the source, the rest over the target
    const cols = group === "decoder" ? target : source; // keys: the decoder's over the target, the rest over the source
    return { data: set.head(group, l, h), rows: rows.length, cols: cols.length, rowLabels: rows, colLabels: cols, causal: group === "decoder" };
  }

  drawHeadMap(el, m, l, h, side) {
    let vmax = 0;
    for (const v of m.data) if (v > vmax) vmax = v;
    const hm = new Heatmap(el, {
      maxCell: 14,
      minWidth: 120,
      labelMax: 6,
      onHover: (x) => {
        if (!x || x.masked) return hideTooltip();
        showTooltip(`<div class="tt-cell"><span class="tt-tok">${escapeHTML(quoted(m.rowLabels[x.row], x.row))}</span> → <span class="tt-tok">${escapeHTML(quoted(m.colLabels[x.col], x.col))}</span>: <b>${num(x.value)}</b></div>`, x.x, x.y);
      },
    });
    hm.overlay.setAttribute("aria-label", `Attention of layer ${l}, head ${h} on the ${side} ${this.translator ? "source" : "prompt"}: ${m.rows} queries down, ${m.cols} keys across`);
    hm.set({ data: m.data, rows: m.rows, cols: m.cols, rowLabels: m.rowLabels, colLabels: m.colLabels, cmap: this.params.settings.cmap, vmin: 0, vmax: vmax || 1, causal: m.causal, rowTitle: "query →", colTitle: "key →" });
    this.detailMaps.push(hm);
  }

  /**
   * The q, k and v paths from the chosen head: a layers × heads map per receiver input (null where
   * the sender has no direct path: masked). An encoder-decoder's come by receiver group; only the
   * inputs its sender reaches are drawn (an encoder head: later encoder heads and the cross heads'
   * keys and values; a decoder or cross head: later decoder heads and cross heads' queries).
   */
  drawPaths(host, p) {
    const kinds = { q: "query", k: "key", v: "value" };
    const grids = (this.translator ? GROUPS.flatMap((g) => ["q", "k", "v"].map((k) => [`${g}.${k}`, p.values?.[g]?.[k], `${GROUP_LABELS[g]} ${kinds[k]} (${k})`])) : ["q", "k", "v"].map((k) => [k, p.values?.[k], `${kinds[k]} (${k})`]))
      .filter(([, rows]) => rows && rows.some((row) => row.some((v) => v != null)));
    if (!grids.length) {
      host.innerHTML = `<p class="hint">No head reads this one directly: ${this.translator ? "it is in the last layer that reads its stream" : `layer ${p.sender?.layer ?? ""} is the last`}.</p>`;
      return;
    }
    const datas = grids.map(([, rows]) => normalise(rows, p.clean_metric, p.corrupted_metric));
    const m = Math.max(1, ...datas.map(extent));
    host.innerHTML = `<div class="cz-triple">${grids.map(([k, , caption]) => `<figure data-path="${k}"><figcaption>${escapeHTML(caption)}</figcaption><div class="cz-canvas"></div></figure>`).join("")}</div>`;
    grids.forEach(([k, rows], i) => {
      const hm = new Heatmap(host.querySelector(`[data-path="${k}"] .cz-canvas`), {
        maxCell: 14,
        minWidth: 100,
        labelMax: 4,
        onHover: (x) => {
          if (!x) return hideTooltip();
          const v = datas[i][x.row * rows[0].length + x.col];
          showTooltip(`<div class="tt-cell"><b>→ layer ${x.row} · head ${x.col} (${k})</b></div><div class="tt-row"><span>normalised</span><b>${v === v ? num(v) : "— (not after the sender)"}</b></div>`, x.x, x.y);
        },
      });
      hm.overlay.setAttribute("aria-label", `Path patching into each later head's ${k} input: layers down, heads across`);
      hm.set({
        data: datas[i],
        rows: rows.length,
        cols: rows[0]?.length ?? 0,
        rowLabels: rows.map((_, l) => `L${l}`),
        colLabels: (rows[0] ?? []).map((_, h) => `H${h}`),
        plainRowLabels: true,
        cmap: this.params.settings.dcmap,
        vmin: -m,
        vmax: m,
        causal: false,
      });
      this.detailMaps.push(hm);
    });
  }

  exportPicture(scale = 1) {
    const hm = this.maps[0];
    if (!hm?.model) return null;
    return { canvas: hm.exportPicture(scale), title: `activation patching (${this.patch.method}): ${COMPONENT_LABELS[this.params.settings.component] ?? this.patch.component}`, legend: this.legend };
  }

  exportData() {
    if (!this.patch && !this.attr) return null;
    const { clean, corrupted, answer, foil, target } = this.inp ?? {};
    return { title: "causes", clean, corrupted, answer, foil, ...(target != null ? { target } : {}), patch: this.patch, logit_attribution: this.attr };
  }
}
