"""The package layout, which pyproject.toml cannot compute: one import name, `attnlens`.

The repository keeps its folders (app/, model/) and setuptools maps them under the package
without moving them: app/ is installed as attnlens.app and model/ as attnlens.model, with every
subpackage found below them, so nothing is installed under a top-level name as common as `app`
or `model`. Everything else (name, version, dependencies, scripts) is in pyproject.toml.
"""

from setuptools import find_packages, setup

MAPPED = {"app": "attnlens.app", "model": "attnlens.model"}  # folder -> the package it becomes

packages, package_dir = ["attnlens"], {"attnlens": "attnlens"}
for folder, name in MAPPED.items():
    package_dir[name] = folder
    packages += [name + sub.removeprefix(folder) for sub in find_packages(include=[folder, folder + ".*"])]

setup(packages=packages, package_dir=package_dir)
