"""Glue to third-party frameworks, one module each; each imports its framework."""
