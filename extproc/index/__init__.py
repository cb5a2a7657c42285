"""The prefix index: which endpoint holds which KV blocks (the interface, the approximate and precise
indexes, the hybrid the gateway runs, and the router's working set)."""
