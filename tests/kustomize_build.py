"""`kustomize build`, in Python, for the features deploy/kubernetes uses: there is no kustomize
binary on PyPI, Debian or npm to install in CI. Where one is on the PATH (`kubectl kustomize`),
tests/test_deploy_manifests.py checks this against it.

Kustomize's rules, as far as they go here:
- `resources`: YAML files (every document) and directories (kustomizations, built first);
- `configMapGenerator` with `literals` (KEY=VALUE) and `behavior` create | merge | replace;
- `patches` of the strategic-merge kind, each naming its target by its own apiVersion, kind and
  name (`path` or inline `patch`): maps merge; lists of containers, env, volumes... merge by
  their Kubernetes merge key (the patch's items first, then the original's others); other lists
  are replaced; null deletes a key;
- `images`: newName, newTag, digest for containers whose image has that name;
- at the end of the top-level build, each generated ConfigMap's name gets the hash of its data
  (kustomize's hasher), and every reference to it in a pod template follows.
Anything else in a kustomization raises, rather than being left out of the output quietly.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml

KNOWN_FIELDS = {"apiVersion", "kind", "resources", "configMapGenerator", "patches", "images"}
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
# Kubernetes' patchMergeKey of the lists a pod template holds (by the list's field name)
MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name", "env": "name",
              "volumes": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
              "imagePullSecrets": "name", "hostAliases": "ip"}
# `ports` merges by containerPort in a container, by port in a Service
PORT_KEYS = ("containerPort", "port")


class UnsupportedKustomization(ValueError):
    pass


@dataclass
class Built:
    resources: list[dict] = field(default_factory=list)
    generated: set[int] = field(default_factory=set)  # ids of the generated ConfigMaps (they get a hash)


def load_kustomization(directory: Path) -> dict:
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        if (directory / name).is_file():
            k = yaml.safe_load((directory / name).read_text()) or {}
            unknown = set(k) - KNOWN_FIELDS
            if unknown:
                raise UnsupportedKustomization(f"{directory}: {', '.join(sorted(unknown))} not supported here")
            return k
    raise FileNotFoundError(f"no kustomization in {directory}")


def build(directory: Path | str) -> list[dict]:
    """The resources `kustomize build directory` prints (in their order of appearance)."""
    built = _build(Path(directory))
    add_name_hashes(built)
    return built.resources


def _build(directory: Path) -> Built:
    k = load_kustomization(directory)
    built = Built()
    for entry in k.get("resources", []):
        path = directory / entry
        if path.is_dir():
            inner = _build(path)
            built.generated |= inner.generated
            built.resources += inner.resources
        else:
            built.resources += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in k.get("configMapGenerator", []):
        generate_config_map(built, gen, directory)
    for p in k.get("patches", []):
        apply_patch(built, p, directory)
    for image in k.get("images", []):
        set_image(built, image)
    return built


def generate_config_map(built: Built, gen: dict, directory: Path) -> None:
    unknown = set(gen) - {"name", "behavior", "literals"}
    if unknown:
        raise UnsupportedKustomization(f"{directory}: configMapGenerator {', '.join(sorted(unknown))}")
    data = {}
    for literal in gen.get("literals", []):
        key, sep, value = literal.partition("=")
        if not sep:
            raise ValueError(f"{directory}: literal {literal!r} is not KEY=VALUE")
        data[key] = value
    name, behavior = gen["name"], gen.get("behavior", "create")
    existing = [r for r in built.resources if id(r) in built.generated and r["metadata"]["name"] == name]
    if behavior == "create":
        if existing:
            raise ValueError(f"{directory}: ConfigMap {name} is generated twice (use behavior: merge)")
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}
        built.resources.append(cm)
        built.generated.add(id(cm))
    elif behavior in ("merge", "replace"):
        if not existing:
            raise ValueError(f"{directory}: behavior {behavior} for ConfigMap {name}, which no base generates")
        cm = existing[0]
        cm["data"] = {**cm.get("data", {}), **data} if behavior == "merge" else data
    else:
        raise UnsupportedKustomization(f"{directory}: behavior {behavior!r}")


def apply_patch(built: Built, entry: dict, directory: Path) -> None:
    if set(entry) - {"path", "patch"}:
        raise UnsupportedKustomization(f"{directory}: patches with {sorted(set(entry) - {'path', 'patch'})}")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    patch = yaml.safe_load(text)
    if not isinstance(patch, dict):
        raise UnsupportedKustomization(f"{directory}: only strategic-merge patches (a JSON 6902 list is not)")
    matches = [r for r in built.resources if r["kind"] == patch["kind"] and r["apiVersion"] == patch["apiVersion"]
               and r["metadata"]["name"] == patch["metadata"]["name"]]
    if len(matches) != 1:
        raise ValueError(f"{directory}: the patch for {patch['kind']} {patch['metadata']['name']} matches "
                         f"{len(matches)} resources")
    target = matches[0]
    merged = strategic_merge(target, patch)
    target.clear()
    target.update(merged)


def strategic_merge(original, patch, list_name: str | None = None):
    """Kubernetes' strategic merge patch, without directives ($patch, $retainKeys...)."""
    if isinstance(original, dict) and isinstance(patch, dict):
        directives = [k for k in patch if k.startswith("$")]
        if directives:
            raise UnsupportedKustomization(f"patch directives {directives}")
        out = dict(original)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = strategic_merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(original, list) and isinstance(patch, list):
        key = MERGE_KEYS.get(list_name)
        if list_name == "ports":
            key = next((k for k in PORT_KEYS if all(isinstance(i, dict) and k in i for i in original + patch)), None)
        if key is None:  # an atomic list: the patch's replaces it
            return copy.deepcopy(patch)
        # the patch's items first, in its order (each merged into the original of its key), then
        # the original's other items, in theirs
        by_key = {o.get(key): o for o in original}
        patched = [strategic_merge(by_key[i.get(key)], i) if i.get(key) in by_key else copy.deepcopy(i)
                   for i in patch]
        keys = {i.get(key) for i in patch}
        return patched + [copy.deepcopy(o) for o in original if o.get(key) not in keys]
    return copy.deepcopy(patch)


