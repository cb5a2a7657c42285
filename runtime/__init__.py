"""Runtime: the IO every kvgate daemon shares, and nothing else.

etcd (:mod:`runtime.etcd`: the connection, leased keys; :mod:`runtime.watch`: the one prefix-watch loop that
keeps any sans-IO core in step with etcd), the index-event feed's transport (:mod:`runtime.feed`: the
source's log and gRPC server, the receiver's client), the client of a node's kvcached
(:mod:`runtime.kvcached`), TLS material that follows file rotation (:mod:`runtime.tls`), state files kept
across restarts (:mod:`runtime.statefile`), the daemons' lifecycle (:mod:`runtime.lifecycle`) and the
one error of a listener that cannot bind (:mod:`runtime.listen`). It builds
on :mod:`contracts` (and :mod:`certs`); the gateway, the agent and kvcached use it and never each other.
"""
