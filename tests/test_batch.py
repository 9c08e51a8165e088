"""The batch engine: sequences of any lengths in one forward, each with its own drafter, are
lossless per sequence (greedy: the tokens plain greedy decoding gives alone, in every family
and with every method; sampled: the target's exact marginals), join and leave mid-generation,
and keep their sessions' caches; its cache, its planner and `batch_generate`."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_speculate.batch import BatchEngine, Handle, batch_generate, check_batchable
from mlx_speculate.batch.cache import BatchKVCache
from mlx_speculate.batch.engine import batch_stream
from mlx_speculate.batch.prefill import PREFILL_ROWS, PrefillGroup
from mlx_speculate.batch.step import FusedRow
from mlx_speculate.drafters import DFlashSpec, EagleGrowth, EagleSpec, MtpSpec, make_drafter
from mlx_speculate.drafters.draft_model import DraftModelDrafter
from mlx_speculate.drafters.features import FusedSteps
from mlx_speculate.drafters.lookup import LookupDrafter
from mlx_speculate.drafters.medusa import MedusaDrafter
from mlx_speculate.drafters.mtp import MtpDrafter
from mlx_speculate.generation import Session
from mlx_speculate.heads.mtp import MtpHead
from mlx_speculate.loading import load
from mlx_speculate.policy.batch import BatchPlanner, expected_tokens
from mlx_speculate.policy.costs import StepCosts
from mlx_speculate.sampling import SamplingParams

from .families import PROMPT, REPEATING, related_draft
from .gemma4_models import DEEP as GEMMA4_DEEP
from .gemma4_models import related_gemma4, tiny_gemma4
from .helpers import MIN_MARGIN, greedy_reference, random_eagle_head, tiny_model
from .markov import StubTokenizer, assert_follows_marginal
from .test_dflash import dflash_config, random_head
from .test_hybrid import FAMILIES as HYBRIDS
from .test_hybrid import VOCAB as HYBRID_VOCAB
from .test_hybrid import tiny_hybrid
from .test_hybrid_methods import eagle_heads, llama_draft
from .test_medusa import random_heads
from .test_mtp import PROMPT as MTP_PROMPT
from .test_mtp import copying_weights, save_mlx

GREEDY = SamplingParams()
DEEP = {"num_hidden_layers": 3}
# Prompts of different lengths (rows at different offsets), some that repeat themselves
# (prompt lookup proposes there), short ones.
PROMPTS = [PROMPT, REPEATING, PROMPT[:3], REPEATING[4:]]
CANDIDATES = [*PROMPTS, PROMPT[2:], REPEATING[:11], [3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 8, 8]]
# family -> (target, a draft that often agrees with it and often not); seeds whose greedy
# continuations keep a clear top-2 margin (asserted).
FAMILIES = {
    "llama": lambda: (tiny_model("llama", 0, **DEEP), related_draft("llama", 0, 7, **DEEP)),
    "qwen2": lambda: (tiny_model("qwen2", 2, **DEEP), related_draft("qwen2", 2, 7, **DEEP)),
    "qwen3": lambda: (tiny_model("qwen3", 6, **DEEP), related_draft("qwen3", 6, 7, **DEEP)),
    "phi3": lambda: (tiny_model("phi3", 0, **DEEP), related_draft("phi3", 0, 7, **DEEP)),
    "mistral": lambda: (
        tiny_model("mistral", 4, **DEEP),
        related_draft("mistral", 4, 7, **DEEP),
    ),
    "ministral3": lambda: (
        tiny_model("ministral3", 6, **DEEP),
        related_draft("ministral3", 6, 7, **DEEP),
    ),
    "gemma2": lambda: (
        tiny_model("gemma2", 4, **DEEP),
        related_draft("gemma2", 4, 7, **DEEP),
    ),
    "gemma3_text": lambda: (
        tiny_model("gemma3_text", 0, **DEEP),
        related_draft("gemma3_text", 0, 7, **DEEP),
    ),
    "gemma4_text": lambda: (tiny_gemma4(4, **GEMMA4_DEEP), related_gemma4(4, 7, **GEMMA4_DEEP)),
    "gpt_oss": lambda: (tiny_model("gpt_oss", 2, **DEEP), related_draft("gpt_oss", 2, 7, **DEEP)),
    "qwen3_moe": lambda: (
        tiny_model("qwen3_moe", 1, **DEEP),
        related_draft("qwen3_moe", 1, 7, **DEEP),
    ),
}


def drafters(target, draft) -> dict:
    """Every method's drafter factory for `target` (a fresh drafter per sequence)."""
    vocab, hidden = target.args.vocab_size, target.args.hidden_size
    config = {k: v for k, v in vars(target.args).items() if not k.startswith("_")}
    layers = target.args.num_hidden_layers
    eagle1 = random_eagle_head(config, 1, 5, draft_vocab=None, taps=None)
    eagle3 = random_eagle_head(config, 3, 5, draft_vocab=None, taps=(0, layers // 2, layers - 1))
    medusa = random_heads(hidden, vocab, seed=3)
    factories = {
        "none": lambda: None,
        "draft model": lambda: DraftModelDrafter(draft, vocab),
        "lookup chain": lambda: LookupDrafter(max_ngram=3, branches=1),
        "lookup tree": lambda: LookupDrafter(max_ngram=3, branches=3),
        "medusa": lambda: MedusaDrafter(medusa),
        "eagle-1 tree": lambda: make_drafter(
            EagleSpec(heads=eagle1, tree=EagleGrowth(16, 4, 4)), target
        ),
        "eagle-3 chain": lambda: make_drafter(
            EagleSpec(heads=eagle3, tree=EagleGrowth.chain(4)), target
        ),
    }
    if target.args.model_type != "gemma4_text":  # DFlash taps a Llama-shaped stack
        block = random_head(dflash_config(config, ids=(0, layers - 2)), seed=1)
        factories["dflash tree"] = lambda: make_drafter(DFlashSpec(drafter=block, top_k=2), target)
    return factories


def run(target, prompts, make, n, sampling=GREEDY, max_batch=8, fixed=None, engine=None):
    """Each prompt's first `n` tokens from one engine, every sequence with its own drafter."""
    engine = engine or BatchEngine(target, max_batch)
    handles = [
        Handle(Session(target, StubTokenizer(), make()), p, sampling, n, num_draft_tokens=fixed)
        for p in prompts
    ]
    tokens: list[list[int]] = [[] for _ in prompts]
    for i, response in batch_stream(engine, handles):
        tokens[i].append(response.token)
    return tokens, handles


def prefill_members(monkeypatch) -> list[int]:
    """The members of every `PrefillGroup.step` from now on, one count a step."""
    members: list[int] = []
    step = PrefillGroup.step

    def counted(group, *args, **kwargs):
        members.append(len(group.members))
        return step(group, *args, **kwargs)

    monkeypatch.setattr(PrefillGroup, "step", counted)
    return members


def clear(model, prompt: list[int], n: int) -> bool:
    """Whether plain greedy decoding's first `n` tokens after `prompt` each win by a clear
    top-2 margin (where the batch's other kernels cannot flip them)."""
    tokens = greedy_reference(model, prompt, n)
    logits = model(mx.array([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    top2 = mx.sort(logits, axis=-1)[:, -2:]
    return mx.min(top2[:, 1] - top2[:, 0]).item() > MIN_MARGIN


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_method_in_a_batch_equals_greedy_alone(family):
    """Four sequences at different offsets, each drafting with its own drafter of the method:
    every one emits exactly plain greedy decoding's tokens alone, and drafts were verified."""
    target, draft = FAMILIES[family]()
    n = 24
    prompts = [p for p in CANDIDATES if clear(target, p, n)][:4]
    assert len(prompts) >= 3 and len({len(p) for p in prompts}) >= 3
    references = [greedy_reference(target, p, n) for p in prompts]
    for name, make in drafters(target, draft).items():
        tokens, handles = run(target, prompts, make, n, fixed=None if name == "none" else 4)
        assert tokens == references, name
        if name in ("draft model", "medusa", "eagle-1 tree", "eagle-3 chain", "dflash tree"):
            # every sequence drafted: its prompt, prefilled beside longer ones, gave its
            # drafter its own features (a head drafting from a padded row's never drafts)
            assert all(h.last.stats.drafted > 0 for h in handles), name


@pytest.mark.parametrize("method", ["eagle-1 tree", "eagle-3 chain", "dflash tree"])
def test_fused_drafters_draft_inside_the_batch_step(method, monkeypatch):
    """A fused drafter's row drafts its next proposal inside the batch's verify graph, as its
    step alone does: after a sequence's first proposal, its proposals take the draft the
    last step made (no catch-up or growth of their own between steps), and every sequence
    emits plain greedy decoding's tokens."""
    target, draft = FAMILIES["llama"]()
    n = 24
    prompts = [p for p in CANDIDATES if clear(target, p, n)][:4]
    proposals = {"fresh": 0, "fused": 0}
    take_ready = FusedSteps.take_ready

    def counted(steps):
        ready = take_ready(steps)
        proposals["fresh" if ready is None else "fused"] += 1
        return ready

    monkeypatch.setattr(FusedSteps, "take_ready", counted)
    tokens, handles = run(target, prompts, drafters(target, draft)[method], n, fixed=4)
    assert tokens == [greedy_reference(target, p, n) for p in prompts]
    assert all(h.last.stats.drafted > 0 for h in handles)
    # Each sequence's first proposal is fresh; every later one (in the batch, and alone once
    # the others left) takes the draft its last step made.
    assert proposals["fresh"] == len(prompts), proposals
    assert proposals["fused"] >= 3 * len(prompts), proposals


def test_joining_prompts_prefill_together_in_chunks(monkeypatch):
    """Prompts of different lengths, several chunks long, join at once: each prefill forward
    holds several of them (at most PREFILL_ROWS), each one's continuation is plain greedy
    decoding's alone, and a session whose cache holds the start of its prompt runs only the
    rest (EAGLE-1's features of every prompt position reach its drafter as alone)."""
    target = tiny_model("llama", 0, **DEEP)
    n = 8
    lengths = [90, 47, 130, 12, 64, 101, 35, 77, 58, 20]
    candidates = [[1 + (i * 7 + j * j) % 41 for j in range(m)] for i, m in enumerate(lengths)]
    prompts = [p for p in candidates if clear(target, p, n)]
    assert len(prompts) >= 6
    members = prefill_members(monkeypatch)
    config = {k: v for k, v in vars(target.args).items() if not k.startswith("_")}
    head = random_eagle_head(config, 1, 5, draft_vocab=None, taps=None)
    for make in (lambda: None, lambda: make_drafter(EagleSpec(heads=head), target)):
        members.clear()
        sessions = [Session(target, StubTokenizer(), make()) for _ in prompts]
        # The first session has served the start of its prompt: only the rest is run.
        list(sessions[0].stream(prompts[0][:30], sampling=GREEDY, max_tokens=2))
        engine = BatchEngine(target, 4)
        handles = [Handle(s, p, GREEDY, n) for s, p in zip(sessions, prompts, strict=True)]
        tokens = [[] for _ in prompts]
        for i, response in batch_stream(engine, handles):
            tokens[i].append(response.token)
        assert tokens == [greedy_reference(target, p, n) for p in prompts]
        assert handles[0].last.cached_tokens == 30
        assert 1 < max(members) <= PREFILL_ROWS
        assert len(members) < sum(-(-len(p) // 16) for p in prompts) // 2


@pytest.mark.parametrize("model_type", list(HYBRIDS))
def test_hybrids_in_a_batch_equal_greedy_alone(model_type, tmp_path):
    """Hybrid targets decode in the batch, each row with its own recurrent state rolled back
    to its own accepted count: with no draft, a draft model that is often rejected, prompt
    lookup chains and native MTP, every sequence emits plain greedy decoding's tokens alone;
    a session continues its conversation after the batch from the state it handed back; a
    tree draft fails its own request in one line."""
    if model_type == "qwen3_next":
        target = tiny_hybrid(model_type)
    else:  # an MLX folder whose target carries a native MTP head
        target, _ = load(save_mlx(tmp_path / model_type, model_type))
    vocab = target.args.vocab_size
    n = 14
    candidates = [[5, 6, 7, 8, 9] * 3, [3, 1, 4, 1, 5, 9, 2, 6], [8, 2, 8, 2, 8, 2, 8], [11, 12]]
    candidates += [[(7 * i * i + 3) % vocab for i in range(m)] for m in (9, 17, 23)]
    prompts = [p for p in candidates if clear(target, p, n)][:4]
    assert len(prompts) >= 3 and len({len(p) for p in prompts}) >= 3
    references = [greedy_reference(target, p, n) for p in prompts]
    draft = llama_draft()
    methods = {
        "none": lambda: None,
        "draft model": lambda: DraftModelDrafter(draft, HYBRID_VOCAB),
        "lookup chain": lambda: LookupDrafter(max_ngram=3, branches=1),
    }
    head = eagle_heads(target)[1]
    methods["eagle-1 chain"] = lambda: make_drafter(
        EagleSpec(heads=head, tree=EagleGrowth.chain(3)), target
    )
    if model_type != "qwen3_next":
        methods["mtp"] = lambda: make_drafter(MtpSpec(), target)
    for name, make in methods.items():
        tokens, handles = run(target, prompts, make, n, fixed=None if name == "none" else 3)
        assert tokens == references, name
        if name != "none":  # drafts were verified, some rejected (each row rolled back)
            stats = [h.last.stats for h in handles]
            accepted = sum(s.accepted for s in stats)
            assert sum(s.drafted for s in stats) > accepted, name
            assert accepted > 0 or name != "mtp", name  # MTP drafts are partly right
    session = handles[0].session
    turn = prompts[0] + references[0][:6] + [5, 6]
    again = [r.token for r in session.stream(turn, sampling=GREEDY, max_tokens=8)]
    assert again == greedy_reference(target, turn, 8)
    tree = lambda: make_drafter(EagleSpec(heads=head, tree=EagleGrowth(16, 4, 4)), target)  # noqa: E731
    with pytest.raises(ValueError, match="chains only") as refused:
        run(target, prompts[:1], tree, n, fixed=15)
    assert "\n" not in str(refused.value)


def test_hybrid_prompts_prefill_together(monkeypatch):
    """A hybrid's joining prompts prefill in one padded forward (a padded row's padding leaves
    its recurrent state as it was), with the prompt's last token in a forward of its own after
    a checkpoint of the row's state: every sequence emits plain greedy decoding's tokens, and
    its session regenerates from the checkpoint after a long answer moved its state on."""
    target, n = tiny_hybrid("qwen3_5_text"), 12
    vocab = target.args.vocab_size
    candidates = [[5, 6, 7, 8, 9] * 9, [3, 1, 4, 1, 5, 9, 2, 6] * 2, [8, 2, 8, 2, 8, 2, 8], [11]]
    candidates += [[(7 * i * i + 3) % vocab for i in range(m)] for m in (9, 17, 23, 40)]
    prompts = [p for p in candidates if clear(target, p, n)][:4]
    assert len(prompts) >= 3 and len({len(p) for p in prompts}) >= 3
    members = prefill_members(monkeypatch)
    tokens, handles = run(target, prompts, lambda: None, n)
    assert tokens == [greedy_reference(target, p, n) for p in prompts]
    assert max(members) == len(prompts)
    for prompt, handle in zip(prompts, handles, strict=True):
        sequence, last = handle.session.sequence, len(prompt) - 1
        if last > 0:  # the state moved on past its rows; the checkpoint goes back
            assert sequence.cache.restorable(last) == 0
            assert sequence.reusable(prompt) == last
    handles = [Handle(h.session, p, GREEDY, 8) for h, p in zip(handles, prompts, strict=True)]
    again: list[list[int]] = [[] for _ in prompts]
    for i, response in batch_stream(BatchEngine(target, 8), handles):
        again[i].append(response.token)
    assert again == [greedy_reference(target, p, 8) for p in prompts]
    assert [h.last.cached_tokens for h in handles] == [len(p) - 1 for p in prompts]


def test_a_sequence_alone_drafts_by_its_handles_policy():
    """A sequence decoding alone in the engine takes its draft lengths from its handle's policy
    (the method's adaptive one in the server, as one at a time), which sees every step's
    outcome; its tokens are still greedy decoding's."""

    class Recording:
        def __init__(self):
            self.chosen, self.drafted = 0, []

        def choose(self) -> int:
            self.chosen += 1
            return 2

        def observe(self, drafted: int, accepted: int, seconds: float) -> None:
            self.drafted.append(drafted)

    target, n = tiny_model(), 16
    policy = Recording()
    lookup = LookupDrafter(max_ngram=3, branches=1)
    handle = Handle(Session(target, StubTokenizer(), lookup), REPEATING, GREEDY, n, policy=policy)
    tokens = [r.token for _, r in batch_stream(BatchEngine(target, 8), [handle])]
    assert tokens == greedy_reference(target, REPEATING, n)
    assert policy.chosen >= len(policy.drafted) > 0
    assert max(policy.drafted) == 2  # its lengths, not the planner's (up to 8 here)


def test_each_row_reads_the_recurrent_state_at_its_own_slot():
    """A hybrid batch cache's rows read their conv window and delta-rule state at their own
    start slots (ring row start - base, clipped to the ring), however the other rows differ;
    after a forward that kept each row's final state alone, every row reads that state."""
    cache = BatchKVCache.of(tiny_hybrid("qwen3_5_text"), 4)
    layer = cache.linear.index(True)
    s, B, L = cache.shape, 4, 2
    conv = mx.random.normal((B, s.kernel - 1 + L, s.channels), key=mx.random.key(1))
    states = [
        mx.random.normal((B, s.heads, s.key_dim, s.value_dim), key=mx.random.key(2 + i))
        for i in range(L + 1)
    ]
    start = mx.array([10, 20, 30, 40], dtype=mx.int32)
    cache.keep(layer, start, conv, states)  # a verify of L rows from each row's start
    cache.advance(L)
    slots = mx.array([10, 22, 31, 45], dtype=mx.int32)  # ring rows 0, 2, 1 and 5 -> 2
    window, state = cache.recurrent(layer, slots, B, mx.float32)
    for b, row in enumerate([0, 2, 1, 2]):
        assert mx.array_equal(state[b], states[row][b])
        assert mx.array_equal(window[b], conv[b, row : row + s.kernel - 1])
    final = states[-1]
    cache.keep(layer, slots, conv[:, : s.kernel], [final])  # one new row, its final state
    cache.advance(1)
    window, state = cache.recurrent(layer, slots + 1, B, mx.float32)
    assert mx.array_equal(state, final)
    assert mx.array_equal(window, conv[:, 1 : s.kernel])


def test_sampling_in_a_batch_follows_the_target():
    """At temperature 1, with a draft model that is often rejected, the first and second
    tokens of sequences sampled eight at a time follow the target's exact marginals."""
    target = tiny_model("llama", 0, vocab_size=16)
    draft = tiny_model("llama", 3, vocab_size=16)  # unrelated: often rejected
    prompt = [t % 16 for t in PROMPT]
    mx.random.seed(0)
    sampling = SamplingParams(temperature=1.0)
    draws = []
    engine = BatchEngine(target, 8)
    for _ in range(50):
        tokens, _ = run(
            target,
            [prompt] * 8,
            lambda: DraftModelDrafter(draft, 16),
            3,
            sampling,
            fixed=3,
            engine=engine,
        )
        draws += tokens
    assert_follows_marginal(target, prompt, 1.0, 0, [t[0] for t in draws])
    assert_follows_marginal(target, prompt, 1.0, 1, [t[1] for t in draws])
    with pytest.raises(AssertionError):  # the test tells the draft's distribution apart
        assert_follows_marginal(draft, prompt, 1.0, 0, [t[0] for t in draws])


@pytest.mark.parametrize("method", ["lookup tree", "eagle-1 tree"])
def test_sampled_trees_in_a_batch_follow_the_target(method):
    """At temperature 1, sequences sampled eight at a time with draft trees (prompt lookup's
    deterministic branches, an EAGLE-1 head's sampled ones: tree rejection sampling per row)
    draw their first two tokens from the target's exact marginals."""
    target = tiny_model("llama", 0, vocab_size=16)
    prompt = [t % 16 for t in REPEATING]  # n-grams recur with several continuations
    config = {k: v for k, v in vars(target.args).items() if not k.startswith("_")}
    head = random_eagle_head(config, 1, 5, draft_vocab=None, taps=None)
    make = {
        "lookup tree": lambda: LookupDrafter(max_ngram=2, branches=3),
        "eagle-1 tree": lambda: make_drafter(
            EagleSpec(heads=head, tree=EagleGrowth(8, 2, 3)), target
        ),
    }[method]
    mx.random.seed(1)
    sampling = SamplingParams(temperature=1.0)
    engine = BatchEngine(target, 8)
    draws, drafted = [], 0
    for _ in range(50):
        tokens, handles = run(target, [prompt] * 8, make, 3, sampling, fixed=4, engine=engine)
        draws += tokens
        drafted += sum(h.last.stats.drafted for h in handles)
    assert drafted > 200  # drafts were verified at most steps
    assert_follows_marginal(target, prompt, 1.0, 0, [t[0] for t in draws])
    assert_follows_marginal(target, prompt, 1.0, 1, [t[1] for t in draws])


def test_fused_sampled_mtp_drafts_in_a_batch_follow_the_target(tmp_path, monkeypatch):
    """At temperature 0.5, sequences sampled eight at a time on a hybrid target with a noisy
    MTP head (chains of one draft, often wrong) draw their third token from the target's exact
    marginal: where the first step rejected its draft, that token is the second step's draft,
    which the first step's batch graph drew (fused), or its resample."""
    target, _ = load(save_mlx(tmp_path / "qwen3_5_text", "qwen3_5_text"))
    weights = copying_weights(target.args)
    noise = mx.random.normal(weights["fc.weight"].shape, key=mx.random.key(3))
    weights["fc.weight"] = weights["fc.weight"] + 0.3 * noise
    head = MtpHead(target.args).load_weights(list(weights.items()))
    fused = []
    of = FusedRow.of.__func__
    monkeypatch.setattr(FusedRow, "of", classmethod(lambda *a: fused.append(1) or of(*a)))
    mx.random.seed(1)
    sampling = SamplingParams(temperature=0.5)
    engine = BatchEngine(target, 8)
    thirds = []
    for _ in range(50):
        make = lambda: MtpDrafter(head, target)  # noqa: E731
        tokens, _ = run(target, [MTP_PROMPT] * 8, make, 5, sampling, fixed=1, engine=engine)
        thirds += [t[2] for t in tokens]
    assert len(fused) > 200  # most steps' drafts were drawn in the batch's graph
    assert_follows_marginal(target, MTP_PROMPT, 0.5, 2, thirds)


def test_sequences_join_and_leave_mid_generation():
    """Two rows for six sequences of different lengths: each joins when another leaves, while
    the other row is mid-generation; every one equals greedy alone, and a sequence cancelled
    mid-way ends alone, the rest unaffected."""
    target, draft = FAMILIES["llama"]()
    lengths = [5, 30, 12, 3, 25, 9]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(lengths))]
    engine = BatchEngine(target, 2)
    handles = [
        Handle(Session(target, StubTokenizer(), DraftModelDrafter(draft, 97)), p, GREEDY, n)
        for p, n in zip(prompts, lengths, strict=True)
    ]
    seen = {}
    handles[4].cancelled = lambda: len(seen.get(4, [])) >= 10
    for h in handles:
        engine.add(h)
    sizes = []
    while not engine.idle:
        index = {id(h): i for i, h in enumerate(handles)}
        for h in engine.step():
            seen.setdefault(index[id(h)], []).extend(r.token for r in h.take())
        sizes.append(engine.size)
    assert max(sizes) == 2
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        if i == 4:
            assert handles[4].cancelled_out and 10 <= len(seen[4]) < n
            assert seen[4] == greedy_reference(target, prompt, len(seen[4]))
        else:
            assert seen[i] == greedy_reference(target, prompt, n), i
    # Each session's cache holds its whole context, as after a generation alone: a next turn
    # reuses it.
    sequence = handles[1].session.sequence
    assert sequence.cache.offset == len(sequence.context) - 1
    assert sequence.reusable(sequence.context + [5]) == len(sequence.context) - 1


def test_a_joining_sequence_gets_its_first_token_before_the_batch_decodes():
    """The round that prefills a joining prompt returns its first token at once, without the
    running sequences' step; a running stream waits for at most one such round in a row."""
    target, draft = FAMILIES["llama"]()
    engine = BatchEngine(target, 4)

    def handle(prompt):
        session = Session(target, StubTokenizer(), DraftModelDrafter(draft, 97))
        return Handle(session, prompt, GREEDY, 40)

    def got(touched):
        return {PROMPTS.index(h.prompt): len(h.take()) for h in touched}

    running = handle(PROMPTS[0])
    engine.add(running)
    assert got(engine.step()) == {0: 1}  # the first token, from the prompt's forward
    assert got(engine.step())[0] >= 1  # a decoding step
    joining = [handle(PROMPTS[1]), handle(PROMPTS[2])]
    for h in joining:
        engine.add(h)
    # The joiners' first tokens, and the step the lone stream queued before they came (read
    # first, none queued after it: it joins the batch); no batch decoding.
    touched = got(engine.step())
    assert touched.keys() == {0, 1, 2} and touched[1] == touched[2] == 1, touched
    engine.add(late := handle(PROMPTS[3]))
    # Another joiner's first token, and this time the batch decodes in the same round (the
    # joiner with it: its first token and a step's).
    touched = got(engine.step())
    assert touched[3] >= 2 and all(touched[i] >= 1 for i in (0, 1, 2)), touched
    assert engine.size == 4 and not late.done


@pytest.mark.parametrize("method", ["draft model", "eagle-1 tree", "eagle-3 chain"])
def test_a_lone_sequence_decodes_outside_the_batch_and_back(method):
    """A sequence that no other runs or waits beside decodes alone on its own cache, each step
    queued before the last is read (`Decoder.resume`, as `--max-batch 1` decodes it); a joiner
    brings its keys into the batch's cache, and once the others left it decodes alone again;
    its tokens are plain greedy decoding's throughout, with a pipelined drafter and with fused
    ones (their draft made in the last step alone goes on in the batch's, and back). A
    seeded sequence stays in the batch."""
    target, draft = FAMILIES["llama"]()
    n, short = 40, 6
    prompts = [p for p in CANDIDATES if clear(target, p, n)][:2]
    engine = BatchEngine(target, 4)
    tokens: dict[int, list[int]] = {}
    make = drafters(target, draft)[method]

    def handle(prompt, max_tokens, sampling=GREEDY):
        session = Session(target, StubTokenizer(), make())
        return Handle(session, prompt, sampling, max_tokens, num_draft_tokens=4)

    def step():
        for h in engine.step():
            tokens.setdefault(id(h), []).extend(r.token for r in h.take())

    lone = handle(prompts[0], n)
    engine.add(lone)
    for _ in range(3):
        step()
    sequence = lone.session.sequence
    assert engine.size == 1 and engine.cache.offsets == [0]  # its keys are its own
    assert sequence.cache.offset > len(prompts[0])
    engine.add(joiner := handle(prompts[1], short))
    step()  # the joiner's first token; the lone one's keys go into the batch's cache
    assert engine.size == 2 and min(engine.cache.offsets) > 0
    while not joiner.done:
        step()
    step()
    assert not lone.done and engine.size == 1 and engine.cache.offsets == [0]
    while not lone.done:
        step()
    assert tokens[id(lone)] == greedy_reference(target, prompts[0], n)
    assert tokens[id(joiner)] == greedy_reference(target, prompts[1], short)
    assert lone.last.stats.drafted > 0 and joiner.last.stats.drafted > 0
    seeded = handle(prompts[0], n, SamplingParams(temperature=1.0, seed=3))
    engine.add(seeded)
    step()
    step()
    assert engine.size == 1 and engine.cache.offsets[0] > len(prompts[0])


def test_a_seeded_sequence_samples_the_same_beside_any_others():
    target, draft = FAMILIES["llama"]()
    seeded = SamplingParams(temperature=1.0, seed=11)

    def alone_and_with(others: int) -> list[int]:
        engine = BatchEngine(target, 8)
        handles = [Handle(Session(target, StubTokenizer()), PROMPT, seeded, 12)]
        handles += [
            Handle(Session(target, StubTokenizer()), p, SamplingParams(temperature=1.0), 12)
            for p in PROMPTS[:others]
        ]
        tokens: list[int] = []
        for i, response in batch_stream(engine, handles):
            if i == 0:
                tokens.append(response.token)
        return tokens

    assert alone_and_with(0) == alone_and_with(3) == alone_and_with(1)


def test_batch_generate(tmp_path):
    target, draft = FAMILIES["llama"]()
    result = batch_generate(target, StubTokenizer(), PROMPTS, max_tokens=10, prompt_lookup=True)
    assert result.tokens == [greedy_reference(target, p, 10) for p in PROMPTS]
    assert result.finish_reasons == ["length"] * 4 and len(result.stats) == 4
    assert result.texts[0] == "".join(f"{t} " for t in result.tokens[0])
    with pytest.raises(TypeError, match="prompt_lokup"):
        batch_generate(target, StubTokenizer(), PROMPTS, prompt_lokup=True)
    with pytest.raises(ValueError, match="give sampling or temperature"):
        batch_generate(target, StubTokenizer(), PROMPTS, sampling=GREEDY, temperature=1.0)


def test_targets_a_batch_cannot_run_are_refused_in_one_line():
    check_batchable(tiny_hybrid("qwen3_5_text"))  # hybrids are batched
    dynamic = tiny_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match="longest position.*--max-batch 1") as error:
        check_batchable(dynamic)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="at least 1"):
        BatchEngine(tiny_model("llama"), 0)


def test_cache_rows_move_in_and_out():
    """A row takes a one-sequence cache's slots and gives them back; moving and resizing keep
    the rows' slots."""
    model = tiny_model("llama")
    single = model.make_cache()
    model(mx.array([PROMPT]), single)
    batch = BatchKVCache(model.kv_shapes(), mx.float32, 2)
    batch.insert(1, single, len(PROMPT))
    assert batch.offsets == [0, len(PROMPT)]
    batch.move(1, 0)
    batch.resize(4)
    batch.resize(1)
    out = model.make_cache()
    batch.extract(0, out, len(PROMPT))
    assert out.offset == len(PROMPT)
    for mine, theirs in zip(out.keys, single.keys, strict=True):
        assert mx.array_equal(mine[..., : len(PROMPT), :], theirs[..., : len(PROMPT), :])


def test_the_planner_spends_rows_where_they_pay():
    """Flat step costs (a memory-bound step): long drafts for well-accepted sequences; costs
    that grow with every row (compute-bound): none; a fixed draft length is honoured."""
    flat, steep = BatchPlanner(), BatchPlanner()
    for n in range(1, 10):
        flat.observe(8, n, 1.0 + 0.01 * n)
        steep.observe(8, n, 1.0 * n)
    caps, rates = [8] * 8, [0.8] * 8
    assert flat.width(8, caps, rates) >= 6
    assert steep.width(8, caps, rates) == 1
    assert steep.width(8, caps, rates, least=4) == 4
    assert BatchPlanner().width(8, [0] * 8, rates) == 1  # nothing to draft with
    assert expected_tokens(0.5, 2) == 1.75


def test_a_step_that_traced_prices_nothing(monkeypatch):
    """The planner learns a step's cost only from steps that traced no graph: a new shape's
    first step pays for compiling it, which would price that width out for good."""
    target = tiny_model("llama", 0)
    engine = BatchEngine(target, 4)
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(engine.planner, "observe", lambda b, n, s: seen.append((b, n)))
    # Two sequences, which join together and end together: every step is a batch's (one
    # alone decodes outside it).
    run(target, [PROMPT, PROMPT], lambda: None, 8, engine=engine)
    assert seen == [(2, 1)] * 6  # 7 decoding steps after the first token; the first traced
    run(target, [PROMPT, PROMPT], lambda: None, 8, engine=engine)
    assert len(seen) == 6 + 7  # the same shapes again: every step priced


def test_the_planner_prices_rows_by_the_calibration_until_it_measures():
    """Before it has measured two row counts, the planner prices a step by the target's
    calibrated verify curve (the single-stream policy's costs): rows nearly free there, long
    drafts at once; rows that cost in proportion, none; once steps are measured, they rule."""
    cheap = StepCosts({1: 1.0, 8: 1.05, 16: 1.1, 64: 1.5, 128: 2.0}, {})
    dear = StepCosts({1: 1.0, 8: 8.0, 16: 16.0, 64: 64.0}, {})
    caps, rates = [8] * 4, [0.8] * 4
    assert BatchPlanner(cheap).width(4, caps, rates) >= 6
    assert BatchPlanner(dear).width(4, caps, rates) == 1
    measured = BatchPlanner(cheap)
    for n in range(1, 10):
        measured.observe(4, n, 1.0 * n)
    assert measured.width(4, caps, rates) == 1
