// The encoder's attention: full square T x T heatmaps (no causal mask: every position sees
// every other), a layer/head picker, and one click to the pooled / [CLS] position's attention.

import { decodeAttention, postJSON } from "../api.js";
import { Heatmap } from "../heatmap.js";
import { drawLegend } from "../paint.js";
import { escapeHTML, visible } from "../tokens.js";

/** Attention the pooled representation draws from each key in one head, (T,) values.
 *  cls pooling: row 0 ([CLS]); mean pooling: the mean of every row (the pooled vector is the
 *  mean of the positions, each of which attended with its own row). */
export function pooledRow(mat, T, pooling) {
  const out = new Float32Array(T);
  if (pooling === "cls") {
    out.set(mat.subarray(0, T));
    return out;
  }
  for (let r = 0; r < T; r++) for (let c = 0; c < T; c++) out[c] += mat[r * T + c] / T;
  return out;
}

export class EncoderAttentionView {
  constructor(host, { model, nLayers, nHeads, pooling, onError }) {
    Object.assign(this, { model, nLayers, nHeads, pooling: pooling || "cls", onError });
    this.focus = "all";
    this.root = document.createElement("section");
    this.root.className = "workspace enc-workspace";
    this.root.setAttribute("aria-label", "Encoder attention");
    const opts = (n) => [...Array(n).keys()].map((i) => `<option value="${i}">${i}</option>`).join("");
    this.root.innerHTML = `
      <div class="toolbar" role="group" aria-label="Encoder attention options">
        <label class="ctl">Layer <select id="enc-layer">${opts(nLayers)}</select></label>
        <label class="ctl">Head <select id="enc-head">${opts(nHeads)}</select></label>
        <span class="enc-direction" title="every position attends to every other">bidirectional</span>
        <span class="toolbar-spacer"></span>
        <button type="button" id="enc-focus-pooled" class="btn small" aria-pressed="false"
          title="What the ${this.pooling === "cls" ? "[CLS] position" : "mean-pooled representation"} the classifier reads attends to">
          ${this.pooling === "cls" ? "[CLS] attention" : "Pooled attention"}</button>
      </div>
      <div class="view-frame">
        <div class="legend-row"><div id="enc-caption" class="caption"></div>
          <div class="legend"><canvas id="enc-legend" width="220" height="34"></canvas></div></div>
        <div id="enc-heatmap" class="view-host"></div>
        <div id="enc-pooled" class="enc-results" hidden></div>
        <div id="enc-empty" class="view-empty"><p>Analyse a text to see its attention.</p></div>
      </div>`;
    host.append(this.root);
    this.heatmap = new Heatmap(this.root.querySelector("#enc-heatmap"), { maxHeight: 640 });
    for (const id of ["#enc-layer", "#enc-head"]) this.root.querySelector(id).addEventListener("change", () => this.draw());
    const focusBtn = this.root.querySelector("#enc-focus-pooled");
    focusBtn.addEventListener("click", () => {
      this.focus = this.focus === "pooled" ? "all" : "pooled";
      focusBtn.setAttribute("aria-pressed", String(this.focus === "pooled"));
      this.draw();
    });
  }

  async load(text) {
    const res = await postJSON("/attention", { model: this.model, text, format: "f16", packing: "full" });
    this.tokens = res.tokens;
    this.T = res.tokens.length;
    this.data = decodeAttention(res); // [L][H][T][T]
    this.root.querySelector("#enc-empty").hidden = true;
    this.draw();
    return res;
  }

  matrix(layer, head) {
    const T = this.T;
    const off = (layer * this.nHeads + head) * T * T;
    return this.data.subarray(off, off + T * T);
  }

  draw() {
    if (!this.data) return;
    const layer = Number(this.root.querySelector("#enc-layer").value);
    const head = Number(this.root.querySelector("#enc-head").value);
    const T = this.T;
    const labels = this.tokens.map((t) => t.text);
    const mat = this.matrix(layer, head);
    let vmax = 0;
    for (const v of mat) vmax = Math.max(vmax, v);
    this.heatmap.set({ data: mat, rows: T, cols: T, rowLabels: labels, colLabels: labels, cmap: "viridis",
      vmin: 0, vmax: vmax || 1, causal: false, rowTitle: "query", colTitle: "key" });
    drawLegend(this.root.querySelector("#enc-legend"), { cmap: "viridis", vmin: 0, vmax: vmax || 1, label: "attention" });
    this.root.querySelector("#enc-caption").textContent =
      `Layer ${layer}, head ${head}: ${T} × ${T}, bidirectional (rows: queries, columns: keys; each row sums to 1)`;
    const pooledBox = this.root.querySelector("#enc-pooled");
    pooledBox.hidden = this.focus !== "pooled";
    if (this.focus === "pooled") {
      const row = pooledRow(mat, T, this.pooling);
      const top = Math.max(...row) || 1;
      const what = this.pooling === "cls" ? "[CLS] (row 0)" : "the mean-pooled representation (mean of every row)";
      pooledBox.innerHTML = `<h3>Attention of ${what}, layer ${layer}, head ${head}</h3>` + [...row].map((v, i) => `
        <div class="prob-row" data-key="${i}"><span class="prob-label">${escapeHTML(visible(labels[i]))}</span>
          <span class="prob-track"><span class="prob-fill" style="width:${(100 * v / top).toFixed(1)}%"></span></span>
          <span class="prob-value">${(100 * v).toFixed(1)}%</span></div>`).join("");
    }
  }
}
