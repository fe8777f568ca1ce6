"""nestling export stage."""
