"""The edge client: joins a job, trains its local layers each round, uploads its update.

`services.client.client.Client(settings, backends, client_id=..., partition=...)`, then
`run(stop) -> ClientStats`.
"""
