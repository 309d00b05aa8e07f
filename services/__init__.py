"""Server- and client-side roles of SplitMQ: coordinator, aggregator, client, CLI and config."""
