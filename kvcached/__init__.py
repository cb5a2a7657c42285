"""kvcached: the node's tiered KV block store (RAM + RocksDB) with QUIC peer fetch and an index feed."""
