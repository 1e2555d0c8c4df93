"""Blocks on demand with preemption: a KV pool too small for the batch preempts the newest request and
recomputes it later (prompt + generated tokens re-prefilled); greedy output stays that of an ample pool."""
from types import SimpleNamespace

import pytest

from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import load_engine
from ascend_spec.k_policy import KPolicy
from ascend_spec.graph.latent_cache import num_blocks_for
from ascend_spec.kv_cache import BlockAllocator, BlockManager
from ascend_spec.requests import Sequence, StepOutput
from ascend_spec.scheduler import Scheduler
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer

from .conftest import matrix

TEXTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self",
         "for i in range(10):\n", "with open(path) as f:\n", "raise ValueError(", "@property\ndef name(self):\n"]
MAX_MODEL_LEN = 128
SMALL_POOL = num_blocks_for(MAX_MODEL_LEN, 16) + 1  # one full-length sequence: 7 requests need ~3x that
EAGER = GraphModeConfig(enabled=False)


@pytest.fixture(scope="module")
def prompts(trained_dir):
    tok = TextTokenizer(trained_dir)
    return [tok.encode(t) for t in TEXTS], [40 + 6 * i for i in range(len(TEXTS))]


def _run(trained_dir, prompts, k, kv_blocks, logprobs=None):
    spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
    eng = load_engine(trained_dir, EngineConfig(max_model_len=MAX_MODEL_LEN, max_num_seqs=8, speculative=spec,
                                                graph=EAGER, kv_blocks=kv_blocks))
    total = eng.caches.allocator.num_free
    outs, stats, _ = eng.generate(prompts[0], SamplingParams(logprobs=logprobs), prompts[1])
    assert eng.caches.allocator.num_free == total, "KV blocks leaked"
    return outs, stats


# logprobs take the step-by-step path; without them a step is the fused graph over device-side state, whose
# block table must follow the sequences' new blocks
@pytest.mark.slow
@pytest.mark.parametrize("k, logprobs", [pytest.param(0, None, id="0-fused"), matrix(0, 1, id="0-stepwise"),
                                         pytest.param(2, None, id="2-fused"), pytest.param(2, 1, id="2-stepwise")])
def test_small_pool_preempts_and_keeps_greedy_tokens(trained_dir, prompts, k, logprobs):
    reference, ref_stats = _run(trained_dir, prompts, 0, None)
    assert ref_stats.preemptions == 0
    outs, stats = _run(trained_dir, prompts, k, SMALL_POOL, logprobs=logprobs)
    print(f"K={k}: {stats.preemptions} preemptions in {stats.num_steps} steps with {SMALL_POOL} blocks")
    assert stats.preemptions > 0, "the pool was not too small"
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    if logprobs:
        assert all(len(o.logprobs) == len(o.token_ids) for o in outs)  # recompute continues the logprobs list


def test_block_manager_grows_on_demand_all_or_nothing():
    manager = BlockManager(BlockAllocator(6), max_model_len=64, block_size=16)  # 5 usable blocks of 16 tokens
    a, b = [], []
    assert manager.ensure_capacity(a, 17) and len(a) == 2
    assert manager.ensure_capacity(a, 32) and len(a) == 2  # already held
    assert manager.ensure_capacity(a, 1000) and len(a) == 4  # capped at max_model_len
    assert not manager.ensure_capacity(b, 40) and b == []  # needs 3, 1 free: takes nothing
    assert manager.allocator.num_free == 1
    manager.free(a)
    assert a == [] and manager.allocator.num_free == 5
    assert manager.ensure_capacity(b, 40) and len(b) == 3


def test_make_room_reserves_draft_room_for_the_steps_k():
    """A step at K = 0 verifies one token and drafts nothing: it needs no look-ahead; a K = 3 step needs six
    tokens past the last one's position (verify up to start + 3, drafts up to start + 5)."""
    def running() -> Scheduler:
        manager = BlockManager(BlockAllocator(4), max_model_len=64, block_size=16)  # 3 usable blocks
        sched = Scheduler(manager, 64, 4, KPolicy(3, False, (1, 2, 4)), None)
        for i in range(2):  # 16 tokens each: one full block
            seq = Sequence(i, list(range(16)), SamplingParams(), 8)
            assert manager.ensure_capacity(seq.blocks, seq.num_tokens)
            sched.running.append(seq)
        return sched

    plain = running()
    assert plain.make_room(0).preempted == [] and [len(s.blocks) for s in plain.running] == [1, 1]
    drafting = running()
    assert [s.req_id for s in drafting.make_room(3).preempted] == [1]  # 21 tokens each: the newest goes
    assert [s.req_id for s in running().make_room().preempted] == [1]  # the default is K_max's room


