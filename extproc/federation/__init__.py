"""Cross-cluster federation: links, prefix summaries, the forward decision, peer health, trust (README.md)."""
