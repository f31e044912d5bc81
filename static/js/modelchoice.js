// The model the page explains: the store's `model` key picks it ("" = the server's default).
// Using one loads its description (model.js), fits the page to its family (tabs, sidebar,
// panels, layer/head controls) and puts it in the store with the constraint for its ranges.

import { setRequestModel } from "./api.js";
import { loadModel, validModel, resolveModel, fitPageToModel } from "./model.js";
import { modelControls } from "./controls.js";
import { viewIdsFor } from "./views/registry.js";
import { constrainState } from "./views/params.js";

export class ModelChoice {
  /** panels: the Panels (panels.js) to mount for the model. */
  constructor(store, panels) {
    this.store = store;
    this.panels = panels;
    this.seq = 0;
    this.target = null; // the name of the model loaded or being loaded
  }

  /** Whether state value `name` picks another model than the one loaded or being loaded. */
  differs(name) {
    return resolveModel(name) !== this.target;
  }

  /**
   * Load model `name`, fit the page to it and put it in the store with `patch` (one change:
   * views and panels never see the new model with the old one's data). Resolves to its
   * description, or null if it failed or a newer choice came meanwhile.
   */
  async use(name, patch = {}) {
    const mine = ++this.seq;
    this.target = resolveModel(name);
    const meta = await loadModel(name);
    if (!meta || mine !== this.seq) return null;
    this.target = meta.name;
    setRequestModel(validModel(name) || null);
    modelControls(this.store, meta);
    fitPageToModel(meta);
    this.panels.setModel(meta);
    const views = viewIdsFor(meta);
    this.store.setConstraint((next) => constrainState({ ...next, model: validModel(next.model) }, meta, views), { meta, ...patch });
    return meta;
  }
}
