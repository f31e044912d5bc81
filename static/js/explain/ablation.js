// The heads a user ablates, as the store keeps them (one string, the `ablate` URL key) and as
// the analysis routes read them (`ablate: [{layer, head, how, group}]`, /work API contract).
//
// Text form: comma-separated entries `[group:]layer.head(z|m)`, e.g. "2.2z,3.1m" or
// "cross:1.0z" — z = zero the head's output z, m = replace it by its mean over the positions.
// No group: the family's own default (its first generating group); a family with several
// attention groups gets the group written out by the page, so the link says which.

const HOW = { z: "zero", m: "mean" };
const CODE = { zero: "z", mean: "m" };

/** The entries of a text form (malformed ones are dropped): [{layer, head, how, group}]. */
export function parseAblation(text) {
  const out = [];
  for (const raw of String(text ?? "").split(",")) {
    const m = raw.trim().match(/^(?:([a-z][\w-]*):)?(\d+)\.(\d+)([zm])$/i);
    if (!m) continue;
    out.push({ group: m[1] ?? null, layer: +m[2], head: +m[3], how: HOW[m[4].toLowerCase()] });
  }
  return out;
}

/** The text form of a list of entries. */
export function formatAblation(list) {
  return list.map((a) => `${a.group ? a.group + ":" : ""}${a.layer}.${a.head}${CODE[a.how] ?? "z"}`).join(",");
}

const same = (a, b) => a.layer === b.layer && a.head === b.head && (a.group ?? null) === (b.group ?? null);

/**
 * The group an entry without one means: as the family declares it (GET /models
 * `ablation_group`), else the API's rule (its first generating group, else its first group).
 */
export const defaultGroup = (familyInfo) =>
  familyInfo?.ablation_group ?? familyInfo?.generation?.step_groups?.[0] ?? familyInfo?.groups?.[0]?.name ?? null;

/**
 * The text kept in range for a model: entries whose layer, head and group the model has, each
 * head once (the first wins). `groups`: the names of the family's attention groups; with
 * several, an entry without a group gets `fallback` written out (so the link says which).
 */
export function constrainAblation(text, { n_layers: L, n_heads: H }, groups = [], fallback = null) {
  const kept = [];
  for (const a of parseAblation(text)) {
    if (!a.group && groups.length > 1 && fallback) a.group = fallback;
    if (a.layer >= L || a.head >= H) continue;
    if (a.group && !groups.includes(a.group)) continue;
    if (kept.some((b) => same(a, b))) continue;
    kept.push(a);
  }
  return formatAblation(kept);
}

/** Whether head (layer, head) of `group` is in the list. */
export const isAblated = (list, layer, head, group = null) => list.some((a) => same(a, { layer, head, group }));

/** The list with that head added (as `how`) or, when it is there, removed. */
export function toggleAblation(list, layer, head, group = null, how = "zero") {
  if (isAblated(list, layer, head, group)) return list.filter((a) => !same(a, { layer, head, group }));
  return [...list, { layer, head, how, group }];
}

/** The request field: null for none (the routes then run clean). */
export const ablateField = (list) => (list.length ? list.map(({ layer, head, how, group }) => ({ layer, head, how, group: group ?? null })) : null);

/** "L2 H2 zero" (with the group when there is one), for people. */
export const describeHead = (a) => `${a.group ? a.group + " " : ""}L${a.layer} H${a.head}${a.how ? " " + a.how : ""}`;
