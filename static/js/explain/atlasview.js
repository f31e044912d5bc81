// Heads view (the atlas): one cell per layer × head of every attention group the family has
// (POST /heads), coloured by the head's strongest role, its scores on hover or focus. A click
// opens the head in the view that draws its group; in "choose heads to ablate" mode (or with
// Alt / Shift held) a click adds the head to the ablation instead. "Probe" scores the
// repeated-random sequence (BOS, n random tokens, the same n again), where induction heads show.
// "Rank the heads" lists one group's heads as a table, a column per score the server gives (an
// encoder's Clark et al. scores among them), sorted by the column whose header is clicked.

import { fetchHeads, probeFor } from "./explain_api.js";
import { isAblated, toggleAblation, formatAblation } from "./ablation.js";
import { escapeHTML } from "../tokens.js";
import { showTooltip, hideTooltip } from "../tooltip.js";

// one colour per role the server names; a role it adds later gets a colour from its name
export const ROLE_COLOURS = {
  previous_token: "#2563eb",
  duplicate_token: "#9333ea",
  induction: "#dc2626",
  first_token: "#64748b",
  self: "#059669",
  broad: "#d97706",
  alignment: "#0891b2",
  next_token: "#db2777",
  cls: "#0f766e",
  sep: "#65a30d",
  punctuation: "#a16207",
  mixed: "#cbd5e1",
};
const SHORT = { previous_token: "prev", duplicate_token: "dup", induction: "ind", first_token: "first", self: "self", broad: "broad", alignment: "align", next_token: "next", cls: "CLS", sep: "SEP", punctuation: "punct", mixed: "mix" };
// an encoder's roles and Clark et al.'s scores (on the server's fixed sentences), named for people
const ROLE_LABELS = { cls: "attends to [CLS]", sep: "attends to [SEP]", punctuation: "attends to punctuation" };
const SCORE_LABELS = {
  clark_cls: "Clark: to [CLS]",
  clark_sep: "Clark: to [SEP]",
  clark_punctuation: "Clark: to punctuation",
  clark_previous: "Clark: to previous",
  clark_next: "Clark: to next",
  clark_entropy: "Clark: entropy (nats)",
  role_score: "role score",
};

export function roleColour(role) {
  if (ROLE_COLOURS[role]) return ROLE_COLOURS[role];
  let h = 0;
  for (const c of String(role)) h = (h * 31 + c.charCodeAt(0)) % 360;
  return `hsl(${h} 60% 45%)`;
}

const ROLE_SCORE = { broad: "entropy", cls: "clark_cls", sep: "clark_sep", punctuation: "clark_punctuation" }; // the server's ROLE_SCORE
const label = (role) => String(role).replace(/_/g, " ");
const roleLabel = (role) => ROLE_LABELS[role] ?? label(role);
const scoreLabel = (name) => SCORE_LABELS[name] ?? label(name);
const missing = (v) => v == null || Number.isNaN(v);
const num = (v) => (v == null || Number.isNaN(v) ? "—" : Math.abs(v) >= 10 ? v.toFixed(1) : v.toFixed(2));

export class AtlasView {
  constructor(ctx) {
    this.ctx = ctx;
    this.params = null;
    this.answer = null;
    this.choosing = false; // a click toggles ablation instead of opening the head
    this.sort = { key: "head", desc: false }; // the ranking's column and direction
    this.rankGroup = 0;
  }

