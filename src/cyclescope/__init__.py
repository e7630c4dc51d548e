"""cyclescope: a continuous, system-wide sampling profiler for Linux."""

__version__ = "0.1.0"
