"""One thread does every MLX call of the server: it loads the model, then runs the queued
generations, first come first served, and hands their tokens to the event loop. With
`max_batch` > 1 (the default) they run together in the batch engine (batch/engine.py): a
request joins the running ones between steps, its prompt prefilled a chunk per step so the
others keep streaming, up to `max_batch` decoding at once; else (or for a target a batch
cannot run: length-dependent rope, a sharded target) one at a time.

MLX streams belong to the thread that made them (on Metal, an array built on one thread cannot
be evaluated on another), so loading and decoding share this one thread, and what crosses to
the event loop is plain Python: text, token ids, floats.

Admission: up to `max_batch` requests decode (one when requests run one at a time) and up to
`max_queue` more wait (queued, or prefilling and waiting for a row); past that `submit` refuses.
A job counts from `submit` until its last event, so a burst the batch can take is taken, however
fast it arrives.

What the thread holds is published (`WorkerState`: sequences decoding, the batch cache's rows
and slots, the sessions kept), for /metrics and GET /debug/state: after every request one at a
time, and in the batch after every step that changed its sequences or rows, else at most every
PUBLISH_SECONDS.

A job is cancelled (its client went away) by a flag the thread reads after every token (every
batch step) and between prefill chunks, so a cancelled generation stops within one decoding
step or one prefill chunk; a cancelled job still waiting is skipped.

With a sharded target (lockstep.py) the thread is rank 0's and every other rank runs `follow`
on its main thread: each request is shared as it is taken, and each flag read goes through
`agree`, so all ranks stop at the same token.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field

import mlx.core as mx

from ..batch import BatchEngine, Handle, check_batchable
from ..batch.engine import rows_bucket
from ..batch.step import build as build_batch_steps
from ..cli import one_line
from ..device import clear_cache
from ..generation import GenerationResponse
from ..grammar import GrammarError
from ..graphs import ahead
from ..policy.adaptive import FixedPolicy, Policy
from ..step import BUILT_RULES, BUILT_SHAPES
from ..step import build as build_verify_steps
from .lockstep import Lockstep, Mirror, Solo
from .metrics import Metrics
from .records import Delta, Failed, Finished, Generation, Job, TokenLogprob, Usage
from .sessions import Entry, SessionPool

log = logging.getLogger("mlx_speculate.server")
GRAMMAR = "grammar_error"  # the error code of a grammar that could not go on
MIN_QUEUE = 16  # requests that may wait by default, however small the batch
# An idle engine that took a request waits this long at most for the prompts of the same burst
# still being prepared (`arriving`), polling every GATHER_POLL, so that they prefill together.
GATHER_SECONDS = 0.1
GATHER_POLL = 0.005
# Between batch steps that leave the engine's sequences and rows as they were, what the thread
# holds is published at most this often: a lone stream's steps come faster than /metrics reads.
PUBLISH_SECONDS = 0.05


class QueueFull(Exception):
    pass


@dataclass(frozen=True)
class WorkerState:
    """What the generation thread holds, as of its last step (plain Python, read by the event
    loop): sequences decoding (in the batch, or the one served alone), the rows and slots per
    row of the batch's KV cache, the sessions kept (idle and busy) and MLX's active memory."""

    decoding: int = 0
    cache_rows: int = 0
    cache_slots: int = 0
    sessions: int = 0
    busy_sessions: int = 0
    active_memory: int = 0


class NotReady(Exception):
    pass


class Worker:
    """The generation thread and its FIFO queue (bounded by admission, see the module's
    docstring; `max_queue` None: `max_batch`, so that a whole batch's worth may wait, and at
    least `MIN_QUEUE`). `load`
    builds the session pool (the model and its drafters) on the thread itself; until it has,
    `pool` is None. `fatal` says why a sharded server can serve no more (a rank was lost)."""

    def __init__(
        self,
        load: Callable[[], SessionPool],
        metrics: Metrics,
        max_queue: int | None = None,
        lockstep: Lockstep | Solo | None = None,
        max_batch: int = 32,
    ):
        if max_batch < 1:
            raise ValueError(f"a batch holds at least 1 request, got {max_batch}")
        max_queue = max(max_batch, MIN_QUEUE) if max_queue is None else max_queue
        if max_queue < 1:
            raise ValueError(f"the queue must hold at least 1 request, got {max_queue}")
        self.max_batch = max_batch
        self.max_queue = max_queue
        self._load = load
        self._metrics = metrics
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._held = 0  # jobs submitted whose last event is not out yet
        self._decoding_at_most = max_batch  # 1 once loaded, if requests run one at a time
        self._admission = threading.Lock()
        self._arriving = 0  # prompts being prepared for `submit` (`arriving`)
        self.state = WorkerState()
        self._thread = threading.Thread(target=self._run, name="mlx-generation", daemon=True)
        self.pool: SessionPool | None = None
        self.load_error: str | None = None
        self.loaded = threading.Event()  # set when loading ended, well or not
        self.fatal: str | None = None
        self._lockstep = lockstep or Solo()
        self._running: list[Job] = []
        self._published: tuple[float, tuple[int, ...]] = (0.0, ())  # when, and the engine's
        metrics.queue_depth.set_function(lambda: self.waiting)
        metrics.batch_size.set_function(lambda: self.state.decoding)
        metrics.cache_rows.set_function(lambda: self.state.cache_rows)
        metrics.sessions.set_function(lambda: self.state.sessions)

    @property
    def ready(self) -> SessionPool | None:
        """The loaded model's sessions once the server takes requests (loaded, calibrated and
        its first steps built: a request earlier would wait behind that); else None."""
        return self.pool if self.loaded.is_set() else None

    @property
    def waiting(self) -> int:
        """Requests accepted and not decoding yet (queued, or prefilling)."""
        return max(0, self._held - self.state.decoding)

    def start(self) -> None:
        self._thread.start()

    def cancel_all(self) -> None:
        """Cancels the running generation and every waiting one (thread-safe)."""
        with self._queue.mutex:
            waiting = [job for job in self._queue.queue if job is not None]
        for job in [*waiting, *self._running]:
            if job is not None:
                job.cancel()

    def close(self, timeout: float = 10.0) -> None:
        """Cancels every generation and waits for the thread to end."""
        if not self._thread.is_alive():
            return
        self.cancel_all()
        self._queue.put(None)  # after the cancelled jobs, each of which it skips
        self._thread.join(timeout)

    def submit(self, request: Generation) -> Job:
        """Queues a generation; QueueFull when the batch and the queue are full (see the
        module's docstring), NotReady while loading."""
        if self.pool is None or self.fatal is not None:
            raise NotReady(self.fatal or self.load_error or "the model is still loading")
        with self._admission:
            if self._held >= self._decoding_at_most + self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting")
            self._held += 1
        job = Job(request, ended=self._ended)
        self._queue.put_nowait(job)
        return job

    def _ended(self) -> None:
        with self._admission:
            self._held -= 1

    @contextmanager
    def arriving(self) -> Iterator[None]:
        """Marks a request whose prompt is being prepared (templated, tokenized) for `submit`:
        an idle engine that took the first request of a burst waits for the rest (at most
        GATHER_SECONDS), so that their prompts prefill in one forward, not one after another."""
        with self._admission:
            self._arriving += 1
        try:
            yield
        finally:
            with self._admission:
                self._arriving -= 1

    def _publish(self, engine: BatchEngine | None = None, decoding: int = 0) -> None:
        """Publishes what the thread holds now (`WorkerState`)."""
        pool = self.pool
        self.state = WorkerState(
            decoding=decoding if engine is None else engine.size,
            cache_rows=0 if engine is None else engine.cache.rows,
            cache_slots=0 if engine is None else engine.cache.capacity,
            sessions=0 if pool is None else len(pool),
            busy_sessions=0 if pool is None else pool.busy,
            active_memory=mx.get_active_memory(),
        )

    def follow(self) -> None:
        """A follower rank's loop, on its main thread: loads its part of the model, then runs
        rank 0's requests until rank 0 stops. Loading errors and a lost rank 0 propagate.
        Host syncs besides decoding's own: the request's two all-sums (its size varies with the
        request) and a scalar one per token and per prefill chunk, as on rank 0."""
        with self._lockstep.guard():
            self.pool = self._load()
            while (request := self._lockstep.share(None)) is not None:
                self._serve(Mirror(request))

    def _run(self) -> None:
        try:
            with self._lockstep.guard():
                batched = False
                try:
                    self.pool = self._load()
                    batched = self._batched()
                    if isinstance(self._lockstep, Solo):
                        # Before the first request, never inside it: the policies a request
                        # follows one at a time, or alone in the batch engine, and the steps
                        # of greedy and sampled decoding alone at the depths requests reach.
                        self.pool.calibrate()
                        model = self.pool.model
                        name = ("verify", BUILT_RULES, *BUILT_SHAPES)
                        ahead(model, name, lambda: build_verify_steps(model))
                    if batched:  # and the steps of the first requests at once
                        rows = rows_bucket(2, self.max_batch)
                        build = lambda: build_batch_steps(self.pool.model, rows)  # noqa: E731
                        ahead(self.pool.model, ("batch", rows, *BUILT_SHAPES), build)
                except Exception as e:  # a bad model folder must not kill the process silently
                    # One line for the user (the command line prints it); the traceback only
                    # under --log-level debug.
                    log.debug("loading the model failed", exc_info=True)
                    self.load_error = f"loading the model failed: {one_line(e)}"
                finally:
                    self.loaded.set()
                    self._lockstep.idle()
                batched = self.pool is not None and batched
                if not batched:
                    self._decoding_at_most = 1
                self._publish()
                if batched:
                    self._run_batched()
                else:
                    while (job := self._take()) is not None:
                        self._serve(job)
        except ConnectionError as e:  # a rank was lost: no generation can run any more
            self.fatal = one_line(e)
            with self._queue.mutex:
                waiting = [job for job in self._queue.queue if job is not None]
            for job in waiting:
                job.emit(Failed(self.fatal))
        # This thread's compiled graphs hold Python objects; MLX frees them when the thread
        # ends, by then without the interpreter if the process is exiting (an abort): free
        # them now (the maintainers' advice: call it at the end of every thread).
        mx.clear_streams()

    def _take(self) -> Job | None:
        """The next job not cancelled while waiting (None: stop), shared with the other ranks
        (its request then carries the seed they all use)."""
        while (job := self._queue.get()) is not None and job.cancelled:
            job.emit(Finished("cancelled", None))
        request = self._lockstep.share(None if job is None else job.request)
        if job is not None:
            job.request = request
        return job

    def _serve(self, job: Job | Mirror) -> None:
        self._running = [job]
        self._publish(decoding=1)
        try:
            self._generate(job)
        except GrammarError as e:  # the request's grammar, not a bug: no traceback
            log.warning("generation stopped: %s", e)
            job.emit(Failed(f"the output cannot follow the requested format: {e}", 400, GRAMMAR))
        except Exception as e:  # the server outlives any one request
            log.exception("generation failed")
            job.emit(Failed(f"generation failed: {type(e).__name__}: {one_line(e)}"))
            if self._lockstep.lost(e):
                raise
        finally:
            self._running = []
            self._lockstep.idle()
            clear_cache()  # the request's buffers go back, as mlx-lm's server does
            self._publish()

    def _generate(self, job: Job | Mirror) -> None:
        request, pool, metrics = job.request, self.pool, self._metrics
        assert pool is not None
        entry = pool.acquire(request.method, request.tokens)
        policy = self._policy(request)
        eos = set(pool.tokenizer.eos_token_ids)
        last: GenerationResponse | None = None
        first = True
        text, tokens = [], []  # what was sent, and every token but an EOS
        failure: Exception | None = None  # in delivering a token: the stream stops cleanly

        def cancelled() -> bool:
            return self._lockstep.agree(job.cancelled)

        stream = entry.session.stream(
            request.tokens,
            sampling=request.sampling,
            max_tokens=request.max_tokens,
            stop=request.stop,
            policy=policy,
            cancelled=cancelled,
            grammar=request.grammar,
        )
        try:
            with closing(stream):
                for last in stream:
                    try:
                        if first:
                            waited = time.perf_counter() - job.submitted
                            metrics.time_to_first_token.observe(waited)
                            first = False
                        logprob = None
                        if request.top_logprobs is not None and not (
                            last.finish_reason == "stop" and last.token in eos
                        ):
                            logprob = self._logprob(last, request.top_logprobs)
                        job.emit(Delta(last.text, logprob))
                    except Exception as e:  # every rank stops at this token, then it fails
                        failure = e
                        job.cancel()
                    text.append(last.text)
                    if last.token not in eos:
                        tokens.append(last.token)
                    if cancelled():
                        break
        except Exception:
            pool.discard(entry)  # its cache may hold half a step
            raise
        pool.release(entry)
        if failure is not None:  # the cache is whole: every rank keeps its session
            raise failure
        self._finish(job, last, tokens, text)

    def _finish(
        self,
        job: Job | Mirror,
        last: GenerationResponse | None,
        tokens: list[int],
        text: list[str],
    ) -> None:
        """Tells the job how its generation ended (`last`: its last response, if any), given
        every token but an EOS and every text segment sent."""
        pool, request = self.pool, job.request
        if last is None:
            job.emit(Finished("cancelled", None))
            return
        reason = "cancelled" if last.finish_reason is None else last.finish_reason
        usage = Usage(
            prompt_tokens=last.prompt_tokens,
            cached_tokens=last.cached_tokens,
            completion_tokens=last.generation_tokens,
            method=request.method,
            stats=last.stats,
        )
        self._metrics.generation_done(usage)
        stop = None
        eos = pool.tokenizer.eos_token_ids
        if reason == "stop" and last.token not in eos:
            stop = _stop_string(pool.tokenizer.decode(tokens), len("".join(text)), request.stop)
        # OpenAI knows no "context": the model's context ending the output is a length limit.
        job.emit(Finished("length" if reason == "context" else reason, usage, stop))

    def _batched(self) -> bool:
        """Whether requests run in the batch engine: asked for, on one machine, and a target
        whose sequences can share a forward (else one at a time, said once in the log)."""
        if self.max_batch == 1 or not isinstance(self._lockstep, Solo):
            return False
        try:
            check_batchable(self.pool.model)
        except ValueError as e:
            log.warning("serving one request at a time: %s", e)
            return False
        return True

    def _run_batched(self) -> None:
        """The batch engine's loop: takes queued jobs while there is room (one more than the
        batch, so that the next prompt prefills while the batch is full), steps the engine and
        hands each job its tokens; waits on the queue only when nothing runs."""
        engine = BatchEngine(self.pool.model, self.max_batch)
        served: dict[int, _Served] = {}
        while self._take_jobs(engine, served):
            engine = self._advance(engine, served)
            # Published once the step's handles are gone: the memory it reports is what the
            # server holds, not a session a handle of the step still named.
            self._publish_step(engine)

    def _publish_step(self, engine: BatchEngine) -> None:
        """Publishes after a batch step when the engine's sequences or rows changed, else
        once PUBLISH_SECONDS have passed since the last time."""
        now, shape = time.monotonic(), (engine.size, engine.load, engine.cache.rows)
        when, last = self._published
        if shape != last or now - when >= PUBLISH_SECONDS:
            self._publish(engine)
            self._published = (now, shape)

    def _take_jobs(self, engine: BatchEngine, served: dict[int, _Served]) -> bool:
        """Admits queued jobs while the engine has room, waiting only when it is idle; False
        at shutdown (every running job cancelled). Its own frame: a job or handle it names
        is not kept alive while the loop waits on the queue. An idle engine that took a job
        takes the rest of its burst too, waiting while their prompts are prepared (`arriving`)."""
        gather = None  # once an idle engine took a job: until when it waits for more
        arrived = False  # prompts were being prepared at the last poll
        while engine.load <= self.max_batch:
            # A prompt's preparation ends just before its job is submitted: one more poll
            # after the last one ended, so that its job is not missed in between.
            before, arrived = arrived, self._arriving > 0
            gathering = gather is not None and (arrived or before) and time.monotonic() < gather
            try:
                if engine.idle:
                    job = self._queue.get()
                    gather = time.monotonic() + GATHER_SECONDS
                elif gathering:
                    job = self._queue.get(timeout=GATHER_POLL)
                elif self._queue.empty():  # a step's poll, most often: nothing came
                    break
                else:
                    job = self._queue.get(False)
            except queue.Empty:
                if gathering:
                    continue
                break
            if job is None:
                for state in served.values():
                    state.job.cancel()
                    self._end(state, engine_failed=None)
                return False
            if job.cancelled:
                job.emit(Finished("cancelled", None))
                continue
            self._admit(engine, job, served)
        return True

    def _advance(self, engine: BatchEngine, served: dict[int, _Served]) -> BatchEngine:
        """One engine step, its tokens handed to their jobs and the jobs that ended ended;
        the engine to go on with (a fresh one after a failed step, whose jobs all failed).
        Its own frame: the last handle (and so its session's cache) is not kept alive while
        the loop waits for the next request."""
        try:
            touched = engine.step()
        except Exception as e:  # the batch's forward, not one request's: all of them fail
            log.exception("a batch step failed")
            for state in served.values():
                self._end(state, engine_failed=e)
            served.clear()
            self._running = []
            engine = BatchEngine(self.pool.model, self.max_batch)
            clear_cache()
            return engine
        if engine.last_rows:
            self._metrics.rows_per_forward.observe(engine.last_rows)
        for handle in touched:
            state = served[id(handle)]
            self._deliver(state)
            if handle.done:
                del served[id(handle)]
                self._running.remove(state.job)
                self._end(state, engine_failed=None)
        if engine.idle:
            clear_cache()  # the requests' buffers go back, as mlx-lm's server does
        return engine

    def _admit(self, engine: BatchEngine, job: Job, served: dict[int, _Served]) -> None:
        """Starts `job` in the engine (a one-line error when its request cannot run)."""
        request, pool = job.request, self.pool
        try:
            entry = pool.acquire(request.method, request.tokens)
        except ValueError as e:
            job.emit(Failed(one_line(e), 400, "invalid_request"))
            return
        policy = self._policy(request)
        handle = Handle(
            entry.session,
            request.tokens,
            request.sampling,
            request.max_tokens,
            tuple(request.stop),
            request.grammar,
            request.num_draft_tokens,
            policy,
            cancelled=lambda: job.cancelled,
            submitted=job.submitted,
        )
        try:
            engine.add(handle)
        except ValueError as e:  # the request's prompt cannot run
            pool.discard(entry)
            job.emit(Failed(one_line(e), 400, "invalid_request"))
            return
        except Exception as e:  # the server outlives any one request
            log.exception("generation failed")
            pool.discard(entry)
            job.emit(Failed(f"generation failed: {type(e).__name__}: {one_line(e)}"))
            return
        served[id(handle)] = _Served(job, entry, handle)
        self._running.append(job)

    def _deliver(self, state: _Served) -> None:
        """Hands the job the responses its generation made since the last step."""
        job, request = state.job, state.job.request
        eos = self.pool.tokenizer.eos_token_ids
        for response in state.handle.take():
            state.last = response
            if state.first:
                self._metrics.time_to_first_token.observe(time.perf_counter() - job.submitted)
                state.first = False
            try:
                logprob = None
                if request.top_logprobs is not None and not (
                    response.finish_reason == "stop" and response.token in eos
                ):
                    logprob = self._logprob(response, request.top_logprobs)
                job.emit(Delta(response.text, logprob))
            except Exception as e:  # the stream stops cleanly at this token
                state.failure = e
                job.cancel()
            state.text.append(response.text)
            if response.token not in eos:
                state.tokens.append(response.token)

    def _end(self, state: _Served, engine_failed: Exception | None) -> None:
        """Tells the job how it ended and gives its session back (dropped if it failed)."""
        job, handle, pool = state.job, state.handle, self.pool
        error = engine_failed or handle.error or state.failure
        if error is None:
            pool.release(state.entry)
            self._finish(job, state.last, state.tokens, state.text)
            return
        if error is state.failure:  # in delivering: the generation stopped whole at a token
            pool.release(state.entry)
        else:
            pool.discard(state.entry)  # its cache may hold half a step
        if isinstance(error, GrammarError):
            log.warning("generation stopped: %s", error)
            message = f"the output cannot follow the requested format: {error}"
            job.emit(Failed(message, 400, GRAMMAR))
        else:
            if error is not state.failure:
                log.error("generation failed: %s", one_line(error))
            job.emit(Failed(f"generation failed: {type(error).__name__}: {one_line(error)}"))

    def _policy(self, request: Generation) -> Policy | None:
        """The draft lengths `request` follows decoding one at a time or alone in the batch:
        a fixed number when it gave one, else its method's policy (built at start-up,
        `calibrate`; None for plain decoding)."""
        if request.num_draft_tokens is not None:
            return FixedPolicy(request.num_draft_tokens)
        return self.pool.policy(request.method)

    def _logprob(self, response: GenerationResponse, top: int) -> TokenLogprob:
        logprobs = response.logprobs  # (V,)
        decode = self.pool.tokenizer.decode
        alternatives: list[tuple[str, float]] = []
        if top > 0:
            ids = mx.argpartition(-logprobs, kth=top - 1)[:top]
            values = logprobs[ids]
            order = mx.argsort(-values)
            alternatives = [
                (decode([i]), v)
                for i, v in zip(ids[order].tolist(), values[order].tolist(), strict=True)
            ]
        return TokenLogprob(decode([response.token]), logprobs[response.token].item(), alternatives)


@dataclass(eq=False)
class _Served:
    """A job in the batch engine: its session, its handle and what it was sent."""

    job: Job
    entry: Entry
    handle: Handle
    last: GenerationResponse | None = None
    first: bool = True
    failure: Exception | None = None  # in delivering a token: the stream stopped there
    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # every token but an EOS


def _stop_string(full: str, sent: int, stops: list[str]) -> str | None:
    """The stop string that cut `full` (every token's text) after `sent` characters: the
    one found first from there (a character of slack for a tokenizer's leading space)."""
    found = [(at, s) for s in stops if (at := full.find(s, max(0, sent - 1))) >= 0]
    return min(found)[1] if found else None
