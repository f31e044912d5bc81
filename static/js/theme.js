// Light / dark / follow-the-system theme, kept in localStorage (index.html applies it
// before the first paint). Calls onChange after a switch so canvases repaint.

const THEMES = ["auto", "light", "dark"];

export function currentTheme() {
  return document.documentElement.dataset.theme || "auto";
}

export function applyTheme(t) {
  if (t === "light" || t === "dark") document.documentElement.dataset.theme = t;
  else delete document.documentElement.dataset.theme;
  try {
    if (t === "auto") localStorage.removeItem("attnlens-theme");
    else localStorage.setItem("attnlens-theme", t);
  } catch {
    /* private mode */
  }
  const btn = document.getElementById("theme-toggle");
  btn.querySelector(".theme-name").textContent = t[0].toUpperCase() + t.slice(1);
  btn.setAttribute("aria-label", `Colour theme: ${t === "auto" ? "follow the system" : t} (click to change)`);
}

export function wireTheme(onChange) {
  applyTheme(currentTheme());
  document.getElementById("theme-toggle").addEventListener("click", () => {
    applyTheme(THEMES[(THEMES.indexOf(currentTheme()) + 1) % THEMES.length]);
    onChange();
  });
  window.matchMedia?.("(prefers-color-scheme: dark)").addEventListener?.("change", () => currentTheme() === "auto" && onChange());
}
