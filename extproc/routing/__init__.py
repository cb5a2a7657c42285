"""Routing: the OpenAI request parsed once, and the router that turns it into digests, an index lookup
and a scheduling decision."""
