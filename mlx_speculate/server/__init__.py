"""An OpenAI- and Anthropic-compatible HTTP server with speculative decoding:
`python -m mlx_speculate.server`.

schemas.py           OpenAI request bodies (pydantic), the `speculative` extension
app.py               the FastAPI app and OpenAI's routes
gateway.py           what every generation route shares: checks, queueing, cancellation
messages.py          Anthropic's Messages API: routes, messages and their event stream
messages_schemas.py  Anthropic request bodies, as chat-template messages
tools.py             tool calls: the template's format, parsing, the grammar of a call
errors.py            errors in each API's shape, the body size limit
responses.py         OpenAI response bodies and SSE chunks
worker.py            the generation thread: bounded FIFO queue, cancellation
records.py           what the parts pass each other: requests, events, jobs
sessions.py          the prompt-prefix cache: sessions per method over the one model
metrics.py           Prometheus metrics
__main__.py          the command line
"""

# Request bodies larger than this are refused (413) unless --max-body-bytes says otherwise. It
# lives here, not in app.py, so that the command line shows it without importing FastAPI.
MAX_BODY = 8 * 1024 * 1024
