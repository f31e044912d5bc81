// One floating tooltip for the whole page, placed next to a point and kept on screen.

let el = null;

function ensure() {
  if (!el) {
    el = document.getElementById("tooltip");
    if (!el) {
      el = document.createElement("div");
      el.id = "tooltip";
      el.setAttribute("role", "tooltip");
      document.body.append(el);
    }
  }
  return el;
}

/** Show `content` (a string of trusted HTML or a Node) near viewport point (x, y). */
export function showTooltip(content, x, y) {
  const t = ensure();
  if (typeof content === "string") t.innerHTML = content;
  else t.replaceChildren(content);
  t.hidden = false;
  t.classList.add("visible");
  const pad = 14;
  const w = t.offsetWidth;
  const h = t.offsetHeight;
  let left = x + pad;
  let top = y + pad;
  if (left + w > window.innerWidth - 8) left = Math.max(8, x - pad - w);
  if (top + h > window.innerHeight - 8) top = Math.max(8, y - pad - h);
  t.style.left = `${left}px`;
  t.style.top = `${top}px`;
}

export function hideTooltip() {
  const t = ensure();
  t.classList.remove("visible");
  t.hidden = true;
}

// On a touch screen a tooltip stays until the next tap somewhere else.
document.addEventListener(
  "pointerdown",
  (e) => {
    if (e.pointerType === "touch" && el && !el.hidden && !(e.target instanceof HTMLCanvasElement)) hideTooltip();
  },
  { passive: true },
);
