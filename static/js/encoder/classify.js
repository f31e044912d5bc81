// Classify panel: POST /classify, every label with a probability bar, best first.

import { postJSON } from "../api.js";
import { escapeHTML } from "../tokens.js";

export class ClassifyPanel {
  constructor(host, { model, labels, onError }) {
    this.model = model;
    this.onError = onError;
    this.root = document.createElement("section");
    this.root.className = "panel enc-panel";
    this.root.id = "classify-panel";
    this.root.innerHTML = `
      <div class="panel-head"><h2>Classify</h2><span class="hint">${escapeHTML(labels.join(" · "))}</span></div>
      <div class="actions"><button type="button" id="classify" class="btn primary">Classify</button></div>
      <div id="classify-results" class="enc-results" aria-live="polite"></div>`;
    host.append(this.root);
  }

  onClick(handler) {
    this.root.querySelector("#classify").addEventListener("click", handler);
  }

  async run(text) {
    const out = this.root.querySelector("#classify-results");
    out.classList.add("loading");
    try {
      const res = await postJSON("/classify", { model: this.model, text });
      out.innerHTML = res.labels.map((l) => `
        <div class="prob-row" data-label="${escapeHTML(l.label)}">
          <span class="prob-label">${escapeHTML(l.label)}</span>
          <span class="prob-track"><span class="prob-fill" style="width:${(100 * l.score).toFixed(1)}%"></span></span>
          <span class="prob-value">${(100 * l.score).toFixed(1)}%</span>
        </div>`).join("");
    } catch (err) {
      out.replaceChildren();
      this.onError(err, "Classify");
    } finally {
      out.classList.remove("loading");
    }
  }
}
