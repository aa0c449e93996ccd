"""Held-out evaluation during training and in the evaluate command."""
