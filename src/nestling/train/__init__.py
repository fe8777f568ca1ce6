"""nestling train stage."""
