// The views, in tab order. Adding one is a local change: write a module with a class that has
// mount(host) / render(params, changed) -> drawn? / unmount() (and optionally exportPicture()
// and exportData()), and add a line here. `source` says what it draws from ("analysis": the
// analysed sequence, "generation": a generation); `controls` lists the toolbar controls it
// uses (data-ctl names in index.html); `keys` (optional) the state keys of its own it redraws on
// (declared in state/schema.js, read from the params object); a panel of options for it is an element with
// data-view="<id>" inside #view-options, its inputs bound to state keys by data-key.
// `needs` (optional) lists the capabilities a model must have for the view (its tab hides for
// others): what its family declares, read by family.js ("generation", "target", "cross", ...),
// and the tasks it answers ("fill-mask", "classify"); the page never tests a family's name.
// PANELS are the same idea for the side panels a model has (an encoder's fill-mask and
// classify, read from the store's text; its compare panel, on two sentences of its own) and
// for readouts under the picture (`slot: "frame"`).
// "server": the live page (model.js), not a notebook's embedded answer: views that call the
// analysis routes (/heads, /lens, /logits) need it.
// `shows` (optional) names the attention group a view draws when it is not the family's
// primary one (the atlas opens a head of that group there).

import { HeadView } from "./headview.js";
import { ModelView } from "./modelview.js";
import { AggregateView } from "./aggregateview.js";
import { DiffView } from "./diffview.js";
import { LineView } from "./lineview.js";
import { GenView } from "./genview.js";
import { CrossView } from "../translator/crossview.js";
import { DecoderView } from "../translator/decoderview.js";
import { AlignView } from "../translator/alignview.js";
import { FillMaskPanel } from "../encoder/fillmask.js";
import { ClassifyPanel } from "../encoder/classify.js";
import { PooledPanel } from "../encoder/pooled.js";
import { ComparePanel } from "../encoder/compare.js";
import { AtlasView } from "../explain/atlasview.js";
import { LensView } from "../explain/lensview.js";
import { AblateView } from "../explain/ablateview.js";
import { CausesView } from "../explain/causesview.js";
import { fits } from "../family.js";

export const VIEWS = [
  { id: "head", label: "Head", source: "analysis", controls: ["layer", "head", "sink", "cmap", "scale", "zoom", "pooled"], keys: ["explain", "win"], View: HeadView },
  { id: "model", label: "Model", source: "analysis", controls: ["sink", "cmap", "scale"], keys: ["ablate", "morder"], View: ModelView },
  // issue 18: what each head does (every group the family has), the logit lens, and ablation
  { id: "atlas", needs: ["server"], label: "Atlas", source: "analysis", controls: [], keys: ["ablate", "probe"], View: AtlasView, title: "Heads view: every head coloured by its strongest role (probe: repeated random tokens)" },
  { id: "aggregate", label: "Aggregate", source: "analysis", controls: ["sink", "cmap", "scale", "zoom"], View: AggregateView },
  { id: "diff", label: "Difference", source: "analysis", controls: ["layer", "head", "sink", "dcmap", "scale", "zoom"], keys: ["ablate"], View: DiffView },
  { id: "lines", label: "Lines", source: "analysis", controls: ["layer", "head", "sink"], keys: ["lheads"], View: LineView },
  { id: "gen", label: "Generation", source: "generation", needs: ["generation"], controls: ["layer", "head", "sink", "cmap", "scale", "zoom"], View: GenView, title: "What each generated token attended to, step by step" },
  // a family with a target and cross-attention (an encoder-decoder): the views above show its
  // primary group, the encoder's self-attention over the source
  { id: "cross", label: "Cross", source: "analysis", needs: ["cross"], shows: "cross", controls: ["layer", "head", "cmap", "scale", "zoom"], keys: ["explain"], View: CrossView, title: "Cross-attention: target steps down, source tokens across" },
  { id: "align", label: "Alignment", source: "analysis", needs: ["cross"], controls: ["layer", "head"], View: AlignView, title: "Lines from each target step to the source tokens it reads" },
  { id: "decoder", label: "Decoder", source: "analysis", needs: ["target"], shows: "decoder", controls: ["layer", "head", "cmap", "scale", "zoom"], keys: ["explain"], View: DecoderView, title: "The decoder's causal self-attention over the target" },
  { id: "lens", needs: ["server"], label: "Lens", source: "analysis", controls: [], keys: ["ablate", "lensat"], View: LensView, title: "Logit lens: what each layer predicts at each position" },
  { id: "ablate", needs: ["server"], label: "Ablate", source: "analysis", controls: [], keys: ["ablate"], View: AblateView, title: "Remove heads and see what changes" },
  // issue 46: which heads carry the difference between a clean and a corrupted prompt (a model that
  // generates: a causal LM's, or an encoder-decoder's sources read with one target)
  { id: "causes", needs: ["server", "generation"], label: "Causes", source: "analysis", controls: [], keys: ["clean", "corrupted", "answer", "foil", "method", "component", "sender", "ctarget"], View: CausesView, title: "Activation patching: which heads carry the difference between a clean and a corrupted prompt" },
];

/** Whether view or panel `v` applies to a model (its description, with `capabilities`: model.js). */
export const viewFits = (v, meta) => fits(v, meta.capabilities);

// a panel needs the task it calls (GET /models lists each model's tasks)
export const PANELS = [
  { id: "fill-mask", needs: ["fill-mask"], slot: "sidebar", Panel: FillMaskPanel },
  { id: "classify", needs: ["classify"], slot: "sidebar", Panel: ClassifyPanel },
  { id: "pooled", needs: ["classify"], slot: "frame", Panel: PooledPanel }, // the rows the classifier pools
  { id: "compare", needs: ["embeddings"], slot: "sidebar", Panel: ComparePanel }, // two sentences' cosine and maps
];

export const VIEW_IDS = VIEWS.map((v) => v.id);
export const viewById = (id) => VIEWS.find((v) => v.id === id) ?? VIEWS[0];
/** The views a model has, in tab order. */
export const viewIdsFor = (meta) => VIEWS.filter((v) => viewFits(v, meta)).map((v) => v.id);
