"""The live dashboard: a job's members, versions, accuracy, throughput, queues and workers.

`watch.JobWatcher` follows a job (its events on the fanout, its store and queues) into a
`state.DashboardState`; `page` serves that state as JSON beside one self-contained HTML page
(inline script, hand-drawn SVG charts: no CDN, the page works offline).
"""