def pod_spec(resource: dict) -> dict | None:
    if resource["kind"] in POD_TEMPLATE_KINDS:
        return resource["spec"]["template"]["spec"]
    if resource["kind"] == "CronJob":
        return resource["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    if resource["kind"] == "Pod":
        return resource["spec"]
    return None


def containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """(name, tag, digest) of `registry/name:tag@sha256:...` (a registry's :port is not a tag)."""
    rest, _, digest = image.partition("@")
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        return rest[:colon], rest[colon + 1:], digest or None
    return rest, None, digest or None


def set_image(built: Built, entry: dict) -> None:
    for resource in built.resources:
        spec = pod_spec(resource)
        for c in containers(spec) if spec else []:
            name, tag, digest = split_image(c["image"])
            if name != entry["name"]:
                continue
            name = entry.get("newName", name)
            if "digest" in entry:
                c["image"] = f"{name}@{entry['digest']}"
            else:
                tag = entry.get("newTag", tag)
                c["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest and "newTag" not in entry else "")


def go_json(value) -> str:
    """Go's json.Marshal of a map: keys sorted, no spaces, and <, >, & escaped as \\u003c..."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                          ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text


def config_map_hash(cm: dict) -> str:
    """kustomize's name suffix for a ConfigMap: sha256 of {kind, name, data} as Go's JSON, the
    first 10 hex digits with 0 1 3 a e written g h k m t (so the suffix is never all digits).
    The name hashed is empty: kustomize 5 looks it up as one field called "metadata/name",
    which no ConfigMap has, so only the data decides."""
    encoded = go_json({"kind": "ConfigMap", "name": "", "data": cm.get("data") or ""})
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def add_name_hashes(built: Built) -> None:
    renamed = {}
    for resource in built.resources:
        if id(resource) in built.generated:
            old = resource["metadata"]["name"]
            resource["metadata"]["name"] = renamed[old] = f"{old}-{config_map_hash(resource)}"
    for resource in built.resources:
        spec = pod_spec(resource)
        if spec is None:
            continue
        refs = []
        for c in containers(spec):
            refs += [e["configMapRef"] for e in c.get("envFrom", []) if "configMapRef" in e]
            refs += [e["valueFrom"]["configMapKeyRef"] for e in c.get("env", [])
                     if "configMapKeyRef" in e.get("valueFrom", {})]
        for v in spec.get("volumes", []):
            refs += [v["configMap"]] if "configMap" in v else []
            refs += [s["configMap"] for s in v.get("projected", {}).get("sources", []) if "configMap" in s]
        for ref in refs:
            ref["name"] = renamed.get(ref["name"], ref["name"])
