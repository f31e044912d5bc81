// Every piece of page state, in one list. Types: string, int (≥ 0), number (> 0), bool,
// list (of ints ≥ 0, in order), set (a list without repeats), object (data, never in the URL). `url: true` keys are what a link reproduces: the
// URL is derived from this list (state/url.js), so a key added here is shared and restored
// with no other change. The other keys hold data the page fetched or is doing right now.

export const STATE_KEYS = [
  // which model to explain ("" = the server's default); a model picker only has to set it
  { key: "model", type: "string", def: "", url: true },
  // the prompt box, and what the attention views analyse: "prompt" or "gen" (the generation's ids)
  { key: "prompt", type: "string", def: "", url: true },
  { key: "source", type: "string", def: "prompt", url: true },
  // the prompt box holds a conversation (role-tagged turns: chat.js), for a model with a chat template
  { key: "chat", type: "bool", def: false, url: true },
  // a generation: the token ids of prompt + generated text and how many are the prompt, so a
  // link rebuilds exactly the sequence (and the Generation view) its sender saw
  { key: "ids", type: "list", def: null, url: true },
  { key: "plen", type: "int", def: 0, url: true },
  // each generated token's probability in thousandths (0 … 1000), for the output's tint
  { key: "probs", type: "list", def: null, url: true },
  // the sampling form, as typed ("" = the server's default; the server names a bad value). Temperature,
  // top-k and top-p "" are the model's recommended values (GET /models sampling_defaults, else
  // /generate's defaults), which their boxes show (controls.js)
  { key: "max_new_tokens", type: "string", def: "32", url: true },
  { key: "temperature", type: "string", def: "", url: true },
  { key: "top_k", type: "string", def: "", url: true },
  { key: "top_p", type: "string", def: "", url: true },
  { key: "seed", type: "string", def: "", url: true },
  { key: "logprobs", type: "string", def: "5", url: true },
  { key: "stop", type: "string", def: "", url: true },
  { key: "return_attention", type: "bool", def: true, url: true },
  // what is shown
  { key: "view", type: "string", def: "head", url: true },
  { key: "layer", type: "int", def: 0, url: true },
  { key: "head", type: "int", def: 0, url: true },
  { key: "pin", type: "set", def: [], url: true }, // pinned query rows
  { key: "step", type: "int", def: 0, url: true }, // generation step
  { key: "sink", type: "bool", def: false, url: true },
  { key: "cmap", type: "string", def: "viridis", url: true },
  { key: "dcmap", type: "string", def: "RdBu", url: true },
  { key: "scale", type: "string", def: "p99", url: true },
  { key: "zoom", type: "number", def: 1, url: true },
  // aggregate view: null = every layer / head, [] = none ticked
  { key: "op", type: "string", def: "mean", url: true },
  { key: "layers", type: "set", def: null, url: true },
  { key: "heads", type: "set", def: null, url: true },
  // lines view: null = the chosen head alone; a list = those heads of the layer at once, each in its colour
  { key: "lheads", type: "set", def: null, url: true },
  // encoder-decoder views: one head ("head"), the layer's mean ("layer") or the mean of all ("all")
  { key: "xavg", type: "string", def: "head", url: true },
  // fill-mask panel (an encoder's): candidates shown per [MASK]
  { key: "fillk", type: "int", def: 5, url: true },
  // difference view
  { key: "diff", type: "string", def: "heads", url: true },
  { key: "layerB", type: "int", def: 0, url: true },
  { key: "headB", type: "int", def: 1, url: true },
  { key: "promptB", type: "string", def: "", url: true },
  // issue 18: the heads ablated ("[group:]layer.head(z|m)", comma-separated: ablation.js), the
  // query row the Head view's explain panel computes (null: closed), and whether the atlas
  // scores the repeated-random probe instead of the text
  { key: "ablate", type: "string", def: "", url: true },
  { key: "explain", type: "int", def: null, url: true },
  { key: "probe", type: "bool", def: false, url: true },
  // the lens view's first column when a long sequence is read a window at a time (null: the last window)
  { key: "lensat", type: "int", def: null, url: true },
  // the model view's order of a long input's heads: "grid" (layer by layer), or an atlas score
  // (first_token, previous_token, induction), highest first, or "role": grouped by the atlas's roles
  { key: "morder", type: "string", def: "grid", url: true },
  // the head view's window on a long input: [row start, row end, column start, column end] (null: the whole map)
  { key: "win", type: "list", def: null, url: true },
  // the Causes view (issue 46): the clean and corrupted prompts ("" = the analysed text / none
  // yet), the answer and foil tokens (their text; "" = the clean prompt's top two predictions),
  // the patching method ("exact" | "attribution") and component ("heads" | "residual" | "layers"),
  // and the head whose detail is open ([layer, head]; null: none), the sender of its paths
  { key: "clean", type: "string", def: "", url: true },
  { key: "corrupted", type: "string", def: "", url: true },
  { key: "answer", type: "string", def: "", url: true },
  { key: "foil", type: "string", def: "", url: true },
  { key: "method", type: "string", def: "exact", url: true },
  { key: "component", type: "string", def: "heads", url: true },
  { key: "sender", type: "list", def: null, url: true },
  // an encoder-decoder's: the target both sources are read with ("" = none: the metric on the first
  // target token); its sender is [layer, head, group index] (0 encoder, 1 decoder, 2 cross)
  { key: "ctarget", type: "string", def: "", url: true },
  // data and activity (never in the URL)
  { key: "meta", type: "object", def: null }, // /model, normalised
  { key: "att", type: "object", def: null }, // AttentionSet of the analysed sequence
  { key: "gen", type: "object", def: null }, // GenerationRecord (generation.js)
  { key: "streaming", type: "bool", def: false }, // a generation is arriving
  { key: "analysing", type: "string", def: "" }, // text being analysed, "" when idle
];

export const URL_KEYS = STATE_KEYS.filter((k) => k.url);

export function defaults() {
  const out = {};
  for (const k of STATE_KEYS) out[k.key] = Array.isArray(k.def) ? k.def.slice() : k.def;
  return out;
}
