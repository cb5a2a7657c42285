"""The drift alarm: is the router's view of what each engine holds true? (README.md: the formulas.)"""
