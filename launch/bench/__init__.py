"""The project's own benchmarks, each run as ``python -m launch.bench.<name>``; no user command imports them."""
