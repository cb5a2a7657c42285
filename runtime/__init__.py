"""Runtime: the IO every kvgate daemon shares, and nothing else.

etcd (:mod:`runtime.etcd`: connection, leased keys), the index-event feed's transport
(:mod:`runtime.feed`: the source's log and gRPC server, the receiver's client), TLS material that follows
file rotation (:mod:`runtime.tls`) and the daemons' lifecycle (:mod:`runtime.lifecycle`). It builds on
:mod:`contracts`; the gateway, the agent and kvcached use it and never each other.
"""
