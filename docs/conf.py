"""Sphinx configuration of the dask-ddp documentation site.

Why Sphinx with the pydata theme and MyST (and not MkDocs): it is what the PyData projects a dask-ddp user
already reads use (Dask, pandas, NumPy, xarray; PyTorch is Sphinx too), so the site looks and searches like
theirs; ``autodoc`` with ``napoleon`` reads the package's NumPy-style docstrings as they are; MyST lets the pages
be Markdown like the README they came from; MyST-NB executes the example notebook during the build and renders
it with its real outputs. ``docs/README.md`` says how to build it; ``tests/test_docs.py`` builds it with warnings
as errors.

Before the build, ``_ext/generate.py`` writes ``docs/generated/`` (not in git): the settings reference from
``dask_ddp/ddp.yaml``, the CLI's ``--help`` texts, a copy of ``examples/notebook.ipynb`` and the figures that
live outside ``docs/``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path[:0] = [str(ROOT), str(DOCS / "_ext")]
# the notebook's kernel and the CLI's --help run in other processes: they import this checkout's dask_ddp too
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

import generate  # noqa: E402

import dask_ddp  # noqa: E402

generate.all_pages(ROOT, DOCS / "generated")

project = "dask-ddp"
author = "the dask-ddp developers"
copyright = "the dask-ddp developers"
version = release = dask_ddp.__version__

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "README.md", "generated/*.md", "jupyter_execute", ".jupyter_cache",
                    "**.ipynb_checkpoints"]
root_doc = "index"

# Every reference to a dask_ddp name must resolve (tests/test_docs.py builds with -W): nitpicky, except for the
# names this site cannot document. Other projects' names cannot be looked up (no intersphinx: the build runs
# without the network), and neither can the words of free-form types in docstrings ("int >= 0", "(min, max)").
# References to the internal wings (docstrings point readers at the module that explains a rule) are left as
# text: only the public paths are documented.
nitpicky = True
INTERNAL = (r"dask_ddp\.(client|worker|rank|wire|observe|config"
            r"|data\.(image_folder|folder_index|blob_cache|storage|checkpoint)"
            r"|dashboard\.(plugin|jobs|state|page|prometheus)|cli\.(run|demo|common|script|siblings))(\..*)?")
nitpick_ignore_regex = [(r"py:.*", r"(?!dask_ddp\b).*"), (r"py:.*", INTERNAL)]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "show-inheritance": True}
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_ivar = True  # "Attributes" as fields: properties documented as members are not described twice

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# The example notebook runs during the build, in a real kernel, and is shown with its outputs.
# DASK_DDP_DOCS_EXECUTE=0 skips it (a quick look at the text; the page then shows no outputs).
nb_execution_mode = "force" if os.environ.get("DASK_DDP_DOCS_EXECUTE", "1") != "0" else "off"
nb_execution_timeout = 300
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_merge_streams = True

html_theme = "pydata_sphinx_theme"
html_title = f"dask-ddp {release}"
html_theme_options = {"navigation_with_keys": False, "show_toc_level": 2, "header_links_before_dropdown": 4}
html_static_path: list[str] = []
