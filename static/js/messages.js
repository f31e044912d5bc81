// Error and warning messages above the page, and marking the inputs a server error names.

import { ApiError } from "./api.js";

const host = () => document.getElementById("messages");
const INPUTS = ["prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop", "logprobs", "promptB"];

export function clearFieldErrors() {
  for (const f of INPUTS) document.getElementById(f)?.removeAttribute("aria-invalid");
}

export function clearMessages() {
  host().replaceChildren();
  clearFieldErrors();
}

/** Show `err` (an ApiError or anything with a message); the inputs it names get aria-invalid. */
export function showError(err, context = "", { warn = false } = {}) {
  if (err?.detail === "aborted") return;
  const msg = err?.message || String(err);
  window.__attnlens.errors.push(`${context}: ${msg}`);
  const box = document.createElement("div");
  box.className = "message" + (warn ? " warn" : "");
  box.innerHTML = `<span class="icon" aria-hidden="true">${warn ? "!" : "✕"}</span><div class="body"><span class="title"></span><span class="text"></span></div><button type="button" class="close" aria-label="Dismiss">×</button>`;
  box.querySelector(".title").textContent = context ? `${context} failed` : "Error";
  box.querySelector(".text").textContent = msg;
  box.querySelector(".close").addEventListener("click", () => box.remove());
  const h = host();
  while (h.children.length >= 3) h.firstElementChild.remove();
  h.append(box);
  if (err instanceof ApiError) for (const f of err.fields) document.getElementById(f)?.setAttribute("aria-invalid", "true");
  if (err?.status === 401 && onKeyNeeded) {
    const btn = document.createElement("button");
    btn.type = "button";
    btn.className = "btn small key-btn";
    btn.textContent = "Enter the API key";
    btn.addEventListener("click", onKeyNeeded);
    box.querySelector(".body").append(btn);
  }
}

let onKeyNeeded = null;
/** What the "Enter the API key" button of a 401 message does. */
export function setKeyHandler(fn) {
  onKeyNeeded = fn;
}

export function wireFieldResets() {
  for (const f of INPUTS) document.getElementById(f)?.addEventListener("input", (e) => e.target.removeAttribute("aria-invalid"));
}
