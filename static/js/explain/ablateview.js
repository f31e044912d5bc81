// Ablate view: the heads ablated (the store's `ablate`, carried by the link), and what
// removing them does:
//  - per token of the analysed text, the change in log-probability of the token that actually
//    comes next and the KL divergence of the whole next-token distribution (POST /logits with
//    `ablate`: `effect`);
//  - for a model that generates, the generation from the same prompt and the same seed with and
//    without the ablation, side by side, with the words that differ marked.
// Heads are chosen here (layer, head, group), in the atlas or in the Model view (Alt/Shift-click).

import { fetchLogits } from "./explain_api.js";
import { ablateField, describeHead, formatAblation, toggleAblation } from "./ablation.js";
import { diffWords } from "./textdiff.js";
import { readSamplingForm, streamGeneration } from "../generation.js";
import { parseConversation } from "../chat.js";
import { escapeHTML, visible, axisLabel } from "../tokens.js";
import { showTooltip, hideTooltip } from "../tooltip.js";

// the last few pairs of generations, by request: a seeded generation is the same each time, so
// coming back to the view does not generate again (Re-run does)
const GENERATED = new Map();
const KEEP = 8;

const fix = (v, d = 3) => (v == null || Number.isNaN(v) ? "—" : (v > 0 ? "+" : "") + v.toFixed(d));

/** The tint of a change in log-probability: red where the ablation lowers it, blue where it raises it. */
function deltaColour(d) {
  if (d == null || Number.isNaN(d)) return "transparent";
  const a = Math.min(1, Math.abs(d) / 2); // saturates at a change of 2 nats
  return d < 0 ? `rgba(220, 38, 38, ${0.12 + 0.78 * a})` : `rgba(37, 99, 235, ${0.12 + 0.78 * a})`;
}

export class AblateView {
  constructor(ctx) {
    this.ctx = ctx;
    this.params = null;
    this.run = null; // the generations in flight: {controller}
    this.effect = null;
  }

  mount(host) {
    this.root = document.createElement("div");
    this.root.className = "ablate";
    this.root.innerHTML = `
      <div class="abl-choose">
        <div class="abl-chips" aria-label="Heads ablated" aria-live="polite"></div>
        <form class="abl-add" autocomplete="off">
          <label class="ctl abl-group-ctl">group <select name="group"></select></label>
          <label class="ctl">layer <select name="layer"></select></label>
          <label class="ctl">head <select name="head"></select></label>
          <label class="ctl">how <select name="how"><option value="zero">zero</option><option value="mean">mean</option></select></label>
          <button type="submit" class="btn small">Add head</button>
          <button type="button" class="btn small ghost abl-clear">Clear</button>
          <button type="button" class="btn small primary abl-run">Re-run</button>
          <button type="button" class="btn small ghost abl-maps" title="The Difference view: a head's map without and with this ablation">Compare maps</button>
        </form>
      </div>
      <section class="abl-effect" aria-label="Per-token effect"></section>
      <section class="abl-gens" aria-label="Generations with and without the ablation"></section>`;
    host.append(this.root);
    this.root.querySelector(".abl-maps").addEventListener("click", () => this.ctx.select({ view: "diff", diff: "ablation" }));
    const form = this.root.querySelector(".abl-add");
    form.addEventListener("submit", (e) => {
      e.preventDefault();
      const f = new FormData(form);
      const group = f.get("group") || null;
      const list = this.params.ablation.filter((a) => !(a.layer === +f.get("layer") && a.head === +f.get("head") && (a.group ?? null) === group));
      this.ctx.select({ ablate: formatAblation([...list, { layer: +f.get("layer"), head: +f.get("head"), how: f.get("how"), group }]) });
    });
    this.root.querySelector(".abl-clear").addEventListener("click", () => this.ctx.select({ ablate: "" }));
    this.root.querySelector(".abl-run").addEventListener("click", () => this.runAll(true));
    this.root.addEventListener("mouseover", (e) => this.tip(e.target.closest("[data-pos]")));
    this.root.addEventListener("focusin", (e) => this.tip(e.target.closest("[data-pos]")));
    this.root.addEventListener("mouseleave", hideTooltip);
  }

  unmount() {
    this.run?.controller.abort();
    hideTooltip();
    this.root?.remove();
  }

  fillForm() {
    const { model } = this.params;
    const form = this.root.querySelector(".abl-add");
    const fill = (sel, n, p) => {
      if (sel.options.length === n) return;
      sel.replaceChildren(...Array.from({ length: n }, (_, i) => new Option(`${p}${i}`, String(i))));
    };
    fill(form.elements.layer, model.n_layers, "L");
    fill(form.elements.head, model.n_heads, "H");
    const several = model.groups.length > 1;
    const g = form.elements.group;
    if (g.options.length !== (several ? model.groups.length : 1)) g.replaceChildren(...(several ? model.groups.map((x) => new Option(x.name, x.name)) : [new Option("", "")]));
    this.root.querySelector(".abl-group-ctl").hidden = !several;
  }

