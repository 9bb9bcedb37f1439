"""The peerd process: CLI, config, lifecycle, control server, metrics."""

__version__ = "0.1.0"
