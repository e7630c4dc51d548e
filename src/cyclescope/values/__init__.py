"""Value sampling (see docs/design.md). Kept light: the CLI reads DEFAULT_MODULES without loading
capstone, unicorn or the modules."""

DEFAULT_MODULES = ("operands", "addresses", "context", "results", "edges", "vreplay")
