// PNG and JSON downloads of the current view. A PNG carries a title (model, view, layer,
// head), the view's own picture with its token labels, and a colour bar with its label (for a
// difference: which end means A and which B); it is drawn at least MIN_WIDTH pixels wide, and
// its title and legend are also stored as PNG text chunks.

import { cssVar, drawColourBar, SANS } from "./paint.js";

export const MIN_WIDTH = 1200;

function download(blob, name) {
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = name;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 2000);
}

export function exportName(s, ext) {
  const part = { head: `L${s.layer}H${s.head}`, lines: s.lheads ? `lines-L${s.layer}-heads-${s.lheads.join("-") || "none"}` : `lines-L${s.layer}H${s.head}`, model: "all-heads", aggregate: s.op, diff: "difference", gen: `gen-step${s.step}` }[s.view] ?? s.view;
  return `attnlens-${part}${s.sink ? "-nosink" : ""}.${ext}`;
}

/** Compose title + picture + colour bar onto one opaque canvas; null if the view drew nothing. */
export function composePNG(view, { model, viewLabel }) {
  const probe = view?.exportPicture?.(1);
  if (!probe) return null;
  const scale = Math.min(8, Math.max(2, Math.ceil(MIN_WIDTH / Math.max(1, probe.canvas.width))));
  const pic = view.exportPicture(scale);
  const title = `${model} · ${viewLabel} · ${pic.title}`;
  const pad = 16;
  const titleH = 30;
  const legendH = pic.legend ? (pic.legend.lowNote ? 80 : 52) : 0;
  const w = Math.max(pic.canvas.width / scale + 2 * pad, 420);
  const h = titleH + pic.canvas.height / scale + legendH + 2 * pad;
  const c = document.createElement("canvas");
  c.width = Math.max(MIN_WIDTH, Math.round(w * scale));
  c.height = Math.round(h * scale);
  const k = c.width / w;
  const ctx = c.getContext("2d");
  ctx.fillStyle = cssVar("--surface", "#fff");
  ctx.fillRect(0, 0, c.width, c.height);
  ctx.scale(k, k);
  ctx.fillStyle = cssVar("--text", "#111");
  ctx.font = `600 15px ${SANS}`;
  ctx.textBaseline = "top";
  ctx.fillText(title, pad, pad, w - 2 * pad);
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(pic.canvas, pad, pad + titleH, pic.canvas.width / scale, pic.canvas.height / scale);
  if (pic.legend) {
    const y = pad + titleH + pic.canvas.height / scale + 12;
    const bw = Math.min(360, w - 2 * pad);
    ctx.fillStyle = cssVar("--muted", "#555");
    ctx.font = `12px ${SANS}`;
    ctx.fillText(pic.legend.label || "", pad, y);
    drawColourBar(ctx, pad, y + 18, bw, pic.legend);
  }
  const notes = [pic.legend?.label, pic.legend?.lowNote, pic.legend?.highNote].filter(Boolean);
  return { canvas: c, title, legend: notes.join(" · ") };
}

// --- PNG text chunks ----------------------------------------------------------------------
const CRC_TABLE = Array.from({ length: 256 }, (_, n) => {
  let c = n;
  for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
  return c >>> 0;
});

function crc32(bytes) {
  let c = 0xffffffff;
  for (const b of bytes) c = CRC_TABLE[(c ^ b) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

/** An iTXt chunk (UTF-8 text) with `keyword`. */
function textChunk(keyword, text) {
  const enc = new TextEncoder();
  const body = new Uint8Array([...enc.encode(keyword), 0, 0, 0, 0, 0, ...enc.encode(text)]);
  const type = enc.encode("iTXt");
  const out = new Uint8Array(12 + body.length);
  const dv = new DataView(out.buffer);
  dv.setUint32(0, body.length);
  out.set(type, 4);
  out.set(body, 8);
  dv.setUint32(8 + body.length, crc32(new Uint8Array([...type, ...body])));
  return out;
}

async function withText(blob, entries) {
  const png = new Uint8Array(await blob.arrayBuffer());
  const ihdrEnd = 8 + 12 + 13; // signature + IHDR chunk
  const chunks = entries.map(([k, v]) => textChunk(k, v));
  return new Blob([png.slice(0, ihdrEnd), ...chunks, png.slice(ihdrEnd)], { type: "image/png" });
}

export async function exportPNG(view, { state, model, viewLabel }) {
  const out = composePNG(view, { model, viewLabel });
  if (!out) return false;
  const blob = await new Promise((resolve) => out.canvas.toBlob(resolve, "image/png"));
  const tagged = await withText(blob, [
    ["Title", out.title],
    ["Description", out.legend],
    ["Source", window.location.href],
    ["Software", "attnlens"],
  ]);
  download(tagged, exportName(state, "png"));
  return true;
}

export function exportJSON(view, { state, model }) {
  const data = view?.exportData?.();
  if (!data) return false;
  const doc = { model, text: state.att?.text, view: state.view, layer: state.layer, head: state.head, first_token_sink_hidden: state.sink, url: window.location.href, ...data };
  download(new Blob([JSON.stringify(doc, null, 1)], { type: "application/json" }), exportName(state, "json"));
  return true;
}

/** The PNG and JSON buttons; `current()` -> {view, opts} of the view on screen. */
export function wireExportButtons(current, showError) {
  const nothing = () => showError(new Error("nothing is drawn: there is nothing to export"), "Export", { warn: true });
  document.querySelector("#export-png").addEventListener("click", async () => {
    const { view, opts } = current();
    if (!(await exportPNG(view, opts))) nothing();
  });
  document.querySelector("#export-json").addEventListener("click", () => {
    const { view, opts } = current();
    if (!exportJSON(view, opts)) nothing();
  });
}
