// Fill-mask panel: the text's tokens as chips (click one to mask it), POST /fill-mask,
// and each [MASK]'s candidates with probability bars.

import { postJSON } from "../api.js";
import { escapeHTML, visible } from "../tokens.js";

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
  constructor(host, { model, onTextChange, onError }) {
    this.model = model;
    this.onTextChange = onTextChange;
    this.onError = onError;
    this.root = document.createElement("section");
    this.root.className = "panel enc-panel";
    this.root.id = "fill-mask-panel";
    this.root.innerHTML = `
      <div class="panel-head"><h2>Fill mask</h2><span class="hint">click a token to mask it, or type ${MASK}</span></div>
      <div class="enc-chips" id="enc-chips" aria-label="Tokens: click one to mask it"></div>
      <div class="actions">
        <label class="ctl">Top-k <input id="fill-top-k" type="number" min="1" max="100" value="5"></label>
        <button type="button" id="fill-mask" class="btn primary">Fill mask</button>
      </div>
      <div id="fill-results" class="enc-results" aria-live="polite"></div>`;
    host.append(this.root);
    this.root.querySelector("#fill-mask").addEventListener("click", () => this.run(this.text));
  }

  /** Show the tokens of the analysed text as clickable chips. */
  setTokens(tokens, text) {
    this.text = text;
    const chips = this.root.querySelector("#enc-chips");
    chips.replaceChildren();
    tokens.forEach((t, i) => {
      const b = document.createElement("button");
      b.type = "button";
      b.className = "enc-chip" + (t.text === MASK ? " masked" : "") + (i === 0 || i === tokens.length - 1 ? " special" : "");
      b.textContent = visible(t.text);
      b.dataset.index = String(i);
      b.title = i === 0 || i === tokens.length - 1 ? `${t.text} (special)` : `mask “${t.text}”`;
      if (i > 0 && i < tokens.length - 1 && t.text !== MASK) {
        b.addEventListener("click", () => {
          const masked = maskTokenAt(tokens, i);
          if (masked != null) this.onTextChange(masked, { fill: true });
        });
      } else b.disabled = i === 0 || i === tokens.length - 1;
      chips.append(b);
    });
  }

  async run(text) {
    const out = this.root.querySelector("#fill-results");
    if (!text || !text.includes(MASK)) {
      out.innerHTML = `<p class="empty-note">Put ${MASK} in the text (or click a token) to see what the model would fill in.</p>`;
      return;
    }
    const topK = Number(this.root.querySelector("#fill-top-k").value) || 5;
    out.classList.add("loading");
    try {
      const res = await postJSON("/fill-mask", { model: this.model, text, top_k: topK });
      out.replaceChildren(...res.masks.map((cands, i) => this.renderMask(cands, i, res.masks.length)));
    } catch (err) {
      out.replaceChildren();
      this.onError(err, "Fill mask");
    } finally {
      out.classList.remove("loading");
    }
  }

  renderMask(cands, i, n) {
    const box = document.createElement("div");
    box.className = "enc-mask";
    box.innerHTML = `<h3>${n > 1 ? `[MASK] ${i + 1} of ${n}` : "[MASK]"}</h3>` + cands.map((c) => `
      <div class="prob-row" data-token="${c.token}">
        <span class="prob-label">${escapeHTML(visible(c.token_str))}</span>
        <span class="prob-track"><span class="prob-fill" style="width:${(100 * c.score).toFixed(1)}%"></span></span>
        <span class="prob-value">${(100 * c.score).toFixed(1)}%</span>
      </div>`).join("");
    box.querySelectorAll(".prob-row").forEach((row, k) => { row.title = cands[k].sequence; });
    return box;
  }
}
