// Drawing a heatmap's static picture: cells, token labels (coloured past the prompt /
// generation boundary), axis titles, the boundary line and the pinned-rows footer. Used for
// the screen and, at any scale, for the PNG export.

import { cssVar, MONO, SANS } from "./paint.js";

/** Width of the rotated row-axis title ("query →") at the left edge: nothing else is drawn there. */
export const ROW_TITLE_W = 18;

/** Cells, labels, titles, boundary and footer, in layout (CSS pixel) coordinates. */
export function drawGrid(ctx, m, L, bitmap, footer) {
  const { left, top, cellW, cellH, gridW, gridH } = L;
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(bitmap, left, top, gridW, gridH);
  ctx.strokeStyle = cssVar("--border");
  ctx.lineWidth = 1;
  ctx.strokeRect(left - 0.5, top - 0.5, gridW + 1, gridH + 1);
  const fg = cssVar("--text");
  const gen = cssVar("--boundary", "#d9480f");
  const B = m.boundary;
  ctx.font = MONO;
  ctx.textBaseline = "middle";
  const rowColour = (r) => (B != null && r + m.rowOffset >= B ? gen : fg);
  ctx.textAlign = "right";
  for (let r = 0; r < L.rowLabels.length; r += L.rowStep) {
    ctx.fillStyle = m.plainRowLabels ? fg : rowColour(r);
    ctx.fillText(L.rowLabels[r], left - 6, top + (r + 0.5) * cellH);
  }
  ctx.textAlign = "left";
  for (let r = 0; r < L.rowLabels2.length; r += L.rowStep) {
    ctx.fillStyle = fg;
    ctx.fillText(L.rowLabels2[r], left + gridW + 6, top + (r + 0.5) * cellH);
  }
  const colText = (labels, y, dir) => {
    for (let c = 0; c < labels.length; c += L.colStep) {
      ctx.save();
      ctx.fillStyle = B != null && c >= B ? gen : fg;
      ctx.translate(left + (c + 0.5) * cellW, y);
      ctx.rotate(dir * Math.PI / 2);
      ctx.textAlign = "left";
      ctx.fillText(labels[c], 0, 0);
      ctx.restore();
    }
  };
  colText(L.colLabels, top - 6, -1);
  colText(L.colLabels2, top + gridH + 6, 1);
  ctx.fillStyle = cssVar("--muted");
  ctx.font = `600 10px ${SANS}`;
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  if (m.colTitle) ctx.fillText(m.colTitle, left, 2);
  if (m.rowTitle) {
    ctx.save();
    ctx.translate(4, top);
    ctx.rotate(Math.PI / 2);
    ctx.fillText(m.rowTitle, 0, -10);
    ctx.restore();
  }
  if (B != null && B > 0 && B < m.cols) drawBoundary(ctx, m, L, B, gen);
  if (footer) drawFooter(ctx, L, footer);
}

/** The prompt ends before position B: a line through both axes and a note above it. */
function drawBoundary(ctx, m, L, B, colour) {
  const { left, top, cellW, cellH, gridW, gridH } = L;
  ctx.save();
  ctx.strokeStyle = colour;
  ctx.lineWidth = 2;
  ctx.beginPath();
  const x = Math.round(left + B * cellW);
  ctx.moveTo(x, 12);
  ctx.lineTo(x, top + gridH);
  const r = B - m.rowOffset;
  if (!m.plainRowLabels && r > 0 && r < m.rows) {
    // from the row labels' column, clear of the rotated axis title at the far left
    const y = Math.round(top + r * cellH);
    ctx.moveTo(ROW_TITLE_W, y);
    ctx.lineTo(left + gridW, y);
  }
  ctx.stroke();
  ctx.fillStyle = colour;
  ctx.font = `600 10px ${SANS}`;
  ctx.textBaseline = "top";
  ctx.textAlign = "right";
  ctx.fillText("prompt", x - 4, 14);
  ctx.textAlign = "left";
  ctx.fillText("generated", x + 4, 14);
  ctx.restore();
}

/** Bars under the grid: the sum of the pinned rows. */
function drawFooter(ctx, L, footer) {
  const { left, cellW, footerTop, footerH, gridW } = L;
  const vals = footer.values;
  let max = 0;
  for (const v of vals) if (v > max) max = v;
  const h = footerH - 14;
  ctx.fillStyle = cssVar("--surface-2");
  ctx.fillRect(left, footerTop, gridW, h);
  ctx.fillStyle = cssVar("--accent");
  for (let c = 0; c < vals.length; c++) {
    const bh = max > 0 ? (vals[c] / max) * h : 0;
    ctx.fillRect(left + c * cellW + (cellW > 3 ? 0.5 : 0), footerTop + h - bh, Math.max(1, cellW - (cellW > 3 ? 1 : 0)), bh);
  }
  ctx.fillStyle = cssVar("--muted");
  ctx.font = `10px ${SANS}`;
  ctx.textAlign = "left";
  ctx.textBaseline = "top";
  ctx.fillText(`${footer.label}  (max ${max.toFixed(3)})`, left, footerTop + h + 2);
}
