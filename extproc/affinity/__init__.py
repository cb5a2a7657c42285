"""``previous_response_id`` affinity for the Responses API (README.md): a follow-up goes to the endpoint that
produced the response it continues, while that endpoint is routable. Sans IO (:mod:`extproc.affinity.core`,
``now`` passed in); Envoy tells the ext_proc which endpoint produced which response id (its completion
log); :mod:`extproc.affinity.persist` keeps the table in a file across restarts (``state_dir``);
:mod:`extproc.affinity.metrics` exports the counts."""
