// The output panel: the prompt and the generated tokens as chips tinted by probability, their
// tooltips (probability and alternatives), the run's figures, and the current step's mark.

import { lut } from "./colormap.js";
import { showTooltip, hideTooltip } from "./tooltip.js";
import { escapeHTML, visible } from "./tokens.js";

const $ = (sel) => document.querySelector(sel);

function chipTooltipHTML(t) {
  if (t.logprob == null) return `<div class="tt-cell"><span class="tt-tok">${escapeHTML(visible(t.text))}</span></div><div class="tt-muted">no probability reported</div>`;
  const p = Math.exp(t.logprob);
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

export class OutputPanel {
  /** onOpen(step): a chip was clicked (show what that token attended to). */
  constructor(onOpen) {
    this.out = $("#output");
    this.status = $("#gen-status");
    this.onOpen = onOpen;
  }

  start(prompt) {
    delete this.out.dataset.done;
    const span = document.createElement("span");
    span.className = "tok prompt";
    span.textContent = prompt;
    this.out.replaceChildren(span);
    $("#gen-stats").replaceChildren();
    this.setStatus("waiting…", true);
  }

  /** Show the tokens of a rebuilt generation (a shared link): no probabilities. */
  showTokens(promptText, tokens) {
    this.start(promptText);
    tokens.forEach((t, i) => this.add(t, i));
    this.finish("rebuilt from the link's token ids");
  }

  add(t, step) {
    this.out.append(tokenChip(t, step, this.onOpen));
    if (this.out.scrollHeight - this.out.scrollTop - this.out.clientHeight < 80) this.out.scrollTop = this.out.scrollHeight;
    this.setStatus(`${step + 1} token${step ? "s" : ""}…`, true);
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

  finish(status, done = null) {
    this.setStatus(status);
    if (done) {
      const u = done.usage;
      const tm = done.timings;
      $("#gen-stats").innerHTML = [
        `<span><b>${u.completion_tokens}</b> tokens</span>`,
        `<span>prompt <b>${u.prompt_tokens}</b></span>`,
        `<span><b>${tm.tokens_per_second.toFixed(1)}</b> tok/s</span>`,
        `<span>prefill <b>${tm.prefill_ms.toFixed(0)}</b> ms</span>`,
        `<span>queue <b>${tm.queue_ms.toFixed(0)}</b> ms</span>`,
      ].join("");
    }
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
