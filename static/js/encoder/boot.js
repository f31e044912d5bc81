// Boots the model picker and, for an encoder, the encoder page (attention, fill-mask,
// classify). A decoder keeps the generate page as it is; requests then name the model.

import { setRequestModel } from "../api.js";
import { ClassifyPanel } from "./classify.js";
import { EncoderAttentionView } from "./attention.js";
import { FillMaskPanel, MASK } from "./fillmask.js";
import { chosenModel, loadModels, mountPicker } from "./models.js";

// The address as the user opened it: read before the page's store rewrites the URL.
const INITIAL = new URLSearchParams(location.search);

const SAMPLE = `O Romeo, Romeo! wherefore art thou ${MASK}?
Deny thy father and refuse thy name.`;

function showError(err, what) {
  const box = document.getElementById("messages");
  if (!box) return;
  const p = document.createElement("div");
  p.className = "message error";
  p.textContent = `${what}: ${err.message || err}`;
  box.replaceChildren(p);
}

function clearError() {
  const box = document.getElementById("messages");
  if (box) box.replaceChildren();
}

function startEncoderPage(info) {
  document.body.classList.add("encoder-mode");
  const page = document.createElement("main");
  page.className = "layout enc-layout";
  page.id = "encoder-page";
  const side = document.createElement("aside");
  side.className = "sidebar";
  side.setAttribute("aria-label", "Text, fill-mask and classify");
  side.innerHTML = `
    <form id="enc-form" class="panel" autocomplete="off">
      <div class="panel-head"><h2><label for="enc-text">Text</label></h2>
        <span class="hint">${info.name}: ${info.n_layers} layers × ${info.n_heads} heads, context ${info.context_length}</span></div>
      <textarea id="enc-text" rows="5" spellcheck="false"></textarea>
      <div class="actions"><button type="submit" id="enc-analyse" class="btn">Analyse</button></div>
    </form>`;
  page.append(side);
  document.querySelector("main.layout:not(#encoder-page)")?.after(page);

  const textBox = side.querySelector("#enc-text");
  textBox.value = INITIAL.get("text") ?? SAMPLE;
  const view = new EncoderAttentionView(page, { model: info.name, nLayers: info.n_layers, nHeads: info.n_heads,
    pooling: info.pooling, onError: showError });
  const fill = info.tasks.includes("fill-mask") ? new FillMaskPanel(side, {
    model: info.name, onError: showError,
    onTextChange: (text, { fill: run }) => { textBox.value = text; analyse().then(() => run && fill.run(text)); },
  }) : null;
  const cls = info.tasks.includes("classify") ? new ClassifyPanel(side, { model: info.name, labels: info.labels, onError: showError }) : null;
  cls?.onClick(() => cls.run(textBox.value));

  async function analyse() {
    clearError();
    const text = textBox.value;
    const url = new URL(location.href);
    url.searchParams.set("text", text);
    history.replaceState(null, "", url);
    try {
      const res = await view.load(text);
      fill?.setTokens(res.tokens, text);
    } catch (err) {
      showError(err, "Attention");
    }
  }
  side.querySelector("#enc-form").addEventListener("submit", (e) => { e.preventDefault(); analyse(); });
  textBox.addEventListener("keydown", (e) => { if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); analyse(); } });
  document.body.dataset.encoderReady = "1";
  return analyse();
}

async function boot() {
  let list;
  try {
    list = await loadModels();
  } catch {
    return; // an older server without /models: the page works as before
  }
  const current = chosenModel(list, INITIAL.get("model"));
  if (!current) return;
  mountPicker(document.querySelector(".topbar") ?? document.body, list, current);
  if (current.family === "encoder") await startEncoderPage(current);
  else if (current.name !== list.default) setRequestModel(current.name);
  document.body.dataset.models = "ready";
}

boot();
