// Generation view: for one generated token, what the position that produced it attended to
// (that position is the query: the token before it), per layer and head. A slider scrubs
// through the steps; while a generation streams in, the view follows the newest token.

import { Heatmap } from "../heatmap.js";
import { removeSink, maxOf } from "../attention.js";
import { colourScale } from "../scales.js";
import { css, luminance } from "../colormap.js";
import { quoted, escapeHTML, visible } from "../tokens.js";
import { showTooltip, hideTooltip } from "../tooltip.js";

export class GenView {
  constructor(ctx) {
    this.ctx = ctx;
    this.playing = null;
    this.result = null;
    this.params = null;
  }

  mount(host) {
    this.root = document.createElement("div");
    this.root.className = "gen-view";
    this.root.innerHTML = `
      <div class="gen-controls">
        <button type="button" class="btn small" data-act="prev" aria-label="Previous step">◀</button>
        <button type="button" class="btn small" data-act="play" aria-label="Play the generation">▶ Play</button>
        <button type="button" class="btn small" data-act="next" aria-label="Next step">▶</button>
        <label class="slider-label">Step <input type="range" min="0" max="0" value="0" id="gen-step" aria-describedby="gen-step-text"></label>
        <span id="gen-step-text" class="gen-step-text"></span>
      </div>
      <div class="gen-strip" aria-live="polite"></div>
      <div class="gen-heat"></div>`;
    host.append(this.root);
    this.slider = this.root.querySelector("#gen-step");
    this.stepText = this.root.querySelector("#gen-step-text");
    this.strip = this.root.querySelector(".gen-strip");
    this.slider.addEventListener("input", () => this.ctx.select({ step: +this.slider.value }));
    this.root.querySelector('[data-act="prev"]').addEventListener("click", () => this.go(-1));
    this.root.querySelector('[data-act="next"]').addEventListener("click", () => this.go(1));
    this.playBtn = this.root.querySelector('[data-act="play"]');
    this.playBtn.addEventListener("click", () => this.togglePlay());
    this.heatmap = new Heatmap(this.root.querySelector(".gen-heat"), {
      maxCell: 22,
      minCell: 6,
      minRowHeight: 14, // a row per head stays legible however many keys there are
      onHover: (h) => this.onHover(h),
      onCellClick: ({ row }) => {
        const H = this.result.H;
        this.ctx.select({ layer: Math.floor(row / H), head: row % H });
      },
      onZoom: (zoom) => this.ctx.select({ zoom }),
    });
    this.heatmap.overlay.setAttribute("aria-label", "Attention of the position that produced the selected token, per layer and head; click a row to follow that head in the strip above");
  }

  unmount() {
    this.stop();
    hideTooltip();
    this.root?.remove();
  }

  steps() {
    return this.params?.generation?.tokens.length || 0;
  }

  go(d) {
    const n = this.steps();
    if (n) this.ctx.select({ step: Math.max(0, Math.min(n - 1, this.params.selection.step + d)) });
  }

  togglePlay() {
    if (this.playing) return this.stop();
    const n = this.steps();
    if (!n) return;
    if (this.params.selection.step >= n - 1) this.ctx.select({ step: 0 });
    this.playBtn.textContent = "❚❚ Pause";
    this.playing = setInterval(() => (this.params.selection.step >= this.steps() - 1 ? this.stop() : this.go(1)), 350);
  }

  stop() {
    clearInterval(this.playing);
    this.playing = null;
    if (this.playBtn) this.playBtn.textContent = "▶ Play";
  }

  /** Nothing to draw: a note instead, and no caption, legend or old picture. */
  blank(note) {
    this.root.classList.add("empty");
    this.strip.innerHTML = `<p class="empty-note">${note}</p>`;
    this.stripParts = null;
    this.stepText.textContent = "";
    this.heatmap.clear();
    this.result = null;
    this.ctx.setCaption("");
    this.ctx.setLegend(null);
    return false;
  }

