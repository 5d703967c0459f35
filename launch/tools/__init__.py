"""The project's own tools: protocol fuzzing, the soak program, the demo peers and the GPU check script."""
