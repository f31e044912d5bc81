// The output panel: the prompt and the generated tokens as chips tinted by probability, their
// tooltips (probability and alternatives), the run's figures, and the current step's mark.

import { lut } from "./colormap.js";
import { showTooltip, hideTooltip } from "./tooltip.js";
import { escapeHTML, visible } from "./tokens.js";

const $ = (sel) => document.querySelector(sel);

function chipTooltipHTML(t) {
  if (t.logprob == null) return `<div class="tt-cell"><span class="tt-tok">${escapeHTML(visible(t.text))}</span></div><div class="tt-muted">no probability reported</div>`;
  const p = Math.exp(t.logprob);
  if (t.fromLink) {
    return `<div class="tt-cell"><span class="tt-tok">${escapeHTML(visible(t.text))}</span> p ≈ <b>${(p * 100).toFixed(1)}%</b></div>` +
      `<div class="tt-muted">from the link (rounded to 0.1%; the alternatives are not in links)</div><div class="tt-muted" style="margin-top:4px">click: what it attended to</div>`;
  }
  const alts = t.top_logprobs || [];
  const maxP = Math.max(p, ...alts.map((a) => Math.exp(a.logprob)));
  let rows = "";
  for (const a of alts) {
    const ap = Math.exp(a.logprob);
    const chosen = a.id === t.id ? "chosen" : "";
    rows += `<span class="tt-tok ${chosen}">${escapeHTML(visible(a.text))}</span><span class="bar" style="width:${Math.max(1, (ap / maxP) * 100)}%"></span><span class="num ${chosen}">${(ap * 100).toFixed(1)}%</span>`;
  }
  return (
    `<div class="tt-cell"><span class="tt-tok">${escapeHTML(visible(t.text))}</span> p = <b>${(p * 100).toFixed(2)}%</b> <span class="tt-muted">logprob ${t.logprob.toFixed(3)}</span></div>` +
    (rows ? `<div class="tt-muted" style="margin-top:4px">top alternatives</div><div class="tt-alts">${rows}</div>` : "") +
    `<div class="tt-muted" style="margin-top:4px">click: what it attended to</div>`
  );
}

function tokenChip(t, step, onOpen) {
  const el = document.createElement("span");
  el.className = "tok gen fresh";
  el.tabIndex = 0;
  el.dataset.step = step;
  const p = t.logprob == null ? null : Math.exp(t.logprob);
  const table = lut("viridis");
  const i = Math.max(0, Math.min(255, Math.round((p ?? 0.5) * 255))) * 3;
  el.style.setProperty("--chip-rgb", `${table[i]}, ${table[i + 1]}, ${table[i + 2]}`);
  const text = t.delta ?? t.text ?? "";
  text.split("\n").forEach((part, k) => {
    if (k > 0) {
      const ws = document.createElement("span");
      ws.className = "ws";
      ws.textContent = "↵";
      el.append(ws, "\n");
    }
    if (part) el.append(part);
  });
  if (!text) el.textContent = "∅";
  el.setAttribute("aria-label", `${visible(text)}${p == null ? "" : `: probability ${(p * 100).toFixed(1)}%`}`);
  const show = () => {
    const r = el.getBoundingClientRect();
    showTooltip(chipTooltipHTML(t), r.left, r.bottom);
  };
  el.addEventListener("mouseenter", show);
  el.addEventListener("focus", show);
  el.addEventListener("mouseleave", hideTooltip);
  el.addEventListener("blur", hideTooltip);
  el.addEventListener("click", () => onOpen(step));
  el.addEventListener("keydown", (e) => {
    if (e.key === "Enter" || e.key === " ") {
      e.preventDefault();
      onOpen(step);
    }
  });
  return el;
}

