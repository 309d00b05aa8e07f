"""The checks a consumer applies to a delivery before its work: one concept for the worker, the
aggregator and the coordinator (`chain`), and the checks they share, one small piece each."""
