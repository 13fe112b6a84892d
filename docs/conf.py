"""Sphinx configuration (MyST markdown pages + autodoc API)."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

project = "opacus-structured"
author = "opacus-structured developers"
copyright = "2026, opacus-structured developers"
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_enable_extensions = ["dollarmath", "amsmath"]
myst_heading_anchors = 3
autodoc_mock_imports = ["gluonts", "lightning", "pandas", "matplotlib", "PLD_accounting"]
autodoc_default_options = {"members": True, "undoc-members": False}
autodoc_typehints = "none"
suppress_warnings = ["myst.header", "autodoc.import_object"]
html_theme = "alabaster"
nitpicky = False
