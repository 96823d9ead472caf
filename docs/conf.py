"""Sphinx settings of tether's docs site: the Markdown pages through MyST, built with the repository root as
the source (`sphinx-build -c docs . OUT`) so that the pages, the README and the benchmark results link to
one another by the same relative paths that work on GitHub. Built in strict mode by tests/test_docs.py
(`-W`): a broken link, a missing page or any other warning fails."""

project = "tether"
extensions = ["myst_parser"]
source_suffix = {".md": "markdown"}
root_doc = "docs/index"
# The site's pages and nothing else of the repository (tests/ and deploy/ hold Markdown too).
include_patterns = ["README.md", "docs/*.md", "benchmarks/README.md", "benchmarks/results/*.md",
                    "benchmarks/results/smollm2-sentiment/samples/*.md"]
exclude_patterns = ["docs/_build"]
myst_heading_anchors = 3  # links to a page's sections (page.md#a-heading) resolve
html_theme = "alabaster"