@pytest.mark.parametrize("force_k", [0, 3])
def test_schedule_plans_a_prefill_then_a_decode_step_with_room_for_the_policys_k(force_k):
    """A turn is a plan: the requests that can be admitted prefill together; the next turn decodes the running
    batch at the K the K policy gives (its bucket and path with it), with cache room made for that K only; what
    the runner gives back goes in through ``postprocess``."""
    manager = BlockManager(BlockAllocator(4), max_model_len=64, block_size=16)  # 3 usable blocks
    policy = KPolicy(3, True, (1, 2, 4), fused_step=True, force_k=force_k)
    warm = SimpleNamespace(deferred=set())  # every K warm: nothing to compile
    sched = Scheduler(manager, 64, 4, policy, None, warm=warm)
    seqs = [Sequence(i, list(range(10)), SamplingParams(), 8) for i in range(2)]
    sched.add(seqs, [0, 0])
    prefill = sched.schedule(0)  # each takes a block: its prompt and a first step at K_max (16 positions)
    assert prefill.admitted == seqs and prefill.running == [] and sched.running == []
    out = StepOutput([[7], [8]], [0, 0], 0, None, [[1, 2, 3], [4, 5, 6]])
    assert sched.postprocess(prefill, out, None) == 2
    assert sched.running == seqs and [s.output_ids for s in seqs] == [[7], [8]] and seqs[1].draft_ids == [4, 5, 6]
    for step in range(2):
        decode = sched.schedule(step)
        assert (decode.admitted, decode.k, decode.fused) == ([], force_k, True)
        if step == 0:
            assert decode.running == seqs and decode.bucket == 2
            out = StepOutput([[9], [10, 11]], [force_k] * 2, force_k)
            assert sched.postprocess(decode, out, None) == 3
            assert policy.acceptance.offered[0] == (2 if force_k else 0)
    # 12 and 13 tokens: a K = 3 step needs 17 and 18 positions, a second block each, and one is left
    assert [len(s.blocks) for s in seqs] == ([1, 1] if force_k == 0 else [2, 0])
    assert decode.preempted == ([] if force_k == 0 else [seqs[1]])
    assert decode.running == seqs[: 2 - len(decode.preempted)]
    assert decode.bucket == 2  # asked for the batch before room was made


def test_the_running_batch_decodes_between_two_prefills():
    """A prefill turn is followed by a decode turn of the requests running, even where the prefill freed a place
    that a waiting request could take at once (one request ended by its first token): prompts arriving one after
    another never hold the running batch back for more than one turn."""
    manager = BlockManager(BlockAllocator(8), max_model_len=64, block_size=16)
    sched = Scheduler(manager, 64, 2, KPolicy(2, False, (1, 2), fused_step=False), None)
    seqs = [Sequence(i, list(range(10)), SamplingParams(), 1 if i == 0 else 8) for i in range(3)]
    sched.add(seqs, [0, 0, 0])
    prefill = sched.schedule(0)
    assert prefill.admitted == seqs[:2]  # max_num_seqs 2
    sched.postprocess(prefill, StepOutput([[5], [6]], [0, 0], 0, None, [[], []]), None)
    assert seqs[0].finish_reason == "length" and sched.running == [seqs[1]]
    decode = sched.schedule(0)
    assert decode.admitted == [] and decode.running == [seqs[1]] and (decode.k, decode.fused) == (2, False)
    sched.postprocess(decode, StepOutput([[7]], [0], 2), None)
    assert sched.schedule(1).admitted == [seqs[2]]


@pytest.mark.parametrize("k, force_k", [(0, None), (3, 0), (3, None)], ids=["no-spec", "adaptive-at-0", "k3"])
def test_plain_steps_of_a_drafting_engine_need_no_draft_room(trained_dir, k, force_k):
    """Adaptive K at K = 0 keeps the batch plain decoding keeps: two requests ending at 32 tokens fit four blocks
    of 16 without drafts, and a K = 3 step's look-ahead (6 tokens past the last) needs a third block each."""
    tok = TextTokenizer(trained_dir)
    prompts = [tok.encode(t) for t in TEXTS[:2]]
    spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
    graph = GraphModeConfig(enabled=False, backend="eager", graph_batch_sizes=(1, 2))
    # max_model_len 64: the smallest pool the engine takes holds one such sequence, 4 usable blocks
    eng = load_engine(trained_dir, EngineConfig(max_model_len=64, max_num_seqs=2, speculative=spec, graph=graph,
                                                kv_blocks=5, adaptive_k=bool(k)))
    eng.eos_token_id = None
    eng.force_k = force_k
    _, stats, _ = eng.generate(prompts, SamplingParams(), [32 - len(p) for p in prompts])
    assert (stats.preemptions > 0) == (k > 0 and force_k is None), stats.preemptions
