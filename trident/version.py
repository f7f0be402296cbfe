"""trident's version, written once: `trident.__version__` and preflight's "same installation on
every rank" check read it from here (pyproject.toml states it for packaging)."""

__version__ = "0.1.0"
