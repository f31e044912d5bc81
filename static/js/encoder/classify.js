// Classify panel (an encoder with a classification head): POST /classify on the analysed text,
// every label with a probability bar, best first. Runs for each new text; the button re-runs.

import { postJSON } from "../api.js";
import { escapeHTML } from "../tokens.js";
import { headFigureHTML, probRow, ResultsBox } from "./probs.js";

export class ClassifyPanel {
  /** ctx: {showError(err, what)} */
  constructor(ctx) {
    this.ctx = ctx;
    this.params = null;
  }

  mount(host) {
    this.root = document.createElement("section");
    this.root.className = "panel enc-panel";
    this.root.id = "classify-panel";
    this.root.innerHTML = `
      <div class="panel-head"><h2>Classify</h2><span class="hint"></span></div>
      <div class="head-figure-box"></div>
      <div class="actions"><button type="button" id="classify" class="btn primary">Classify</button></div>
      <div id="classify-results" class="enc-results" aria-live="polite"></div>`;
    host.append(this.root);
    this.results = new ResultsBox(this.root.querySelector("#classify-results"));
    this.root.querySelector("#classify").addEventListener("click", () => this.run());
  }

  unmount() {
    this.root?.remove();
  }

  render(params, changed) {
    this.params = params;
    if (changed && !changed.has("att") && !changed.has("meta")) return;
    this.root.querySelector(".hint").innerHTML = escapeHTML((params.model.labels ?? []).join(" · "));
    this.root.querySelector(".head-figure-box").innerHTML = headFigureHTML(params.model.head_figures?.classify);
    this.results.clear();
    if (params.attention?.tokens) this.run();
  }

  run() {
    const { model, text } = this.params ?? {};
    if (!text) return;
    this.results.run(
      () => postJSON("/classify", { model: model.name, text }),
      (res) => (this.results.el.innerHTML = res.labels.map((l) => probRow(l.label, l.score, { attrs: `data-label="${escapeHTML(l.label)}"` })).join("")),
      (err) => this.ctx.showError(err, "Classify"),
    );
  }
}