  mount(host) {
    this.host = host;
    this.root = document.createElement("div");
    this.root.className = "atlas";
    this.root.innerHTML = `
      <div class="atlas-bar" role="group" aria-label="What the atlas scores">
        <span class="segmented" role="radiogroup" aria-label="Score heads over">
          <button type="button" class="btn small" data-probe="0" role="radio">This text</button>
          <button type="button" class="btn small" data-probe="1" role="radio" title="BOS, then n random tokens, then the same n again: an induction head attends to the token after the previous copy of the current one">Probe: repeated random tokens</button>
        </span>
        <button type="button" class="btn small atlas-choose" aria-pressed="false" title="While on, a click adds a head to the ablation (or removes it); Alt- or Shift-click does the same at any time">Choose heads to ablate</button>
        <span class="atlas-ablated hint" aria-live="polite"></span>
      </div>
      <div class="atlas-legend" aria-label="Roles"></div>
      <div class="atlas-groups"></div>
      <details class="atlas-rank"><summary>Rank the heads by a score</summary><div class="atlas-rank-body"></div></details>
      <div class="atlas-notes hint"></div>`;
    host.append(this.root);
    for (const b of this.root.querySelectorAll("[data-probe]")) b.addEventListener("click", () => this.ctx.select({ probe: b.dataset.probe === "1" }));
    this.chooseBtn = this.root.querySelector(".atlas-choose");
    this.chooseBtn.addEventListener("click", () => {
      this.choosing = !this.choosing;
      this.chooseBtn.setAttribute("aria-pressed", String(this.choosing));
      this.root.classList.toggle("choosing", this.choosing);
    });
    this.rankDetails = this.root.querySelector(".atlas-rank");
    this.rankDetails.addEventListener("toggle", () => this.buildRank());
  }

  unmount() {
    hideTooltip();
    this.root?.remove();
  }

  async render(params, changed, isCurrent = () => true) {
    const prev = this.params;
    this.params = params;
    for (const b of this.root.querySelectorAll("[data-probe]")) b.setAttribute("aria-checked", String((b.dataset.probe === "1") === params.settings.probe));
    if (prev && this.answer && changed && [...changed].every((k) => ["ablate", "layer", "head", "pin", "zoom", "explain"].includes(k))) {
      this.markCells();
      return true;
    }
    const probe = params.settings.probe ? probeFor(params.model) : null;
    let answer;
    try {
      answer = await this.ctx.track(fetchHeads(params.attention, { probe }));
    } catch (err) {
      if (!isCurrent()) return false;
      this.answer = null;
      this.root.querySelector(".atlas-groups").replaceChildren();
      this.ctx.setCaption("");
      this.ctx.showError(err, "Scoring the heads");
      return false;
    }
    if (!isCurrent()) return false;
    this.answer = answer;
    this.build();
    return true;
  }

  /** The view that draws `group`'s maps (the registry's `shows`), else the Head view for the primary group. */
  viewFor(group, index) {
    const v = this.ctx.views?.find((x) => x.shows === group && this.params.model.capabilities && (x.needs ?? []).every((n) => this.params.model.capabilities.has(n)));
    if (v) return v.id;
    return index === 0 ? "head" : null;
  }

