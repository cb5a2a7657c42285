"""Load tooling for kvgate, not the product: the engine simulator (:mod:`load.sim`) and benchmarks."""
