"""python -m launch.bench.peers: our trainer beside SpecForge and speculators (see __main__.py)."""
