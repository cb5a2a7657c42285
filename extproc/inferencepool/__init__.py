"""The fleet from a Kubernetes InferencePool: the pool's ready pods as endpoints, merged with the agents'
registrations (README.md beside this file)."""
