"""An OpenAI-compatible HTTP server with speculative decoding: `python -m mlx_speculate.server`.

schemas.py    request bodies (pydantic), the `speculative` extension
app.py        the FastAPI routes
errors.py     OpenAI-shaped errors, the body size limit
responses.py  response bodies and SSE chunks
worker.py     the generation thread: bounded FIFO queue, cancellation
records.py    what the parts pass each other: requests, events, jobs
sessions.py   the prompt-prefix cache: sessions per method over the one model
metrics.py    Prometheus metrics
__main__.py   the command line
"""