  build() {
    const a = this.answer;
    const p = this.params;
    this.ctx.setLegend(null);

    const over = a.probe
      ? `the repeated-random probe (${a.probe.length} random tokens twice, seed ${a.probe.seed})`
      : `this text (${a.tokens.length} tokens)`;
    this.ctx.setCaption(
      `<b>What each head does</b> over ${escapeHTML(over)}: every cell is one head, coloured by its strongest role ` +
        `(the score over its threshold; “mixed”: none is). Hover or focus a cell for its scores; click it to open the head; Alt- or Shift-click (or “Choose heads to ablate”) adds it to the ablation.`,
    );
    // the legend: every role with the threshold it used
    const roles = new Set(Object.keys(a.thresholds ?? {}));
    for (const g of a.groups) for (const row of g.heads) for (const h of row) roles.add(h.role);
    roles.add("mixed");
    this.root.querySelector(".atlas-legend").innerHTML = [...roles]
      .map((r) => `<span class="atlas-role" data-role="${escapeHTML(r)}"><i style="background:${roleColour(r)}"></i>${escapeHTML(roleLabel(r))}${a.thresholds?.[r] != null ? ` ≥ ${num(a.thresholds[r])}` : ""}</span>`)
      .join("");
    const host = this.root.querySelector(".atlas-groups");
    host.replaceChildren();
    const several = a.groups.length > 1;
    a.groups.forEach((g, gi) => {
      const section = document.createElement("section");
      section.className = "atlas-group";
      section.dataset.group = g.name;
      const L = g.heads.length;
      const H = g.heads[0]?.length ?? 0;
      const declared = p.model.groups.find((x) => x.name === g.name);
      if (several) {
        const h = document.createElement("h3");
        h.textContent = declared?.description ? `${g.name}: ${declared.description}` : g.name;
        section.append(h);
      }
      const grid = document.createElement("div");
      grid.className = "atlas-grid";
      const avail = (this.host.clientWidth || 800) - 48;
      const size = Math.max(34, Math.min(78, Math.floor(avail / Math.max(1, H)) - 4));
      grid.style.gridTemplateColumns = `32px repeat(${H}, ${size}px)`;
      grid.append(Object.assign(document.createElement("div"), { className: "grid-corner", textContent: "L \\ H" }));
      for (let h = 0; h < H; h++) grid.append(Object.assign(document.createElement("div"), { className: "grid-col-label", textContent: `H${h}` }));
      const target = this.viewFor(g.name, gi);
      const ablGroup = several ? g.name : null;
      for (let l = 0; l < L; l++) {
        grid.append(Object.assign(document.createElement("div"), { className: "grid-row-label", textContent: `L${l}` }));
        for (let h = 0; h < H; h++) {
          const cell = g.heads[l][h];
          const b = document.createElement("button");
          b.type = "button";
          b.className = "atlas-cell";
          b.dataset.layer = l;
          b.dataset.head = h;
          b.dataset.group = g.name;
          b.dataset.ablgroup = ablGroup ?? "";
          b.dataset.role = cell.role;
          const strength = Math.max(0.25, Math.min(1, cell.role_score ?? 0));
          b.style.setProperty("--role", roleColour(cell.role));
          b.style.setProperty("--strength", String(cell.role === "mixed" ? 0.5 : strength));
          b.classList.toggle("faint", cell.role === "mixed" || strength < 0.55); // dark text on a pale cell
          b.innerHTML = `<span class="atlas-abbr">${escapeHTML(SHORT[cell.role] ?? label(cell.role).slice(0, 5))}</span><span class="atlas-score">${num(cell.role_score)}</span>`;
          b.setAttribute("aria-label", `${several ? g.name + " " : ""}layer ${l}, head ${h}: ${roleLabel(cell.role)} ${num(cell.role_score)}`);
          b.addEventListener("click", (e) => this.activate(e, l, h, ablGroup, target));
          b.addEventListener("mouseenter", () => this.tip(b, g, cell));
          b.addEventListener("focus", () => this.tip(b, g, cell));
          b.addEventListener("mouseleave", hideTooltip);
          b.addEventListener("blur", hideTooltip);
          grid.append(b);
        }
      }
      section.append(grid);
      host.append(section);
    });
    // how each score is defined (a group's own definitions where it has them: an encoder's bidirectional analogues)
    const defs = (d) => Object.entries(d ?? {}).map(([k, v]) => `<b>${escapeHTML(scoreLabel(k))}</b>: ${escapeHTML(v)}`).join("<br>");
    const notes = [a.notes ?? []].flat().map(escapeHTML).join("<br>");
    const sentences = a.clark_sentences?.length ? `<p>Clark et al.'s sentences: ${a.clark_sentences.map((t) => `“${escapeHTML(t)}”`).join(" ")}</p>` : "";
    const perGroup = a.groups.filter((g) => g.definitions && JSON.stringify(g.definitions) !== JSON.stringify(a.definitions));
    this.root.querySelector(".atlas-notes").innerHTML =
      (notes ? `<p>${notes}</p>` : "") +
      `<details><summary>How the scores are defined</summary>${defs(a.definitions)}${perGroup.map((g) => `<p><b>${escapeHTML(g.name)}</b>:<br>${defs(g.definitions)}</p>`).join("")}${sentences}</details>`;
    this.buildRank();
    this.markCells();
  }

  /** A head's cell or row clicked: open it in `target`'s view, or (choosing, Alt, Shift) toggle its ablation. */
  activate(e, l, h, ablGroup, target) {
    if (this.choosing || e.altKey || e.shiftKey) {
      const list = toggleAblation(this.params.ablation, l, h, ablGroup);
      this.ctx.select({ ablate: formatAblation(list) });
    } else if (target) {
      this.ctx.select({ layer: l, head: h, view: target, pin: [], xavg: "head" });
    }
  }

