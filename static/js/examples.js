// A starting text for each family that fits its bundled model's context: what the page puts in
// the box when a model is opened with no text, or when the text in the box is longer than
// the chosen model reads (a text that fits is always kept).

const EXAMPLES = {
  decoder: "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
  encoder: "To be, or not to be, that is the [MASK]:\nWhether 'tis nobler in the mind to suffer",
  "encoder-decoder": "Wednesday, March 3, 2021",
};

/** The example text for a model description (its family's). */
export function exampleFor(meta) {
  return EXAMPLES[meta?.family] ?? EXAMPLES.decoder;
}
