"""kvgate: the command line, the local launcher (``kvgate up``) and the Envoy config renderer."""