  showChips() {
    const host = this.root.querySelector(".abl-chips");
    const list = this.params.ablation;
    if (!list.length) {
      host.innerHTML = `<p class="hint">No head is ablated. Add one here, Alt- or Shift-click a head in the <b>Atlas</b> (or turn on “Choose heads to ablate”) or a map in the <b>Model</b> view. ` +
        `<i>zero</i> sets the head's output z to 0; <i>mean</i> replaces it by its mean over the positions. The link carries the choice.</p>`;
      return;
    }
    host.replaceChildren(
      ...list.map((a) => {
        const chip = document.createElement("span");
        chip.className = "abl-chip";
        chip.dataset.head = formatAblation([a]);
        chip.innerHTML = `<b>${escapeHTML(describeHead({ ...a, how: null }))}</b> <select aria-label="how ${escapeHTML(describeHead({ ...a, how: null }))} is ablated"><option value="zero">zero</option><option value="mean">mean</option></select> <button type="button" class="btn small ghost" aria-label="stop ablating ${escapeHTML(describeHead({ ...a, how: null }))}">✕</button>`;
        const sel = chip.querySelector("select");
        sel.value = a.how;
        sel.addEventListener("change", () => this.ctx.select({ ablate: formatAblation(this.params.ablation.map((b) => (b === a ? { ...b, how: sel.value } : b))) }));
        chip.querySelector("button").addEventListener("click", () => this.ctx.select({ ablate: formatAblation(toggleAblation(this.params.ablation, a.layer, a.head, a.group)) }));
        return chip;
      }),
    );
  }

  async render(params, changed, isCurrent = () => true) {
    const prev = this.params;
    this.params = params;
    this.fillForm();
    this.showChips();
    this.ctx.setLegend(null);
    const generates = params.model.capabilities.has("generation");
    this.ctx.setCaption(
      `<b>Ablation</b>: remove heads and see what changes — ${generates ? "the probability of each next token of this text, and the generation from the same seed" : "the probability the model gives each token of this text at its position"}. ` +
        `<span class="abl-key"><i class="down"></i> less likely <i class="up"></i> more likely</span>`,
    );
    const relevant = !prev || !changed || ["ablate", "att", "meta"].some((k) => changed.has(k));
    if (!relevant) return true;
    await this.runAll(false);
    return isCurrent();
  }

  /** The effect on the text, and the two generations (when the model generates). */
  async runAll(again) {
    const params = this.params;
    const effectHost = this.root.querySelector(".abl-effect");
    const gensHost = this.root.querySelector(".abl-gens");
    this.run?.controller.abort();
    this.run = null;
    if (!params.ablation.length) {
      effectHost.replaceChildren();
      gensHost.replaceChildren();
      this.root.dataset.state = "empty";
      return;
    }
    this.root.dataset.state = "running";
    const generates = params.model.capabilities.has("generation");
    const controller = new AbortController();
    this.run = { controller };
    const effect = this.ctx.track(fetchLogits(params.attention, { ablation: params.ablation, topK: 5 }));
    const gens = generates ? this.generations(controller.signal, again).catch((err) => (this.ctx.showError(err, "Generating with the ablation"), null)) : Promise.resolve(null);
    if (generates) gensHost.innerHTML = '<p class="hint">generating with and without the ablation…</p>';
    else gensHost.replaceChildren();
    try {
      const answer = await effect;
      if (this.run?.controller !== controller) return; // a newer run replaced this one
      this.effect = answer;
      this.showEffect(effectHost, answer);
    } catch (err) {
      if (this.run?.controller !== controller) return; // a newer run replaced this one
      effectHost.replaceChildren();
      this.ctx.showError(err, "The ablation's effect (/logits)");
    }
    const g = await gens;
    if (this.run?.controller !== controller) return;
    if (g) this.showGenerations(gensHost, g);
    this.root.dataset.state = "done";
  }

  /** The same request twice, once with `ablate`: the same seed (0 when the form has none). */
  async generations(signal, again = false) {
    const body = { ...readSamplingForm(this.params.prompt || this.params.text), return_attention: false, stream: true, logprobs: 0 };
    if (this.params.conversation) {
      // a chat model's conversation goes as messages, as Generate sends it (the server renders its template)
      delete body.prompt;
      body.messages = parseConversation(this.params.prompt);
    }
    const seeded = body.seed != null;
    if (!seeded) body.seed = 0;
    const key = JSON.stringify([this.params.model.name, body, this.params.ablation]);
    if (!again && GENERATED.has(key)) return GENERATED.get(key);
    const one = async (extra) => {
      let text = "";
      const r = await streamGeneration({ ...body, ...extra }, { signal, onToken: (t) => (text += t.delta ?? t.text ?? "") });
      if (r.error) throw r.error;
      if (r.stopped) throw new Error("stopped"); // replaced by a newer run: nothing to show or keep
      return r.done?.text ?? text;
    };
    try {
      const [clean, ablated] = await this.ctx.track(Promise.all([one({}), one({ ablate: ablateField(this.params.ablation) })]));
      const pair = { clean, ablated, seed: body.seed, seeded, temperature: body.temperature };
      GENERATED.set(key, pair);
      while (GENERATED.size > KEEP) GENERATED.delete(GENERATED.keys().next().value);
      return pair;
    } catch (err) {
      if (!signal.aborted) this.ctx.showError(err, "Generating with the ablation");
      return null;
    }
  }

