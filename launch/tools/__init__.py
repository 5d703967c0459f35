"""The project's own tools, each run as ``python -m launch.tools.<name>``: fuzzing, the soak program, the demo peers, generated docs."""
