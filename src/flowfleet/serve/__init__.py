"""Serving a model folder: FleetService (validated requests, one bounded queue) behind a Gradio page and
an HTTP API (flowfleet.serve.app). gradio, fastapi and uvicorn are the `serve` extra."""
