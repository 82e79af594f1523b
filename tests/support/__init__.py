"""Helpers shared by test modules (plain functions; fixtures live in conftest.py files)."""
