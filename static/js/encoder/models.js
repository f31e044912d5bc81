// The model picker: GET /models fills a <select>; the choice lives in the URL (?model=NAME)
// and decides which page the user sees (a decoder's generate + views, or the encoder's).

import { getJSON } from "../api.js";

export async function loadModels() {
  return getJSON("/models"); // {default, models: [{name, family, tasks, labels, ...}]}
}

/** The model named in the URL if it is loaded, else the server's default. */
export function chosenModel(list, wanted = new URLSearchParams(location.search).get("model")) {
  return list.models.find((m) => m.name === wanted) || list.models.find((m) => m.name === list.default);
}

/** Put `name` in the URL (or drop it for the default model) and reload the page for it. */
export function switchTo(name, list) {
  const url = new URL(location.href);
  if (name === list.default) url.searchParams.delete("model");
  else url.searchParams.set("model", name);
  location.assign(url.toString());
}

export function mountPicker(host, list, current) {
  const label = document.createElement("label");
  label.className = "model-picker";
  label.textContent = "Model ";
  const select = document.createElement("select");
  select.id = "model-picker";
  select.setAttribute("aria-label", "Model");
  for (const m of list.models) {
    const opt = document.createElement("option");
    opt.value = m.name;
    opt.textContent = `${m.name} (${m.family}${m.labels ? ": " + m.labels.join("/") : ""})`;
    opt.selected = m.name === current.name;
    select.append(opt);
  }
  select.addEventListener("change", () => switchTo(select.value, list));
  label.append(select);
  const brand = host.querySelector(".brand");
  if (brand) brand.after(label);
  else host.prepend(label);
  return select;
}
