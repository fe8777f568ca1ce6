"""nestling capture stage."""
