"""colibri: run Mixture-of-Experts models far larger than RAM.

The repository's top-level folders import under this one name: colibri.engine,
colibri.storage, colibri.daemon, colibri.ctl (setuptools package-dir).
"""

__version__ = "0.1.0"