  /**
   * The ranking (drawn while its <details> is open): one group's heads, one row each, a column
   * per score; a header's button sorts by that column (highest first; again: lowest first),
   * undefined scores always last, ties in layer and head order.
   */
  buildRank() {
    const body = this.root.querySelector(".atlas-rank-body");
    const a = this.answer;
    if (!a || !this.rankDetails.open) {
      body.replaceChildren();
      return;
    }
    const gi = Math.min(this.rankGroup, a.groups.length - 1);
    const g = a.groups[gi];
    const several = a.groups.length > 1;
    const heads = g.heads.flat();
    const names = [...new Set(heads.flatMap((h) => Object.keys(h.scores ?? {})))];
    const columns = ["head", "role", "role_score", ...names];
    if (!columns.includes(this.sort.key)) this.sort = { key: "head", desc: false };
    const { key, desc } = this.sort;
    const value = (h, k) => (k === "head" ? h.layer * 65536 + h.head : k === "role" ? roleLabel(h.role) : k === "role_score" ? h.role_score : h.scores?.[k]);
    const rows = [...heads].sort((x, y) => {
      const vx = value(x, key);
      const vy = value(y, key);
      if (missing(vx) || missing(vy)) return missing(vx) - missing(vy) || x.layer - y.layer || x.head - y.head;
      const c = typeof vx === "string" ? vx.localeCompare(vy) : vx - vy;
      return (desc ? -c : c) || x.layer - y.layer || x.head - y.head;
    });
    const defs = g.definitions ?? a.definitions ?? {};
    const th = (k) => {
      const sorted = k === key ? (desc ? "descending" : "ascending") : "none";
      const title = k === "head" ? "layer, then head" : k === "role_score" ? defs.role ?? "" : defs[k] ?? "";
      const arrow = k === key ? (desc ? " ▼" : " ▲") : "";
      return `<th scope="col" aria-sort="${sorted}"><button type="button" class="atlas-sort" data-sort="${escapeHTML(k)}" title="${escapeHTML(title)}">${escapeHTML(k === "head" ? "head" : scoreLabel(k))}${arrow}</button></th>`;
    };
    const target = this.viewFor(g.name, gi);
    const ablGroup = several ? g.name : "";
    const tr = (h) =>
      `<tr data-layer="${h.layer}" data-head="${h.head}" data-role="${escapeHTML(h.role)}"><th scope="row"><button type="button" class="atlas-open" title="open this head (Alt/Shift-click: ablate it)">L${h.layer} H${h.head}</button></th>` +
      `<td class="role"><i style="background:${roleColour(h.role)}"></i>${escapeHTML(roleLabel(h.role))}</td><td>${num(h.role_score)}</td>` +
      names.map((n) => `<td data-score="${escapeHTML(n)}">${num(h.scores?.[n])}</td>`).join("") +
      "</tr>";
    const pick = several
      ? `<label class="atlas-rank-group">Group <select aria-label="Group to rank">${a.groups.map((x, i) => `<option value="${i}"${i === gi ? " selected" : ""}>${escapeHTML(x.name)}</option>`).join("")}</select></label>`
      : "";
    const focused = document.activeElement?.closest?.(".atlas-rank") ? document.activeElement.dataset.sort : null;
    body.innerHTML =
      `${pick}<p class="hint">${heads.length} heads${several ? ` of the ${escapeHTML(g.name)} group` : ""}; click a column's header to sort by it (again: the other way), a head to open it.</p>` +
      `<div class="atlas-rank-scroll"><table class="atlas-table"><thead><tr>${columns.map(th).join("")}</tr></thead><tbody>${rows.map(tr).join("")}</tbody></table></div>`;
    body.querySelector(".atlas-rank-group select")?.addEventListener("change", (e) => {
      this.rankGroup = +e.target.value;
      this.buildRank();
    });
    for (const b of body.querySelectorAll(".atlas-sort"))
      b.addEventListener("click", () => {
        const k = b.dataset.sort;
        this.sort = k === this.sort.key ? { key: k, desc: !this.sort.desc } : { key: k, desc: k !== "head" && k !== "role" };
        this.buildRank();
      });
    for (const b of body.querySelectorAll(".atlas-open")) {
      const row = b.closest("tr");
      b.addEventListener("click", (e) => this.activate(e, +row.dataset.layer, +row.dataset.head, ablGroup || null, target));
    }
    if (focused) body.querySelector(`.atlas-sort[data-sort="${CSS.escape(focused)}"]`)?.focus();
  }

