"""ddpkit's version, in the core: a checkpoint records it, and the core imports nothing above itself (the package's
``ddpkit.__version__`` re-exports it)."""

__version__ = "0.1.0"
