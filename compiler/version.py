"""einfold's version (PEP 440), `compiler.__version__`: here, below every module
that keys a cache on it, so that none of them imports the package itself."""

__version__ = "0.2.0.dev0"
