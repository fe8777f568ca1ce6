"""nestling evaluate stage."""
