"""Scheduling plugins: filters, scorers and a picker, composed by a weighted profile."""
