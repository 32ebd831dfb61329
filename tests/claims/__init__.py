"""What the docs, README and package claim: published numbers, snippets, docstrings,
packaging, first use, the lease scripts."""