  tip(b, g, cell) {
    const r = b.getBoundingClientRect();
    const rows = Object.entries(cell.scores ?? {})
      .map(([k, v]) => `<div class="tt-row"><span${k === (ROLE_SCORE[cell.role] ?? cell.role) ? ' class="chosen"' : ""}>${escapeHTML(scoreLabel(k))}</span><b>${num(v)}</b></div>`)
      .join("");
    const abl = isAblated(this.params.ablation, cell.layer, cell.head, b.dataset.ablgroup || null) ? '<div class="tt-muted">in the ablation</div>' : "";
    showTooltip(
      `<div class="tt-cell"><b>${this.answer.groups.length > 1 ? escapeHTML(g.name) + " · " : ""}layer ${cell.layer} · head ${cell.head}</b>: ${escapeHTML(roleLabel(cell.role))}</div>${rows}${abl}` +
        `<div class="tt-muted">click: open it · Alt/Shift-click: ablate it</div>`,
      r.right - 4,
      r.top + 4,
    );
  }

  markCells() {
    const { ablation, selection } = this.params;
    for (const b of this.root.querySelectorAll(".atlas-cell")) {
      const l = +b.dataset.layer;
      const h = +b.dataset.head;
      const off = isAblated(ablation, l, h, b.dataset.ablgroup || null);
      b.classList.toggle("ablated", off);
      b.setAttribute("aria-pressed", String(off));
      b.classList.toggle("selected", l === selection.layer && h === selection.head && b.closest(".atlas-group") === this.root.querySelector(".atlas-group"));
    }
    const count = this.params.ablation.length;
    this.root.querySelector(".atlas-ablated").textContent = count ? `${count} head${count > 1 ? "s" : ""} ablated (see the Ablate view)` : "";
  }

  /** Every group's grid with role names and scores, and the roles' key, for the PNG export. */
  exportPicture(scale = 1) {
    const a = this.answer;
    if (!a) return null;
    const cell = 60 * scale;
    const gap = 4 * scale;
    const left = 36 * scale;
    const line = 22 * scale;
    const H = a.groups[0].heads[0].length;
    const height = a.groups.reduce((y, g) => y + 2 * line + g.heads.length * (cell + gap), line);
    const c = document.createElement("canvas");
    c.width = left + H * (cell + gap);
    c.height = height;
    const ctx = c.getContext("2d");
    ctx.textBaseline = "middle";
    ctx.textAlign = "center";
    let y = 0;
    for (const g of a.groups) {
      ctx.fillStyle = "#111";
      ctx.font = `600 ${13 * scale}px system-ui, sans-serif`;
      ctx.textAlign = "left";
      ctx.fillText(a.groups.length > 1 ? g.name : "heads", 0, y + line / 2);
      ctx.textAlign = "center";
      y += line;
      ctx.font = `${11 * scale}px system-ui, sans-serif`;
      for (let h = 0; h < H; h++) ctx.fillText(`H${h}`, left + h * (cell + gap) + cell / 2, y + line / 2);
      y += line;
      g.heads.forEach((row, l) => {
        ctx.fillStyle = "#111";
        ctx.fillText(`L${l}`, left / 2, y + cell / 2);
        row.forEach((hd, h) => {
          const x = left + h * (cell + gap);
          ctx.fillStyle = roleColour(hd.role);
          ctx.globalAlpha = hd.role === "mixed" ? 0.6 : Math.max(0.25, Math.min(1, hd.role_score ?? 0));
          ctx.fillRect(x, y, cell, cell);
          ctx.globalAlpha = 1;
          ctx.fillStyle = "#111";
          ctx.fillText(SHORT[hd.role] ?? label(hd.role).slice(0, 5), x + cell / 2, y + cell * 0.36);
          ctx.fillText(num(hd.role_score), x + cell / 2, y + cell * 0.68);
        });
        y += cell + gap;
      });
    }
    return { canvas: c, title: a.probe ? `head atlas on the repeated-random probe (n = ${a.probe.length}, seed ${a.probe.seed})` : "head atlas", legend: null };
  }

  exportData() {
    return this.answer ? { title: "head atlas", ...this.answer } : null;
  }
}