  showEffect(host, a) {
    const positions = a.positions ?? [];
    const effect = new Map((a.effect ?? []).map((e) => [e.position, e]));
    const kls = (a.effect ?? []).map((e) => e.kl).filter((x) => x != null);
    const meanKL = kls.length ? kls.reduce((s, x) => s + x, 0) / kls.length : null;
    let worst = null;
    for (const e of a.effect ?? []) if (e.delta_logprob != null && (worst == null || e.delta_logprob < worst.delta_logprob)) worst = e;
    const worstPos = worst && positions.find((p) => p.position === worst.position);
    const chips = positions
      .map((p, i) => {
        if (a.predicts !== "same" && !p.next) return ""; // the last position: nothing comes next in the text
        const e = effect.get(p.position);
        const shown = p.next ?? p.token; // the token predicted: the next one (an encoder's: the token at the position)
        const d = e?.delta_logprob;
        return `<span class="abl-tok" tabindex="${i === 0 ? 0 : -1}" data-pos="${i}" style="background:${deltaColour(d)}" data-delta="${d ?? ""}">${escapeHTML(axisLabel(shown?.text ?? "", 10))}</span>`;
      })
      .join("");
    host.innerHTML =
      `<h3>Per token <span class="hint">Δ log p of ${a.predicts === "same" ? "the token at each position (what the model predicts there" : "the token that comes next (as predicted"} by ${escapeHTML(a.head ?? "the model")}), ablated − clean</span></h3>` +
      `<p class="abl-summary">mean KL(clean ‖ ablated) <b data-kl>${meanKL == null ? "—" : meanKL.toFixed(4)}</b>${worst ? ` · largest drop <b>${fix(worst.delta_logprob)}</b> at “${escapeHTML(visible((worstPos?.next ?? worstPos?.token)?.text ?? ""))}”` : ""}</p>` +
      `<div class="abl-tokens">${chips}</div>`;
  }

  tip(el) {
    if (!el || !this.effect) return;
    const i = +el.dataset.pos;
    const p = this.effect.positions[i];
    const c = this.effect.clean?.[i];
    const e = (this.effect.effect ?? []).find((x) => x.position === p.position);
    const shown = p.next ?? p.token;
    const r = el.getBoundingClientRect();
    const top = (list) => (list ?? []).slice(0, 3).map((t) => `${escapeHTML(visible(t.text))} ${(100 * t.prob).toFixed(0)}%`).join(" · ");
    showTooltip(
      `<div class="tt-cell">after #${p.position} “${escapeHTML(visible(p.token?.text))}” → <span class="tt-tok">${escapeHTML(visible(shown?.text ?? ""))}</span></div>` +
        `<div class="tt-row"><span>p clean</span><b>${c?.next_prob == null ? "—" : c.next_prob.toFixed(3)}</b></div>` +
        `<div class="tt-row"><span>p ablated</span><b>${p.next_prob == null ? "—" : p.next_prob.toFixed(3)}</b></div>` +
        `<div class="tt-row"><span>Δ log p</span><b>${fix(e?.delta_logprob)}</b></div><div class="tt-row"><span>KL</span><b>${e?.kl == null ? "—" : e.kl.toFixed(4)}</b></div>` +
        `<div class="tt-muted">clean top: ${top(c?.top)}</div><div class="tt-muted">ablated top: ${top(p.top)}</div>`,
      r.right,
      r.top,
    );
  }

  showGenerations(host, g) {
    const { left, right } = diffWords(g.clean, g.ablated);
    const side = (parts, title, cls) =>
      `<div class="abl-gen ${cls}"><h4>${title}</h4><p class="abl-text">${parts.map((w) => (w.op === "same" ? escapeHTML(w.text) : `<${w.op === "del" ? "del" : "ins"}>${escapeHTML(w.text)}</${w.op === "del" ? "del" : "ins"}>`)).join("")}</p></div>`;
    const same = g.clean === g.ablated;
    host.innerHTML =
      `<h3>Generation <span class="hint">seed ${g.seed}${g.seeded ? "" : " (the seed box is empty)"}, temperature ${g.temperature ?? "default"}, same prompt</span></h3>` +
      `<p class="abl-same hint">${same ? "The ablation does not change this generation." : "Words only in the clean generation are struck out; words only in the ablated one are marked."}</p>` +
      `<div class="abl-pair">${side(left, "clean", "clean")}${side(right, `ablated: ${escapeHTML(this.params.ablation.map(describeHead).join(", "))}`, "ablated")}</div>`;
  }

  exportData() {
    return this.effect ? { title: "ablation", ablate: ablateField(this.params.ablation), ...this.effect } : null;
  }
}
