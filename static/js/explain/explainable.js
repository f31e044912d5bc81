// A map view whose cell click also explains the clicked query row step by step: the explain
// panel under the map (explainpanel.js), driven by the store's `explain` key (the row; null:
// closed). `group`: the attention group the view draws (null: the family's primary one).
// The panel opens only on the live page (capability "server") and for one head's map (not a
// layer's or the model's mean).

import { ExplainPanel } from "./explainpanel.js";

export const Explainable = (Base, { group = null, averaged = false } = {}) =>
  class extends Base {
    mount(host) {
      super.mount(host);
      this.explain = new ExplainPanel(this.ctx);
      this.explain.mount(host);
      this.heatmap.opts.onEscape = () => this.ctx.select({ pin: [], explain: null }); // Escape clears the pins and closes it
    }

    unmount() {
      this.explain?.unmount();
      super.unmount();
    }

    /** Whether this picture is one head's map of a server's model (only then is there a row to explain). */
    explains(params) {
      return params.model.capabilities.has("server") && (!averaged || (params.settings.xavg ?? "head") === "head");
    }

    explainGroup(params) {
      return group ?? (params.model.groups.length > 1 ? params.model.groups[0].name : null);
    }

    async render(params, changed, isCurrent) {
      const onlyExplain = this.result && changed && changed.size && [...changed].every((k) => k === "explain" || k === "ablate");
      const drawn = onlyExplain ? ((this.params = params), true) : await super.render(params, changed, isCurrent);
      const row = this.explains(params) && params.selection.explain != null && params.selection.explain < (this.result?.rows ?? 0) ? params.selection.explain : null;
      if (isCurrent?.() !== false) this.explain.show(params, row, this.clickedCol, this.explainGroup(params));
      return drawn;
    }

    onCellClick(c) {
      super.onCellClick(c);
      this.clickedCol = c.col;
      const multi = c.event && (c.event.shiftKey || c.event.ctrlKey || c.event.metaKey);
      if (!multi && this.params && this.explains(this.params)) this.ctx.select({ explain: c.row });
    }
  };
