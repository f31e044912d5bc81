// What a model's family declares (GET /models `family_info`: model/families/contract.py), read
// into the capabilities the page's views and panels ask for (views/registry.js `needs`). The page
// knows a family only through its declaration, never by its name:
//   "generation"     the family generates (its GenerationSpec)
//   "prompt-source"  its prompt is a source an encoder reads (a translator's), not a prefix
//   "prompt-prefix"  it continues its prompt (a causal language model's: what patching reads)
//   "target"         its analysis has a target axis (the decoder side of an encoder-decoder)
//   "cross"          it has a cross group (queries over another sequence: target over source)
//   "step-cross"     a generated token's attention rows come from a cross group
//   and every task the model answers (GET /models `tasks`: "fill-mask", "classify", ...)

// A server that gives no declaration (an older one): a decoder's
const DECODER = Object.freeze({
  groups: [{ name: "self", queries: "tokens", keys: "tokens", causal: true, cross: false, description: "" }],
  axes: ["tokens"],
  generation: { prompt: "prefix", step_groups: ["self"] },
});

/** The capabilities of a model with this declaration and these tasks. */
export function capabilities(familyInfo, tasks = []) {
  const info = familyInfo ?? DECODER;
  const caps = new Set(tasks);
  const cross = new Set(info.groups.filter((g) => g.cross || g.queries !== g.keys).map((g) => g.name));
  if (info.generation) {
    caps.add("generation");
    if (info.generation.prompt === "source") caps.add("prompt-source");
    if (info.generation.prompt === "prefix") caps.add("prompt-prefix");
    if (info.generation.step_groups.some((g) => cross.has(g))) caps.add("step-cross");
  }
  if ((info.axes ?? []).includes("target")) caps.add("target");
  if (cross.size) caps.add("cross");
  return caps;
}

/** The declaration's primary group (the maps the shared views draw). */
export const primaryGroup = (familyInfo) => (familyInfo ?? DECODER).groups[0];

/** Whether view or panel `v` applies to a model with these capabilities (no `needs`: every model). */
export const fits = (v, caps) => (v.needs ?? []).every((n) => caps.has(n));
