"""The served models: for each name its chat template and tokenizer, rendering and tokenizing exactly as
the engine does."""
