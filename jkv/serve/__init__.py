"""`jkv serve`: the OpenAI-compatible HTTP server (`jkv.serve.server.Server`).

Needs the `serve` extra (fastapi, uvicorn, prometheus-client, opentelemetry-sdk, jinja2):
`pip install "jkv[serve]"`. `import jkv` never imports it.
"""
