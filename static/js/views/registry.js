// The views, in tab order. Adding one is a local change: write a module with a class that has
// mount(host) / render(params, changed) -> drawn? / unmount() (and optionally exportPicture()
// and exportData()), and add a line here. `source` says what it draws from ("analysis": the
// analysed sequence, "generation": a generation); `controls` lists the toolbar controls it
// uses (data-ctl names in index.html); a panel of options for it is an element with
// data-view="<id>" inside #view-options, its inputs bound to state keys by data-key.

import { HeadView } from "./headview.js";
import { ModelView } from "./modelview.js";
import { AggregateView } from "./aggregateview.js";
import { DiffView } from "./diffview.js";
import { LineView } from "./lineview.js";
import { GenView } from "./genview.js";
import { CrossView } from "../translator/crossview.js";
import { DecoderView } from "../translator/decoderview.js";
import { AlignView } from "../translator/alignview.js";

export const VIEWS = [
  { id: "head", label: "Head", source: "analysis", controls: ["layer", "head", "sink", "cmap", "scale", "zoom"], View: HeadView },
  { id: "model", label: "Model", source: "analysis", controls: ["sink", "cmap", "scale"], View: ModelView },
  { id: "aggregate", label: "Aggregate", source: "analysis", controls: ["sink", "cmap", "scale", "zoom"], View: AggregateView },
  { id: "diff", label: "Difference", source: "analysis", controls: ["layer", "head", "sink", "dcmap", "scale", "zoom"], View: DiffView },
  { id: "lines", label: "Lines", source: "analysis", controls: ["layer", "head", "sink"], View: LineView },
  { id: "gen", label: "Generation", source: "generation", controls: ["layer", "head", "sink", "cmap", "scale", "zoom"], View: GenView, title: "What each generated token attended to, step by step" },
  // encoder-decoder only (`families`: the tabs show only for those models; the views above
  // show the encoder's self-attention over the source for them)
  { id: "cross", label: "Cross", source: "analysis", families: ["encoder-decoder"], controls: ["layer", "head", "cmap", "scale", "zoom"], View: CrossView, title: "Cross-attention: target steps down, source tokens across" },
  { id: "align", label: "Alignment", source: "analysis", families: ["encoder-decoder"], controls: ["layer", "head"], View: AlignView, title: "Lines from each target step to the source tokens it reads" },
  { id: "decoder", label: "Decoder", source: "analysis", families: ["encoder-decoder"], controls: ["layer", "head", "cmap", "scale", "zoom"], View: DecoderView, title: "The decoder's causal self-attention over the target" },
];

/** Whether view `v` applies to a model of this family (views without `families` apply to all). */
export const viewFits = (v, family) => !v.families || v.families.includes(family);

export const VIEW_IDS = VIEWS.map((v) => v.id);
export const viewById = (id) => VIEWS.find((v) => v.id === id) ?? VIEWS[0];
