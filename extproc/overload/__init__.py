"""The ext_proc protects itself: bounded in-flight decisions, event-loop lag (README.md: the formulas)."""
