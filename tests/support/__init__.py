"""Helpers more than one test module uses: a test module imports none of another (tests/test_layering.py)."""
