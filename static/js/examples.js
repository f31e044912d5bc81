// A starting text for each kind of model that fits its bundled model's context: what the page puts
// in the box when a model is opened with no text, or when the text in the box is longer than the
// chosen model reads (a text that fits is always kept). Chosen by what the model does (its
// capabilities, family.js): a text to continue, one with a mask to fill, a source to translate.

const EXAMPLES = {
  continue: "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
  "fill-mask": "To be, or not to be, that is the [MASK]:\nWhether 'tis nobler in the mind to suffer",
  "prompt-source": "Wednesday, March 3, 2021",
};

/** The example text for a model description. */
export function exampleFor(meta) {
  const caps = meta?.capabilities ?? new Set();
  if (caps.has("prompt-source")) return EXAMPLES["prompt-source"];
  if (caps.has("fill-mask")) return EXAMPLES["fill-mask"];
  return EXAMPLES.continue;
}
