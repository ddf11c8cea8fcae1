"""Operators' changes and federation links' messages, applied in the event order."""
