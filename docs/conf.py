"""Sphinx configuration of the Tarantella-NT documentation."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "_ext"))  # tnt_docs: generated reference parts

project = "Tarantella-NT"
author = "The Tarantella-NT developers"
copyright = "2026, The Tarantella-NT developers"

# no sphinx.ext.viewcode: its highlighted copies of the sources doubled the pages (and the
# build's time) for what the repository shows
extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.intersphinx",
    "tnt_docs",
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
smartquotes = False  # keep -- and quotes as typed: option names and commands are copied
