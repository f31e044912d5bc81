// Generated-token view: for one generated token, the attention of the position that
// produced it over every earlier token, per layer and head (from /generate with
// return_attention). A slider scrubs through the generation step by step.

import { Heatmap } from "../heatmap.js";
import { removeSink, maxOf, colourScale } from "../attention.js";
import { css, luminance } from "../colormap.js";
import { quoted, escapeHTML, visible } from "../tokens.js";
import { showTooltip, hideTooltip } from "../tooltip.js";

export class GenView {
  constructor(app) {
    this.app = app;
    this.playing = null;
    this.result = null;
  }

  mount(host) {
    this.host = host;
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
    this.host.append(this.root);
    this.slider = this.root.querySelector("#gen-step");
    this.stepText = this.root.querySelector("#gen-step-text");
    this.strip = this.root.querySelector(".gen-strip");
    this.slider.addEventListener("input", () => this.app.setState({ step: +this.slider.value }, { quiet: true }).then(() => this.draw()));
    this.root.querySelector('[data-act="prev"]').addEventListener("click", () => this.go(-1));
    this.root.querySelector('[data-act="next"]').addEventListener("click", () => this.go(1));
    this.playBtn = this.root.querySelector('[data-act="play"]');
    this.playBtn.addEventListener("click", () => this.togglePlay());
    this.heatmap = new Heatmap(this.root.querySelector(".gen-heat"), {
      maxCell: 22,
      onHover: (h) => this.onHover(h),
      onCellClick: ({ row }) => {
        const H = this.app.att?.nHeads || this.app.gen.nHeads;
        this.app.selectHead(Math.floor(row / H), row % H, { quiet: true });
        this.draw();
      },
    });
    this.heatmap.overlay.setAttribute("aria-label", "Attention of the selected generated token per layer and head; click a row to follow that head in the strip above");
  }

  unmount() {
    this.stop();
    hideTooltip();
    this.root?.remove();
  }

  go(d) {
    const n = this.app.gen?.tokens.length || 0;
    if (!n) return;
    const step = Math.max(0, Math.min(n - 1, this.app.state.step + d));
    this.app.setState({ step }, { quiet: true }).then(() => this.draw());
  }

  togglePlay() {
    if (this.playing) return this.stop();
    const n = this.app.gen?.tokens.length || 0;
    if (!n) return;
    if (this.app.state.step >= n - 1) this.app.state.step = -1;
    this.playBtn.textContent = "❚❚ Pause";
    this.playing = setInterval(() => {
      if (this.app.state.step >= n - 1) return this.stop();
      this.go(1);
    }, 350);
  }

  stop() {
    clearInterval(this.playing);
    this.playing = null;
    if (this.playBtn) this.playBtn.textContent = "▶ Play";
  }

  async render() {
    this.draw();
  }

