"""Sphinx configuration of the Tarantella-NT documentation."""

project = "Tarantella-NT"
author = "The Tarantella-NT developers"
copyright = "2026, The Tarantella-NT developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": True}

intersphinx_mapping = {}  # the docs build runs offline (CI has no internet)

html_theme = "furo"
html_title = "Tarantella-NT"
html_static_path = ["_static"]
exclude_patterns = ["_build"]
nitpicky = False
