"""Prompts shipped with the package."""
