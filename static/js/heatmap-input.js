// Pointer, touch, wheel and keyboard handling of a Heatmap: hover tooltips, click (or tap) to
// pin a row, a tap also shows the tooltip (no hover on a touch screen), ctrl+wheel / + − zoom,
// arrow keys move a cursor.

export function emitHover(hm, row, col, extra = {}) {
  const m = hm.model;
  hm.hover = { row, col };
  const c = hm.cellCenter(row, col);
  const masked = m.causal && col > row + m.rowOffset;
  hm.opts.onHover?.({ row, col, value: hm.value(row, col), masked, x: c.x, y: c.y, ...extra });
  hm.drawOverlay();
}

function pointAt(hm, e) {
  const rect = hm.overlay.getBoundingClientRect();
  return hm.hit(e.clientX - rect.left, e.clientY - rect.top);
}

/** Mouse, touch, wheel and keyboard on the overlay canvas of `hm`. */
export function bindPointer(hm) {
  const el = hm.overlay;
  el.tabIndex = 0;
  el.setAttribute("role", "img");
  el.addEventListener("pointerdown", (e) => (hm.pointerType = e.pointerType || "mouse"));
  el.addEventListener("mousemove", (e) => {
    if (hm.pointerType === "touch") return;
    const h = pointAt(hm, e);
    if (h?.kind === "cell") {
      if (hm.labelHover != null) hm.opts.onLabelHover?.(null);
      hm.labelHover = null;
      if (!hm.hover || hm.hover.row !== h.row || hm.hover.col !== h.col) emitHover(hm, h.row, h.col);
      el.style.cursor = "crosshair";
    } else if (h) {
      const idx = h.kind === "row" ? h.index + hm.model.rowOffset : h.index;
      hm.hover = null;
      hm.opts.onHover?.(null);
      if (hm.labelHover !== idx) {
        hm.labelHover = idx;
        const c = hm.labelCenter(h.kind, h.index);
        hm.opts.onLabelHover?.({ axis: h.kind, index: idx, x: c.x, y: c.y });
        hm.drawOverlay();
      }
      el.style.cursor = h.kind === "row" ? "pointer" : "default";
    } else {
      clearHover(hm);
      el.style.cursor = "default";
    }
  });
  el.addEventListener("mouseleave", () => hm.pointerType !== "touch" && clearHover(hm));
  el.addEventListener("click", (e) => {
    const h = pointAt(hm, e);
    // a tap has no hover: show the cell's tooltip as well as pinning its row
    if (h?.kind === "cell" && hm.pointerType === "touch") emitHover(hm, h.row, h.col, { touch: true });
    if (h?.kind === "cell") hm.opts.onCellClick?.({ row: h.row, col: h.col, event: e });
    else if (h?.kind === "row") hm.opts.onCellClick?.({ row: h.index, col: null, event: e });
    else if (hm.pointerType === "touch") clearHover(hm);
  });
  el.addEventListener(
    "wheel",
    (e) => {
      if (!e.ctrlKey || !hm.opts.onZoom) return;
      e.preventDefault();
      hm.opts.onZoom(hm.opts.zoom * (e.deltaY < 0 ? 1.25 : 0.8));
    },
    { passive: false },
  );
  el.addEventListener("keydown", (e) => onKey(hm, e));
  el.addEventListener("blur", () => {
    hm.cursor = null;
    clearHover(hm);
  });
}

function onKey(hm, e) {
  const m = hm.model;
  if (!m) return;
  const cur = hm.cursor || hm.hover || { row: 0, col: 0 };
  const moves = { ArrowUp: [-1, 0], ArrowDown: [1, 0], ArrowLeft: [0, -1], ArrowRight: [0, 1], Home: [0, -1e9], End: [0, 1e9] };
  if (moves[e.key]) {
    const [dr, dc] = moves[e.key];
    hm.cursor = { row: Math.max(0, Math.min(m.rows - 1, cur.row + dr)), col: Math.max(0, Math.min(m.cols - 1, cur.col + dc)) };
    emitHover(hm, hm.cursor.row, hm.cursor.col, { keyboard: true });
    hm.hover = null;
    e.preventDefault();
  } else if ((e.key === "Enter" || e.key === " ") && (hm.cursor || hm.hover)) {
    const { row, col } = hm.cursor || hm.hover;
    hm.opts.onCellClick?.({ row, col, event: e });
    e.preventDefault();
  } else if (e.key === "Escape") hm.opts.onEscape?.();
  else if ((e.key === "+" || e.key === "-") && hm.opts.onZoom) hm.opts.onZoom(hm.opts.zoom * (e.key === "+" ? 1.25 : 0.8));
}

export function clearHover(hm) {
  const had = hm.hover || hm.labelHover != null;
  hm.hover = null;
  hm.labelHover = null;
  if (had) {
    hm.opts.onHover?.(null);
    hm.opts.onLabelHover?.(null);
    hm.drawOverlay();
  }
}
