"""Flow control: hold, order and shed requests before they reach an engine (README.md: the formulas)."""
