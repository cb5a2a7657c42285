"""The index-event feed (DESIGN.md contract 2) on the wire: a source's numbered log (:mod:`runtime.feed.log`,
sans IO) served over gRPC (:mod:`runtime.feed.server`), and a receiver's subscription
(:mod:`runtime.feed.client`)."""
