"""nestling draft stage."""
