"""The SLM -> LLM cascade: a virtual model answered by its cheapest step whose answer the logprob gate
trusts (README.md). Sans IO: the spec, the gate statistic, the bodies; the ext_proc shell sends them."""
