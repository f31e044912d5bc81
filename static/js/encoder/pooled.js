// The pooled representation's attention, one click away: the toolbar button pins the rows the
// classifier reads (row 0 = [CLS] for cls pooling, every row for mean pooling) through the
// store, and this readout lists what they attend to in the chosen layer and head while they
// are the pinned rows. Pinning is ordinary state: the heatmap sums the same rows, links keep it.

import { visible } from "../tokens.js";
import { probRow } from "./probs.js";

/** The query rows the pooled representation is made of, for a text of T tokens. */
export function pooledRows(pooling, T) {
  return pooling === "mean" ? [...Array(T).keys()] : T ? [0] : [];
}

/** Attention the pooled representation draws from each key: the mean of its rows, (T,) values. */
export function pooledRow(mat, T, rows) {
  const out = new Float32Array(T);
  for (const r of rows) for (let c = 0; c < T; c++) out[c] += mat[r * T + c] / rows.length;
  return out;
}

const same = (a, b) => a.length === b.length && [...a].sort((x, y) => x - y).every((x, i) => x === b[i]);

export class PooledPanel {
  /** ctx: {select(patch)} */
  constructor(ctx) {
    this.ctx = ctx;
    this.params = null;
    this.onClick = () => this.toggle();
  }

  mount(host) {
    this.root = document.createElement("div");
    this.root.id = "enc-pooled";
    this.root.className = "enc-results enc-pooled";
    this.root.hidden = true;
    host.append(this.root);
    this.button = document.querySelector("#enc-focus-pooled");
    this.button.addEventListener("click", this.onClick);
  }

  unmount() {
    this.button?.removeEventListener("click", this.onClick);
    this.root?.remove();
  }

  rows(params) {
    return pooledRows(params.model.pooling, params.attention?.T ?? 0);
  }

  toggle() {
    const p = this.params;
    if (!p?.attention?.T) return;
    const rows = this.rows(p);
    this.ctx.select({ pin: same(p.selection.pinned, rows) ? [] : rows });
  }

  async render(params) {
    this.params = params;
    const mean = params.model.pooling === "mean";
    const what = mean ? "the mean-pooled representation (mean of every row)" : "[CLS] (row 0)";
    this.button.textContent = mean ? "Pooled attention" : "[CLS] attention";
    this.button.title = `What ${mean ? "the mean-pooled representation" : "the [CLS] position"} the classifier reads attends to: pins ${mean ? "every row" : "row 0"}`;
    const rows = this.rows(params);
    const on = rows.length > 0 && same(params.selection.pinned, rows);
    this.button.setAttribute("aria-pressed", String(on));
    const { attention: att, selection: { layer, head } } = params;
    if (on) await att.ensure([layer]).catch(() => null); // the head view asks for the same layer
    if (this.params !== params) return; // a newer state is being shown
    const mat = on && att.has(layer) ? att.head(layer, head) : null;
    this.root.hidden = !mat;
    if (!mat) return;
    const row = pooledRow(mat, att.T, rows);
    const top = Math.max(...row) || 1;
    const own = params.model.classifier_layers ?? 0, n = params.model.n_layers;
    const note = own && layer >= n - own
      ? `<p class="hint">The classifier reads its own fine-tuned copies of layers ${n - own}–${n - 1}; these are the pretrained model's.</p>` : "";
    this.root.innerHTML =
      `<h3>Attention of ${what}, layer ${layer}, head ${head}</h3>` + note +
      [...row].map((v, i) => probRow(visible(att.tokens[i].text), v, { width: v / top, attrs: `data-index="${i}"` })).join("");
  }
}
