// Fill-mask panel (an encoder's): the analysed text's tokens as chips (click one to mask it),
// POST /fill-mask on that text, and each [MASK]'s candidates with probability bars. It reads
// the text and top-k from the params; masking a token analyses the masked text (store's prompt).

import { postJSON } from "../api.js";
import { visible } from "../tokens.js";
import { headFigureHTML, probRow, ResultsBox } from "./probs.js";

export const MASK = "[MASK]";

/** The text with the token at `index` of `tokens` (framed: [CLS] … [SEP]) replaced by [MASK]. */
export function maskTokenAt(tokens, index) {
  const body = tokens.slice(1, -1).map((t) => t.text);
  const i = index - 1;
  if (i < 0 || i >= body.length) return null;
  const lead = body[i].match(/^\s*/)[0]; // [MASK] takes the space before it, as the tokenizer does
  body[i] = lead + MASK;
  return body.join("");
}

export class FillMaskPanel {
  /** ctx: {select(patch), analyse(text) -> Promise, showError(err, what)} */
  constructor(ctx) {
    this.ctx = ctx;
    this.params = null;
  }

  mount(host) {
    this.root = document.createElement("section");
    this.root.className = "panel enc-panel";
    this.root.id = "fill-mask-panel";
    this.root.innerHTML = `
      <div class="panel-head"><h2>Fill mask</h2><span class="hint">click a token to mask it, or type ${MASK}</span></div>
      <div class="head-figure-box"></div>
      <div class="enc-chips" id="enc-chips" aria-label="Tokens: click one to mask it"></div>
      <div class="actions">
        <label class="ctl">Top-k <input id="fill-top-k" type="number" min="1" max="100" step="1" inputmode="numeric"></label>
        <button type="button" id="fill-mask" class="btn primary">Fill mask</button>
      </div>
      <div id="fill-results" class="enc-results" aria-live="polite"></div>`;
    host.append(this.root);
    this.results = new ResultsBox(this.root.querySelector("#fill-results"));
    this.topK = this.root.querySelector("#fill-top-k");
    this.topK.addEventListener("change", () => this.ctx.select({ fillk: this.topK.value }));
    this.root.querySelector("#fill-mask").addEventListener("click", () => this.run());
  }

  unmount() {
    this.root?.remove();
  }

  render(params, changed) {
    this.params = params;
    if (document.activeElement !== this.topK) this.topK.value = String(params.settings.fillk);
    if (changed && !["att", "meta", "fillk"].some((k) => changed.has(k))) return;
    if (!changed || changed.has("meta")) this.root.querySelector(".head-figure-box").innerHTML = headFigureHTML(params.model.head_figures?.["fill-mask"]);
    if (!changed || changed.has("att") || changed.has("meta")) {
      this.showTokens(params.attention?.tokens ?? []);
      this.results.clear();
    }
    if (params.attention?.tokens && params.text.includes(MASK)) this.run(); // the candidates follow the text
  }

  /** The analysed text's tokens as chips; the framing [CLS] / [SEP] and masks are not clickable. */
  showTokens(tokens) {
    const chips = this.root.querySelector("#enc-chips");
    chips.replaceChildren(
      ...tokens.map((t, i) => {
        const special = i === 0 || i === tokens.length - 1;
        const b = document.createElement("button");
        b.type = "button";
        b.className = "enc-chip" + (t.text === MASK ? " masked" : "") + (special ? " special" : "");
        b.textContent = visible(t.text);
        b.dataset.index = String(i);
        b.title = special ? `${t.text} (special)` : `mask “${t.text}”`;
        b.disabled = special || t.text === MASK;
        b.addEventListener("click", () => {
          const masked = maskTokenAt(tokens, i);
          if (masked != null) this.ctx.analyse(masked);
        });
        return b;
      }),
    );
  }

  run() {
    const text = this.params?.text;
    if (!text || !text.includes(MASK)) {
      this.results.clear(`<p class="empty-note">Put ${MASK} in the text (or click a token) to see what the model would fill in.</p>`);
      return;
    }
    const { model, settings } = this.params;
    this.results.run(
      () => postJSON("/fill-mask", { model: model.name, text, top_k: settings.fillk }),
      (res) => this.results.el.replaceChildren(...res.masks.map((cands, i) => this.maskBox(cands, i, res.masks.length))),
      (err) => this.ctx.showError(err, "Fill mask"),
    );
  }

  maskBox(cands, i, n) {
    const box = document.createElement("div");
    box.className = "enc-mask";
    box.innerHTML =
      `<h3>${n > 1 ? `${MASK} ${i + 1} of ${n}` : MASK}</h3>` +
      cands.map((c) => probRow(visible(c.token_str), c.score, { attrs: `data-token="${c.token}"`, title: c.sequence })).join("");
    return box;
  }
}
