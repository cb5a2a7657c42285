"""The gateway's status: a pure snapshot of fleet, index, policy and queues (``snapshot``), its HTML page
and text tables (``render``), and the read-only HTTP shell on the metrics port (``http``)."""