  draw() {
    const { gen, state } = this.app;
    if (!gen || !gen.tokens.length) {
      this.root.classList.add("empty");
      this.strip.innerHTML = '<p class="empty-note">Generate some text first: this view shows, for each generated token, which earlier tokens it attended to.</p>';
      this.app.setCaption("");
      this.app.setLegend(null);
      this.heatmap.wrap.hidden = true;
      return;
    }
    if (!gen.attention) {
      this.strip.innerHTML = '<p class="empty-note">The last generation did not record attention. Tick “Record attention” and generate again.</p>';
      this.heatmap.wrap.hidden = true;
      return;
    }
    this.root.classList.remove("empty");
    this.heatmap.wrap.hidden = false;
    const n = gen.attention.length;
    const step = Math.max(0, Math.min(n - 1, state.step ?? 0));
    this.slider.max = String(n - 1);
    this.slider.value = String(step);
    const att = gen.attention[step]; // [L][H][S]
    const L = att.length;
    const H = att[0].length;
    const S = att[0][0].length;
    const P = gen.promptTokens.length;
    const all = gen.promptTokens.concat(gen.tokens);
    const keys = all.slice(0, S);
    while (keys.length < S) keys.push({ id: -1, text: "?" });
    const target = gen.tokens[step];
    let data = new Float32Array(L * H * S);
    for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) data.set(att[l][h], (l * H + h) * S);
    if (state.sink) data = removeSink(data, S, S);
    const rowLabels = [];
    for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) rowLabels.push(`L${l} · H${h}`);
    const sc = colourScale(data, S, state.scale, { skipFirstRow: false });
    this.result = { data, rows: L * H, cols: S, keys, L, H, S, step, target };
    this.heatmap.set({
      data: sc.data,
      rows: L * H,
      cols: S,
      rowLabels,
      plainRowLabels: true,
      colLabels: keys.map((t) => t.text),
      cmap: state.cmap,
      vmin: sc.vmin,
      vmax: sc.vmax,
      gamma: sc.gamma,
      causal: false,
      rowTitle: "layer · head",
      colTitle: "earlier tokens (keys) →",
    });
    const sel = Math.min(state.layer, L - 1) * H + Math.min(state.head, H - 1);
    this.heatmap.setPinned([sel]);
    this.app.setLegend({ cmap: state.cmap, vmin: sc.vmin, vmax: sc.vmax, gamma: sc.gamma, label: sc.label });
    this.stepText.innerHTML = `step ${step + 1} / ${n}: generating <span class="tok-inline">${escapeHTML(visible(target.text))}</span> from ${S} earlier tokens (${P} in the prompt)`;
    this.app.markGeneratedStep(step);
    // strip: the earlier tokens tinted by the selected head's weights
    const row = data.subarray(sel * S, (sel + 1) * S);
    const rmax = maxOf(row) || 1;
    const frag = document.createDocumentFragment();
    const lab = document.createElement("span");
    lab.className = "strip-label";
    lab.textContent = `L${Math.floor(sel / H)} H${sel % H}:`;
    frag.append(lab);
    for (let j = 0; j < S; j++) {
      const s = document.createElement("span");
      s.className = "strip-tok" + (j >= P ? " generated" : "");
      const v = row[j];
      const t = v === v ? v / rmax : 0;
      s.style.background = v === v ? css(state.cmap, t) : "transparent";
      s.style.color = luminance(state.cmap, t) > 0.35 ? "#111" : "#fff";
      if (v !== v) s.classList.add("hidden-sink");
      s.textContent = visible(keys[j].text);
      s.title = `${quoted(keys[j], j)}: ${v === v ? v.toFixed(3) : "hidden"}`;
      frag.append(s);
    }
    const arrow = document.createElement("span");
    arrow.className = "strip-target";
    arrow.textContent = `→ ${visible(target.text)}`;
    frag.append(arrow);
    this.strip.replaceChildren(frag);
    this.app.setCaption(
      `Each row is one head's attention from the position that produced generated token ${step + 1}; the strip above shows the outlined row (click another row to follow it).${state.sink ? " First-token column hidden, rows renormalised." : ""}`,
    );
  }

  onHover(h) {
    if (!h || !this.result) return hideTooltip();
    const { H, keys, S } = this.result;
    const l = Math.floor(h.row / H);
    const hd = h.row % H;
    const v = this.result.data[h.row * S + h.col];
    showTooltip(
      `<div class="tt-cell">L${l} H${hd}: <span class="tt-tok">${escapeHTML(visible(this.result.target.text))}</span> → <span class="tt-tok">${escapeHTML(quoted(keys[h.col], h.col))}</span>: <b>${v === v ? v.toFixed(3) : "hidden"}</b></div>`,
      h.x,
      h.y,
    );
  }

  exportCanvas() {
    return this.heatmap?.exportCanvas();
  }

  exportData() {
    const g = this.app.gen;
    if (!g || !g.attention) return null;
    return { title: "generation attention", prompt_tokens: g.promptTokens, tokens: g.tokens, step: this.app.state.step, attention: g.attention[this.app.state.step] };
  }
}
