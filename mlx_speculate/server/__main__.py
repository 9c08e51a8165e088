"""python -m mlx_speculate.server [--model M] [--draft-model D | --prompt-lookup | --medusa ...]

Listens at once (GET /health answers 503 while the model loads) and prints the URL when the
model is ready. SIGTERM or Ctrl-C stops accepting requests, lets running ones finish for up to
`--shutdown-timeout` seconds, cancels the rest and exits with status 0.

Under `mlx.launch` the target is sharded over the ranks: rank 0 serves HTTP and the others
run its requests in step with it (lockstep.py), binding no port; they stop when rank 0 does.
A lost rank ends the server with a one-line error and status 1.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .. import cli
from ..drafters import cli as drafter_cli
from ..models.base import implementation_line
from ..models.quantized_kv import kv_quantization
from ..parallel import group as distributed
from ..parallel.group import init_group
from ..parallel.sharding import Split
from . import MAX_BODY

if TYPE_CHECKING:
    from .worker import Worker

LOOP_CONTROLS = "jinja2.ext.loopcontrols"  # {% break %}, which transformers' templates may use
PORT = cli.bounded(int, lambda v: 0 <= v <= 65535, "in [0, 65535]")


def api_key(text: str) -> str:
    """An argparse type: a key that is not empty."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty (leave the flag out for no key)")
    return text


def chat_template(path: Path) -> str:
    """The Jinja source in `path`, parsed: a ValueError (or OSError) of one line where it
    cannot be read or is not a template, before the model loads."""
    import jinja2.sandbox

    try:
        source = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[LOOP_CONTROLS])
    try:
        environment.parse(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"{path} is not a Jinja template: line {e.lineno}: {e.message}") from None
    return source


def build_parser() -> argparse.ArgumentParser:
    parser = cli.ArgumentParser(
        prog=cli.prog("mlx_speculate.server"),
        description="OpenAI- and Anthropic-compatible HTTP server with lossless speculative "
        "decoding.",
    )
    parser.add_argument(
        "--model", default=None, help="local folder or hub id (default: the default model)"
    )
    parser.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        metavar="FILE",
        help="a Jinja chat template to use instead of the model's own (one that takes tools)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=PORT, default=8080, help="port (0: any free one)")
    parser.add_argument(
        "--api-key",
        type=api_key,
        default=None,
        help="require `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) on /v1/*; "
        "/health and /metrics stay open, as in vLLM (keep the port private, or put a proxy "
        "in front, to hide them)",
    )
    parser.add_argument(
        "--max-queue",
        type=cli.positive_int,
        default=None,
        metavar="N",
        help="requests waiting at most beyond those decoding, then 429 (default: --max-batch, "
        "at least 16)",
    )
    parser.add_argument(
        "--max-batch",
        type=cli.positive_int,
        default=32,
        help="requests decoding together in one forward per step (1: one at a time, with the "
        "single-stream loop's compiled steps)",
    )
    parser.add_argument(
        "--prompt-cache-size",
        type=cli.positive_int,
        default=4,
        metavar="N",
        help="conversations whose KV cache is kept for the next turn (memory: N contexts)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=cli.positive_int,
        default=MAX_BODY,
        metavar="N",
        help="largest request body taken, in bytes (then 413)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=cli.non_negative_float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C: how long running requests may go on before they are cancelled",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="uvicorn's log level",
    )
    cli.add_cache_arguments(parser)
    distributed.add_arguments(parser)
    drafter_cli.add_arguments(parser)
    return parser


def model_source(model: str | None) -> str:
    """The model to serve: the one named, else the default model (fetched on first use)."""
    if model is not None:
        return model
    from ..default_model import default_model_path

    return str(default_model_path())


