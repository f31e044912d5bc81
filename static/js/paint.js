// Canvas painting shared by every view and the PNG export: theme colours, a matrix painted
// at one pixel per cell through a packed colour LUT, and the colour bar.

import { lut32, css } from "./colormap.js";

export const MONO = '11px ui-monospace, "SF Mono", Menlo, Consolas, "DejaVu Sans Mono", monospace';
export const SANS = 'system-ui, -apple-system, "Segoe UI", sans-serif';

export function cssVar(name, fallback = "#888") {
  const v = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  return v || fallback;
}

/** #rgb, #rrggbb or rgb(r, g, b) -> [r, g, b] */
export function parseColor(str) {
  if (str.startsWith("#")) {
    const h = str.length === 4 ? [...str.slice(1)].map((c) => c + c).join("") : str.slice(1, 7);
    return [0, 2, 4].map((i) => parseInt(h.substr(i, 2), 16));
  }
  const m = str.match(/[\d.]+/g);
  return m ? m.slice(0, 3).map(Number) : [128, 128, 128];
}

/** Map v in [vmin, vmax] to 0..1; gamma != 1 bends it (for diverging maps around the centre). */
export function normaliser({ vmin = 0, vmax = 1, gamma = 1 }) {
  const span = vmax - vmin || 1;
  if (gamma === 1) return (v) => (v - vmin) / span;
  if (vmin < 0) {
    // symmetric: sign(v)·|v/m|^gamma around 0.5
    const m = Math.max(Math.abs(vmin), Math.abs(vmax)) || 1;
    return (v) => 0.5 + 0.5 * Math.sign(v) * Math.pow(Math.min(1, Math.abs(v) / m), gamma);
  }
  return (v) => Math.pow(Math.max(0, (v - vmin) / span), gamma);
}

/**
 * Paint a rows×cols matrix into a new (or given) canvas at one pixel per cell.
 * `causal` masks cells right of each row's diagonal (shifted by rowOffset) with `maskColor`;
 * NaN cells (a hidden first-token column) get it too.
 */
export function paintMatrix(data, rows, cols, { cmap = "viridis", vmin = 0, vmax = 1, gamma = 1, causal = false, rowOffset = 0, maskColor = [128, 128, 128], canvas = null } = {}) {
  const c = canvas || document.createElement("canvas");
  if (c.width !== cols || c.height !== rows) {
    c.width = cols;
    c.height = rows;
  }
  const ctx = c.getContext("2d");
  const img = scratchImage(ctx, cols, rows);
  const px = new Uint32Array(img.data.buffer);
  const table = lut32(cmap);
  const mask = (255 << 24) | (maskColor[2] << 16) | (maskColor[1] << 8) | maskColor[0];
  // the common case (no gamma) inline: t = v·k + off, one multiply-add per cell, no call
  const k = gamma === 1 ? 255 / (vmax - vmin || 1) : 0;
  const off = -vmin * k;
  const norm = gamma === 1 ? null : normaliser({ vmin, vmax, gamma });
  for (let r = 0; r < rows; r++) {
    const base = r * cols;
    const limit = causal ? Math.max(0, Math.min(cols, r + rowOffset + 1)) : cols;
    for (let i = base, end = base + limit; i < end; i++) {
      const v = data[i];
      if (v !== v) {
        px[i] = mask;
        continue;
      }
      const t = norm ? norm(v) * 255 : v * k + off;
      px[i] = table[t <= 0 ? 0 : t >= 255 ? 255 : t | 0];
    }
    if (limit < cols) px.fill(mask, base + limit, base + cols);
  }
  ctx.putImageData(img, 0, 0);
  return c;
}

// one ImageData per size, reused: a model view paints 32 maps of the same size in a row
let scratch = null;
function scratchImage(ctx, cols, rows) {
  if (!scratch || scratch.width !== cols || scratch.height !== rows) scratch = ctx.createImageData(cols, rows);
  return scratch;
}

export function fmtTick(v) {
  const a = Math.abs(v);
  if (a === 0) return "0";
  if (a >= 100) return v.toFixed(0);
  if (a >= 10) return v.toFixed(1);
  if (a >= 0.095) return v.toFixed(2);
  return v.toPrecision(2);
}

/**
 * A horizontal colour bar at (x, y) of width w with min / middle / max ticks under it, and
 * optional end notes (`lowNote`, `highNote`, e.g. "B attends more" / "A attends more").
 * Returns the height used.
 */
export function drawColourBar(ctx, x, y, w, { cmap = "viridis", vmin = 0, vmax = 1, gamma = 1, lowNote = "", highNote = "" } = {}) {
  const barH = 10;
  const norm = normaliser({ vmin, vmax, gamma });
  const inv = (t) => {
    // the value whose colour sits at t (bisection: works for every normaliser)
    let lo = vmin;
    let hi = vmax;
    for (let i = 0; i < 40; i++) {
      const mid = (lo + hi) / 2;
      if (norm(mid) < t) lo = mid;
      else hi = mid;
    }
    return (lo + hi) / 2;
  };
  for (let i = 0; i < w; i++) {
    ctx.fillStyle = css(cmap, i / Math.max(1, w - 1));
    ctx.fillRect(x + i, y + 1, 1, barH);
  }
  ctx.strokeStyle = cssVar("--border");
  ctx.lineWidth = 1;
  ctx.strokeRect(x - 0.5, y + 0.5, w + 1, barH + 1);
  ctx.fillStyle = cssVar("--muted");
  ctx.font = MONO;
  ctx.textBaseline = "top";
  ctx.textAlign = "left";
  ctx.fillText(fmtTick(vmin), x, y + barH + 4);
  ctx.textAlign = "center";
  const mid = gamma === 1 ? (vmin + vmax) / 2 : vmin < 0 ? 0 : inv(0.5);
  ctx.fillText(fmtTick(mid), x + w / 2, y + barH + 4);
  ctx.textAlign = "right";
  ctx.fillText(fmtTick(vmax), x + w, y + barH + 4);
  let h = barH + 18;
  if (lowNote || highNote) {
    ctx.font = `10px ${SANS}`;
    const oneLine = ctx.measureText(lowNote).width + ctx.measureText(highNote).width + 12 <= w;
    ctx.textAlign = "left";
    ctx.fillText(lowNote, x, y + h);
    if (!oneLine) h += 13; // too narrow for both side by side: the high end's note goes below
    ctx.textAlign = "right";
    ctx.fillText(highNote, x + w, y + h);
    h += 14;
  }
  return h;
}

/** The page's legend canvas (CSS-sized) showing a colour-bar spec. */
export function drawLegend(canvas, spec) {
  const dpr = window.devicePixelRatio || 1;
  const W = canvas.clientWidth || 220;
  const H = spec.lowNote || spec.highNote ? 58 : 30;
  canvas.style.height = H + "px";
  canvas.width = Math.round(W * dpr);
  canvas.height = Math.round(H * dpr);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, W, H);
  drawColourBar(ctx, 6, 1, W - 12, spec);
  canvas.setAttribute("aria-label", `colour scale ${spec.cmap} from ${fmtTick(spec.vmin)} to ${fmtTick(spec.vmax)}${spec.label ? ": " + spec.label : ""}`);
}
