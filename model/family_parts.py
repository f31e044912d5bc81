"""The families this version builds, by name, and the optional parts each one's module builds.

Plain data, below both sides that read it: config.py refuses a config whose family is not
here or that asks its family for a part it does not build (ModelConfig.parts_used), and each
family's declaration (model/families, Family.builds) takes its list from here. So the config
never imports the families (which import the config): the dependency points one way.

Adding a family: its name and parts here, its module and declaration in model/families.
"""

from __future__ import annotations

# family name -> the optional parts its module builds when a config asks: rotary, sliding_window,
# rmsnorm, grouped_query, parallel_residual, classifier (in the order of FAMILY_CLASSES)
FAMILY_PARTS: dict[str, tuple[str, ...]] = {
    "decoder": ("rotary", "sliding_window", "rmsnorm", "grouped_query", "parallel_residual"),
    "encoder": ("classifier", "grouped_query", "parallel_residual"),
    "encoder-decoder": (),
}
