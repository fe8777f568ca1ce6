"""nestling data stage."""
