"""zerodp's version: one source, read by the package metadata (pyproject.toml), re-exported as
`zerodp.__version__`, and imported here by the modules that report it, so that none of them
has to import the package root (which imports them)."""

__version__ = "0.1.0"
