"""Attention backends. `reference` is the readable truth every faster path is checked against."""
