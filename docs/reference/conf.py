"""Sphinx configuration of zjax's API reference (built from the docstrings).

  pip install -e ".[docs]"
  python -m sphinx -W -b html docs/reference docs/_build/reference

-W makes every warning an error; a public name (in `zjax.__all__`, `zjax.hlo.__all__`,
`zjax.distributed.__all__`) without a docstring is one (see `_require_docstrings`)."""

import zjax

project = "zjax"
release = version = zjax.__version__
extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
autodoc_default_options = {"members": True, "undoc-members": True, "imported-members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # "Attributes:" as fields (the dataclass fields are listed too)
html_theme = "alabaster"
exclude_patterns = ["_build"]
nitpicky = False


def _require_docstrings(app, what, name, obj, options, lines):
  """A public object documented without a docstring is a warning (an error under -W)."""
  if not any(line.strip() for line in lines) and what in ("function", "class", "module"):
    from sphinx.util import logging

    logging.getLogger(__name__).warning(
      f"{name}: public {what} without a docstring (write one: the reference is built from them)",
      type="zjax",
      subtype="docstring",
    )


def setup(app):
  app.connect("autodoc-process-docstring", _require_docstrings)
