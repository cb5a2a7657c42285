"""Admission: who is calling (OIDC claims, API keys), which tenant that is, what it may use (models,
token budgets), and what it used."""
