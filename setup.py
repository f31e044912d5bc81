"""The package layout, which pyproject.toml cannot compute: one import name, `attnlens`.

The repository keeps its folders (app/, model/, static/) and setuptools maps them under the
package without moving them: app/ is installed as attnlens.app and model/ as attnlens.model,
with every subpackage found below them, so nothing is installed under a top-level name as
common as `app` or `model`. static/ (the page: HTML, CSS, ES modules) becomes package data at
attnlens/static in a wheel, where the server and the notebook views find it
(attnlens.resources.static_dir). Everything else (name, version, dependencies, scripts) is in
pyproject.toml.
"""

from pathlib import Path

from setuptools import find_packages, setup

MAPPED = {"app": "attnlens.app", "model": "attnlens.model"}  # folder -> the package it becomes
STATIC = ["*.html", "*.svg", "*.css", "*.js"]  # the page's files, as package data

packages, package_dir = ["attnlens"], {"attnlens": "attnlens"}
for folder, name in MAPPED.items():
    package_dir[name] = folder
    packages += [name + sub.removeprefix(folder) for sub in find_packages(include=[folder, folder + ".*"])]

# static/ and each folder below it is a data-only package (attnlens.static, attnlens.static.js,
# attnlens.static.js.views, ...): every folder named, so setuptools takes each one's files
package_data = {}
for folder in [Path("static"), *sorted(p for p in Path("static").rglob("*") if p.is_dir())]:
    name = ".".join(("attnlens", *folder.parts))
    packages.append(name)
    package_dir[name] = folder.as_posix()
    package_data[name] = STATIC

setup(packages=packages, package_dir=package_dir, package_data=package_data)
