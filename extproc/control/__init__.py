"""The gateway's control plane: etcd's fleet, drains and policy, the agents' feeds, engine scrapes, slot
restores, and the cluster wiring that applies them to the router and index."""
