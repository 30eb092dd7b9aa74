"""Sphinx configuration of the curvwatch documentation (`make docs`: `sphinx-build -W --keep-going docs build/docs`).

Nothing is downloaded at build time: the intersphinx inventories of Python, NumPy, PyTorch, Lightning and transformers
are small local files in ``docs/_inv`` (``python docs/_inv/make_inventories.py`` writes them), listing only the names
these pages reference, each pointing at its page on the project's own documentation site.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(ROOT))  # the checkout's curvwatch and benchmarks, not an installed copy
sys.path.insert(0, str(DOCS / "_ext"))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")

import curvwatch  # noqa: E402

project = "curvwatch"
author = "the curvwatch authors"
copyright = "2026, the curvwatch authors"
release = curvwatch.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "myst_parser",
    "sphinx_gallery.gen_gallery",
    "curvwatch_docs",  # docs/_ext: public-name checks, references into private modules, the benchmark tables
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = [
    "_build",
    "_inv",
    "_ext",
    "examples/README.txt",
    "examples/GALLERY_HEADER.rst",
    "sg_execution_times.rst",  # sphinx-gallery's timing page (its table loads scripts from CDNs): not published
    "examples/*.py",
    "auto_examples/*.ipynb",
    "auto_examples/*.py",
    "auto_examples/*.zip",
    "auto_examples/*.json",
    "auto_examples/*.md5",
]
templates_path: list[str] = []

# -- warnings: every one is an error (make docs runs sphinx-build -W --keep-going) -----------------------------------
nitpicky = True

# -- MyST ------------------------------------------------------------------------------------------------------------
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# -- autodoc and napoleon ---------------------------------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_class_signature = "mixed"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False  # subclasses of Lightning classes show their own docs only
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_custom_sections = [("Logged metrics", "notes_style")]

# -- intersphinx: local inventories only ------------------------------------------------------------------------------
intersphinx_mapping = {
    "python": ("https://docs.python.org/3", str(DOCS / "_inv" / "python.inv")),
    "numpy": ("https://numpy.org/doc/stable", str(DOCS / "_inv" / "numpy.inv")),
    "torch": ("https://docs.pytorch.org/docs/stable", str(DOCS / "_inv" / "torch.inv")),
    "lightning": ("https://lightning.ai/docs/pytorch/stable", str(DOCS / "_inv" / "lightning.inv")),
    "transformers": ("https://huggingface.co/docs/transformers/main/en", str(DOCS / "_inv" / "transformers.inv")),
}

# -- sphinx-gallery: the examples run at build time, their figures go on the page --------------------------------------
sphinx_gallery_conf = {
    "examples_dirs": str(DOCS / "examples"),
    "gallery_dirs": str(DOCS / "auto_examples"),
    "filename_pattern": r"/plot_",
    "ignore_pattern": r"__init__\.py",
    "download_all_examples": False,
    "remove_config_comments": True,
    "abort_on_example_error": True,
    "only_warn_on_example_error": False,
    "show_memory": False,
    "min_reported_time": 0,
    "within_subsection_order": "FileNameSortKey",
    "reset_modules": ("matplotlib",),
    "capture_repr": ("_repr_html_", "__repr__"),
    "plot_gallery": "True",
}

# -- HTML -------------------------------------------------------------------------------------------------------------
html_theme = "furo"
html_title = f"curvwatch {release}"
html_static_path: list[str] = []
html_show_sourcelink = False
