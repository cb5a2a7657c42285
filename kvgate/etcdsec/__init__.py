"""etcd security: RBAC for kvgate identities, the bootstrap, the policy audit trail (README.md)."""
