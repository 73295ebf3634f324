"""The serving floor: HTTP APIs over the library (nothing below imports it).

`worker.py` runs generations on one thread (one at a time or as a batch), `cache_pool.py` keeps
recent prompt caches, `service.py` checks a request once for every API and reads a started job's
events, `openai_api.py` / `openai_schema.py` and `anthropic_api.py` / `anthropic_schema.py` are
the two wire formats, `metrics.py` the Prometheus metrics, `limits.py` the guards on uvicorn, and
`app.py` puts them together. The entry point is `tinydraft_mlx.server`.
"""
