"""Blocks on demand with preemption: a KV pool too small for the batch preempts the newest request and
recomputes it later (prompt + generated tokens re-prefilled); greedy output stays that of an ample pool."""
import pytest

from ascend_spec.config import EngineConfig, SpeculativeConfig, TorchairGraphConfig
from ascend_spec.engine import load_engine
from ascend_spec.graph.latent_cache import num_blocks_for
from ascend_spec.kv_cache import BlockAllocator, BlockManager
from ascend_spec.scheduler import Scheduler, Sequence
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer

TEXTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self",
         "for i in range(10):\n", "with open(path) as f:\n", "raise ValueError(", "@property\ndef name(self):\n"]
MAX_MODEL_LEN = 128
SMALL_POOL = num_blocks_for(MAX_MODEL_LEN, 16) + 1  # one full-length sequence: 7 requests need ~3x that
EAGER = TorchairGraphConfig(enabled=False)


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
@pytest.mark.parametrize("logprobs", [None, 1], ids=["fused", "stepwise"])
@pytest.mark.parametrize("k", [0, 2])
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
        sched = Scheduler(manager, 64, 4, 3, None)
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


@pytest.mark.parametrize("k, force_k", [(0, None), (3, 0), (3, None)], ids=["no-spec", "adaptive-at-0", "k3"])
def test_plain_steps_of_a_drafting_engine_need_no_draft_room(trained_dir, k, force_k):
    """Adaptive K at K = 0 keeps the batch plain decoding keeps: two requests ending at 32 tokens fit four blocks
    of 16 without drafts, and a K = 3 step's look-ahead (6 tokens past the last) needs a third block each."""
    tok = TextTokenizer(trained_dir)
    prompts = [tok.encode(t) for t in TEXTS[:2]]
    spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
    graph = TorchairGraphConfig(enabled=False, backend="eager", graph_batch_sizes=(1, 2))
    # max_model_len 64: the smallest pool the engine takes holds one such sequence, 4 usable blocks
    eng = load_engine(trained_dir, EngineConfig(max_model_len=64, max_num_seqs=2, speculative=spec, graph=graph,
                                                kv_blocks=5, adaptive_k=bool(k)))
    eng.eos_token_id = None
    eng.force_k = force_k
    _, stats, _ = eng.generate(prompts, SamplingParams(), [32 - len(p) for p in prompts])
    assert (stats.preemptions > 0) == (k > 0 and force_k is None), stats.preemptions
