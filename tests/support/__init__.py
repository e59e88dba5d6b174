"""Helpers shared by the test folders (fixtures live in tests/conftest.py)."""