def model_id(source: str) -> str:
    """The name clients use in `model`: a hub id as is, a local folder by its name."""
    path = Path(source).expanduser()
    return path.name if path.exists() else source


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.kv_bits is not None and args.max_batch > 1:
        parser.error("--kv-bits needs --max-batch 1: the batch engine keeps a float cache")
    try:  # the [server] extra; without it, say how to get it rather than a traceback
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError as missing:
        sys.exit(
            f"error: the server needs {missing.name}, which is not installed: "
            'pip install -e ".[server]" (or "mlx_speculate[server]")'
        )
    # Imported here, not above: --help needs none of the app, the worker or their imports.
    import jinja2

    from ..chat import apply_chat_template
    from .app import create_app
    from .lockstep import Lockstep
    from .metrics import Metrics
    from .sessions import SessionPool
    from .worker import Worker

    try:
        kv = kv_quantization(args.kv_bits, args.kv_group_size, args.quantized_kv_start)
        spec = drafter_cli.spec_from_args(args)
        template = None if args.chat_template is None else chat_template(args.chat_template)
        source = model_source(args.model)
    except (ValueError, OSError, ImportError) as e:
        return cli.fail(e)

    group = init_group()
    split = None if group is None else Split(group, args.parallel)
    lockstep = None if group is None else Lockstep(group, args.rank_timeout)

    def load() -> SessionPool:
        from ..loading import load as load_model

        model, tokenizer = load_model(source, split=split)
        print(implementation_line(model), flush=True)
        if split is not None and lockstep.leads:
            print(split.describe(model), file=sys.stderr, flush=True)
        if template is not None:
            tokenizer.chat_template = template
            tokenizer.has_chat_template = True
            try:  # a template that parses may still fail on every conversation
                apply_chat_template(tokenizer, [{"role": "user", "content": "Hi"}])
            except (jinja2.TemplateError, ValueError, TypeError) as e:
                raise ValueError(f"the chat template {args.chat_template} fails: {e}") from None
        return SessionPool(
            model, tokenizer, spec, args.prompt_cache_size, group, kv, args.max_kv_size
        )

    metrics = Metrics()
    worker = Worker(load, metrics, args.max_queue, lockstep, args.max_batch)
    if lockstep is not None and not lockstep.leads:
        return _follow(worker)
    app = create_app(
        worker, model_id(source), metrics, api_key=args.api_key, max_body=args.max_body_bytes
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # Generations end themselves at our deadline (see _supervise); uvicorn's, later, only
        # catches a request that hangs past it.
        timeout_graceful_shutdown=args.shutdown_timeout + 5,
    )
    server = uvicorn.Server(config)
    supervisor = threading.Thread(
        target=_supervise, args=(server, worker, source, args.shutdown_timeout), daemon=True
    )
    supervisor.start()
    # uvicorn re-raises the signal that stopped it once it has shut down; exiting then is the
    # clean end, not an error.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    print(f"loading {source} ...", flush=True)
    try:
        server.run()
    except SystemExit as e:
        if e.code:
            raise
    return 1 if worker.load_error or worker.fatal else 0


def _follow(worker: Worker) -> int:
    """A rank other than 0: no HTTP; runs rank 0's requests until rank 0 stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches every rank: rank 0 decides
    try:
        worker.follow()
    except (ValueError, OSError, ImportError) as e:
        cli.fail(e)
        return 1
    return 0


def _supervise(server, worker: Worker, source: str, grace: float) -> None:
    """Prints the URL once the model is loaded and the socket listens (or stops the server on
    a load error, or when a sharded server lost a rank); once shutting down, cancels the
    generations still running after `grace` seconds, so that their streams end with an error
    event rather than a cut connection."""
    worker.loaded.wait()
    if worker.load_error:
        print(f"error: {worker.load_error}", file=sys.stderr, flush=True)
        server.should_exit = True
        return
    while not server.started and not server.should_exit:
        time.sleep(0.05)
    if server.started:
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        print(f"serving {source} at http://{host}:{port}/v1", flush=True)
    while not server.should_exit:
        if worker.fatal is not None:
            print(f"error: {worker.fatal}", file=sys.stderr, flush=True)
            server.should_exit = True
            return
        time.sleep(0.05)
    time.sleep(grace)
    worker.cancel_all()


def _exit_cleanly(signum, frame) -> None:
    raise SystemExit(0)


if __name__ == "__main__":
    sys.exit(main())