  async render(params, changed, isCurrent = () => true) {
    this.params = params;
    const gen = params.generation;
    if (!gen || !gen.tokens.length) {
      return this.blank(params.live ? "Waiting for the first token…" : "Generate some text first: this view shows, for each generated token, which earlier tokens it attended to.");
    }
    if (!gen.recorded) return this.blank("The last generation did not record attention. Tick “Record attention while generating” and generate again.");
    const { settings, selection } = params;
    const n = gen.tokens.length;
    const step = Math.max(0, Math.min(n - 1, selection.step));
    this.root.classList.remove("empty");
    this.slider.max = String(n - 1);
    this.slider.value = String(step);
    if (gen.analysis) {
      await gen.analysis.ensure([...Array(gen.analysis.nLayers).keys()]);
      if (!isCurrent()) return false;
    }
    const att = gen.attentionAt(step); // [L][H][S]
    // a family whose steps read another sequence (an encoder-decoder): its rows are cross-attention
    // over the source (the prompt), not earlier tokens
    const cross = params.model.capabilities.has("step-cross");
    const L = att.length;
    const H = att[0].length;
    const S = att[0][0].length;
    const P = gen.promptLength;
    const keys = gen.keyTokens().slice(0, S);
    while (keys.length < S) keys.push({ id: -1, text: "?" });
    const target = gen.tokens[step];
    let data = new Float32Array(L * H * S);
    for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) data.set(att[l][h], (l * H + h) * S);
    if (settings.sink) data = removeSink(data, S, S);
    const rowLabels = [];
    for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) rowLabels.push(`L${l} · H${h}`);
    const sc = colourScale(data, S, settings.scale, { skipFirstRow: false });
    this.result = { data, rows: L * H, cols: S, keys, L, H, S, P, step, target };
    this.heatmap.opts.zoom = settings.zoom;
    this.heatmap.set({
      data: sc.data,
      rows: L * H,
      cols: S,
      rowLabels,
      plainRowLabels: true,
      colLabels: keys.map((t) => t.text),
      cmap: settings.cmap,
      vmin: sc.vmin,
      vmax: sc.vmax,
      gamma: sc.gamma,
      boundary: P < S ? P : null,
      rowTitle: "layer · head",
      colTitle: cross ? "source tokens →" : "earlier tokens (keys) →",
    });
    const sel = Math.min(selection.layer, L - 1) * H + Math.min(selection.head, H - 1);
    this.heatmap.setPinned([sel]);
    this.legend = { cmap: settings.cmap, vmin: sc.vmin, vmax: sc.vmax, gamma: sc.gamma, label: sc.label };
    this.ctx.setLegend(this.legend);
    const query = keys[S - 1];
    this.stepText.innerHTML = cross
      ? `step ${step + 1} / ${n}${params.live ? " (arriving…)" : ""}: writing <span class="tok-inline">${escapeHTML(visible(target.text))}</span>, ` +
        `reading the ${S} source tokens`
      : `step ${step + 1} / ${n}${params.live ? " (arriving…)" : ""}: query ${escapeHTML(quoted(query, S - 1))} predicting ` +
        `<span class="tok-inline">${escapeHTML(visible(target.text))}</span> from ${S} earlier tokens (${P} in the prompt)`;
    this.drawStrip(data.subarray(sel * S, (sel + 1) * S), sel, keys, P, target, settings.cmap);
    this.ctx.setCaption(cross
      ? `Each row is one head: the cross-attention of the decoder step that wrote generated token ${step + 1}, over the source (the prompt's tokens). The strip above shows the outlined row.`
      : `Each row is one head: the attention of position ${S - 1} (the query, ${escapeHTML(quoted(query))}) when it produced generated token ${step + 1}; generated keys are right of the line. The strip above shows the outlined row (click another row to follow it).${settings.sink ? " First-token column hidden, rows renormalised." : ""}`,
    );
    return true;
  }

  /**
   * The earlier tokens as text, tinted by the selected head's weights. The spans are kept from
   * one step to the next (a stream adds a step per token): only new ones are made, and the
   * others get their new colours, which costs no layout.
   */
  drawStrip(row, sel, keys, P, target, cmap) {
    const H = this.result.H;
    const rmax = maxOf(row) || 1;
    if (!this.stripParts || !this.strip.contains(this.stripParts.label)) {
      const label = document.createElement("span");
      label.className = "strip-label";
      const arrow = document.createElement("span");
      arrow.className = "strip-target";
      this.stripParts = { label, arrow, toks: [] };
      this.strip.replaceChildren(label, arrow);
    }
    const { label, arrow, toks } = this.stripParts;
    label.textContent = `L${Math.floor(sel / H)} H${sel % H}:`;
    while (toks.length > keys.length) toks.pop().remove();
    const fresh = document.createDocumentFragment();
    for (let j = 0; j < keys.length; j++) {
      let s = toks[j];
      if (!s) {
        s = toks[j] = document.createElement("span");
        fresh.append(s);
      }
      const text = visible(keys[j].text);
      if (s.textContent !== text) s.textContent = text;
      const v = row[j];
      const t = v === v ? v / rmax : 0;
      s.className = "strip-tok" + (j >= P ? " generated" : "") + (v !== v ? " hidden-sink" : "");
      s.style.background = v === v ? css(cmap, t) : "transparent";
      s.style.color = luminance(cmap, t) > 0.35 ? "#111" : "#fff";
      s.title = `${quoted(keys[j], j)}: ${v === v ? v.toFixed(3) : "hidden"}`;
    }
    if (fresh.childNodes.length) arrow.before(fresh);
    arrow.textContent = `→ ${visible(target.text)}`;
  }

  onHover(h) {
    if (!h || !this.result) return hideTooltip();
    const { H, keys, S, data, target } = this.result;
    const v = data[h.row * S + h.col];
    showTooltip(
      `<div class="tt-cell">L${Math.floor(h.row / H)} H${h.row % H}: query <span class="tt-tok">${escapeHTML(quoted(keys[S - 1], S - 1))}</span> → key <span class="tt-tok">${escapeHTML(quoted(keys[h.col], h.col))}</span>: <b>${v === v ? v.toFixed(3) : "hidden"}</b></div>` +
        `<div class="tt-muted">while predicting the next token, ${escapeHTML(quoted(target))}</div>`,
      h.x,
      h.y,
    );
  }

  exportPicture(scale) {
    if (!this.result || !this.heatmap.model) return null;
    const { step, target, S } = this.result;
    return { canvas: this.heatmap.exportPicture(scale), title: `generation step ${step + 1}: query #${S - 1} predicting ${quoted(target)}`, legend: this.legend };
  }

  exportData() {
    const g = this.params?.generation;
    if (!g || !g.recorded || !this.result) return null;
    return { title: "generation attention", prompt_tokens: g.promptTokens, tokens: g.tokens, step: this.result.step, query_position: this.result.S - 1, attention: g.attentionAt(this.result.step).map((l) => l.map((h) => Array.from(h))) };
  }
}
