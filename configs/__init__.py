"""Shipped tree templates and example configurations."""