/** Seconds with one decimal, or milliseconds below one second. */
const duration = (ms) => (ms >= 1000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms)} ms`);

export class OutputPanel {
  /** onOpen(step): a chip was clicked (show what that token attended to). */
  constructor(onOpen) {
    this.out = $("#output");
    this.status = $("#gen-status");
    this.onOpen = onOpen;
    this.emptyNote = this.out.innerHTML;
  }

  /** Nothing generated (e.g. another model was chosen): the panel as the page opened. */
  reset() {
    delete this.out.dataset.done;
    delete this.out.dataset.model;
    this.out.innerHTML = this.emptyNote;
    $("#gen-stats").replaceChildren();
    this.setStatus("");
  }

  /**
   * A new output: the prompt, then the generated chips. An encoder-decoder's prompt is its
   * source and the output a translation of it, not a continuation: an arrow parts them.
   */
  start(prompt, { translation = false, model = "" } = {}) {
    delete this.out.dataset.done;
    this.out.dataset.model = model;
    const span = document.createElement("span");
    span.className = "tok prompt";
    span.textContent = prompt;
    this.out.replaceChildren(span);
    if (translation) {
      const sep = document.createElement("span");
      sep.className = "translation-sep";
      sep.textContent = " → ";
      sep.setAttribute("aria-label", "translated as");
      this.out.append(sep);
    }
    $("#gen-stats").replaceChildren();
    this.setStatus("waiting…", true);
  }

  /**
   * Show the tokens of a rebuilt generation (a shared link); `probs` (thousandths, one per
   * token, or null) tint them as the sender saw them.
   */
  showTokens(promptText, tokens, { probs = null, translation = false, model = "" } = {}) {
    this.start(promptText, { translation, model });
    const withP = probs && probs.length === tokens.length
      ? tokens.map((t, i) => ({ ...t, logprob: Math.log(Math.max(0.0005, probs[i] / 1000)), fromLink: true }))
      : tokens;
    this.addMany(withP, 0);
    this.finish("rebuilt from the link's token ids");
  }

  add(t, step) {
    this.addMany([t], step);
  }

  /** Append the chips of `tokens` (the first is generated token `from`), with one layout read. */
  addMany(tokens, from) {
    if (!tokens.length) return;
    const follow = this.out.scrollHeight - this.out.scrollTop - this.out.clientHeight < 80;
    const frag = document.createDocumentFragment();
    tokens.forEach((t, i) => frag.append(tokenChip(t, from + i, this.onOpen)));
    this.out.append(frag);
    if (follow) this.out.scrollTop = this.out.scrollHeight;
    const n = from + tokens.length;
    this.setStatus(`${n} token${n === 1 ? "" : "s"}…`, true);
  }

  setStatus(text, running = false) {
    this.status.textContent = text;
    this.status.classList.toggle("running", running);
  }

  failed(hadTokens) {
    this.setStatus("failed");
    this.out.dataset.done = "error";
    if (!hadTokens) this.out.replaceChildren(Object.assign(document.createElement("p"), { className: "empty-note", textContent: "Nothing generated — see the message above." }));
  }

  /**
   * The run is over. `seen`: what this browser measured ({tokens, ms} from pressing Generate
   * to the last token); `done`: the server's figures. Each rate is named for what it measures:
   * the browser's includes the network, the queue, the prefill and the page's own drawing.
   */
  finish(status, { done = null, seen = null } = {}) {
    this.setStatus(status);
    const stats = [];
    if (done) stats.push(`<span><b>${done.usage.completion_tokens}</b> tokens</span>`, `<span>prompt <b>${done.usage.prompt_tokens}</b></span>`);
    if (seen?.tokens) {
      const rate = seen.tokens / Math.max(1e-3, seen.ms / 1000);
      stats.push(`<span class="seen-rate" title="Measured in this browser: ${seen.tokens} tokens in ${duration(seen.ms)}, from pressing Generate to the last token (network, queue, prefill and drawing included)">in this browser <b>${rate.toFixed(1)}</b> tok/s <span class="stat-note">(${seen.tokens} in ${duration(seen.ms)})</span></span>`);
    }
    if (done) {
      const tm = done.timings;
      stats.push(
        `<span class="server-rate" title="The server's own decoding rate: generated tokens per second of decode steps, without the network, the queue or the prefill">server decode <b>${tm.tokens_per_second.toFixed(1)}</b> tok/s</span>`,
        `<span>prefill <b>${tm.prefill_ms.toFixed(0)}</b> ms</span>`,
        `<span>queue <b>${tm.queue_ms.toFixed(0)}</b> ms</span>`,
      );
    }
    $("#gen-stats").innerHTML = stats.join("");
    this.out.dataset.done = "1";
  }

  markStep(step) {
    this.out.querySelectorAll(".tok.gen.current").forEach((el) => el.classList.remove("current"));
    const el = this.out.querySelector(`.tok.gen[data-step="${step}"]`);
    if (!el) return;
    el.classList.add("current");
    // scroll the panel only, never the page (on a phone the views are below it)
    const top = el.offsetTop; // .output is positioned: offsets are within it
    if (top < this.out.scrollTop || top + el.offsetHeight > this.out.scrollTop + this.out.clientHeight) this.out.scrollTop = top - this.out.clientHeight / 2;
  }
}
