"""The edge client: `services.client.client.Client(...).run(stop) -> ClientStats`."""
