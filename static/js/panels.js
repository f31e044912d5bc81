// The side panels and readouts a model has (views/registry.js PANELS): mounted when
// the model changes, given the same params object as the views on every state change.

import { PANELS, viewFits } from "./views/registry.js";

export class Panels {
  /** ctx: the panels' actions; hosts: {sidebar, frame} elements by a panel's `slot`. */
  constructor(ctx, hosts) {
    this.ctx = ctx;
    this.hosts = hosts;
    this.mounted = new Map(); // id -> panel
    this.fresh = new Set(); // mounted, not drawn yet
  }

  /** Mount the panels this model has and remove the others. */
  setModel(meta) {
    for (const p of PANELS) {
      const fits = !!meta && viewFits(p, meta);
      const panel = this.mounted.get(p.id);
      if (fits && !panel) {
        const made = new p.Panel(this.ctx);
        made.mount(this.hosts[p.slot]);
        this.mounted.set(p.id, made);
        this.fresh.add(p.id);
      } else if (!fits && panel) {
        panel.unmount();
        this.mounted.delete(p.id);
      }
    }
    for (const host of Object.values(this.hosts)) host.hidden = !host.childElementCount;
  }

  get count() {
    return this.mounted.size;
  }

  /** changed: the state keys that changed, or null (draw everything). */
  render(params, changed) {
    for (const [id, panel] of this.mounted) {
      const first = this.fresh.delete(id);
      Promise.resolve(panel.render(params, first ? null : changed)).catch((err) => this.ctx.showError(err, `The ${id} panel`));
    }
  }
}
