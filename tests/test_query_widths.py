"""Prefill and mixed batches on backends whose graphs replay one recorded shape (torchair's GE graphs, CUDA graphs).

The rehearsal backend (``torchair-rehearsal``) keeps torchair's shape policy (one graph per bucket, full-width
tables) and holds every graph key to the shapes of its first call, as a GE graph or a CUDA graph capture would; it
runs the graph definitions eagerly (the compiled kernels are tested on the backends themselves: ``npu`` / ``cuda``
tests). What it checks is ours: which key each call replays, that a query padded with inert tokens to a graph's width
drafts what the unpadded reference drafts and writes the same cache, that warm-up made every key a run reaches, and
that wider chunks run eagerly.
"""
import pytest
import torch

from ascend_spec.config import SpeculativeConfig
from ascend_spec.graph.backends.rehearsal import RehearsalBackend
from ascend_spec.graph.buckets import BatchArg, BucketedGraph
from ascend_spec.graph.weights import load_model
from ascend_spec.proposer import MtpProposer
from ascend_spec.torchair_proposer import MtpTorchairProposer

from .conftest import matrix, prefill_inputs


def test_query_pads_to_the_next_width_one_key_each():
    backend = RehearsalBackend("raise")
    calls = []
    graph = BucketedGraph(backend, lambda x, n: calls.append((x.clone(), n.clone())) or (x.sum(1), n), "toy",
                          [2, 4], [BatchArg("x", -1, query=True), BatchArg("n", 0)], query_widths=[3, 8, 32])
    assert sorted(graph.graphs) == [(s, q) for s in (2, 4) for q in (3, 8, 32)]
    assert [graph.query_for(q) for q in (1, 3, 4, 8, 9, 32, 33)] == [3, 3, 8, 8, 32, 32, None]
    assert graph.tokens_for(3, 5) == 4 * 8 and graph.tokens_for(3, 40) == 3 * 40 and graph.tokens_for(5, 3) == 15
    (total, n) = graph([torch.arange(15.0).view(3, 5), torch.tensor([5, 4, 3])])
    assert backend.replays == {"toy_bs4_q8": 1}
    x, _ = calls[-1]
    assert x.shape == (4, 8) and torch.equal(x[:3, 5:], torch.full((3, 3), -1.0)) and torch.equal(x[3], -torch.ones(8))
    assert total.tolist() == [10 - 3, 35 - 3, 60 - 3] and n.tolist() == [5, 4, 3]  # pads summed: -1 each
    graph([torch.ones(2, 33), torch.ones(2)])  # wider than every graph: eager, no key
    assert backend.replays == {"toy_bs4_q8": 1} and calls[-1][0].shape == (2, 33)
    with pytest.raises(ValueError, match="query_widths"):
        BucketedGraph(backend, lambda x: (x,), "toy", [2], [BatchArg("x", 0, query=True)])


@pytest.mark.slow
@pytest.mark.parametrize("k", [matrix(1), 2])
def test_prefill_chunks_replay_padded_graphs_and_draft_as_the_reference(trained_dir, k):
    """Ragged prompt chunks of every width up to the widest: each replays the (bucket, width) graph warm-up made,
    drafts equal the unpadded eager reference's, logits and cache writes equal up to rounding; wider chunks run eagerly."""
    model = load_model(trained_dir)
    spec = SpeculativeConfig(num_speculative_tokens=k)
    eager_cache, graph_cache = torch.zeros(40, 16, 576), torch.zeros(40, 16, 576)
    eager = MtpProposer(model, spec, 128, eager_cache)
    backend = RehearsalBackend("raise")
    padded = MtpTorchairProposer(model, spec, 128, graph_cache, backend=backend, batch_sizes=[2, 4],
                                 prefill_widths=[8, 32])
    padded.warmup(progress=False)
    warmed = set(backend.recorded)
    assert warmed == {f"draft_bs{s}_q{q}" for s in (2, 4) for q in (1 + k, 8, 32)}
    cases = [([7, 13, 2], 13, "draft_bs4_q32"), ([1], 1, f"draft_bs2_q{1 + k}"), ([5, 8], 8, "draft_bs2_q8"),
             ([1 + k, 1], 1 + k, f"draft_bs2_q{1 + k}"), ([30, 9, 4, 32], 32, "draft_bs4_q32"),
             ([40, 9], 40, None)]
    for lengths, width, key in cases:
        inputs = prefill_inputs(model, lengths, width, seed=width)
        eager_cache.zero_()
        graph_cache.zero_()
        before = dict(backend.replays)
        ids, logits = eager.propose(inputs, return_logits=True)
        got_ids, got_logits = padded.propose(inputs, return_logits=True)
        assert torch.equal(got_ids, ids), (lengths, got_ids, ids)
        assert (got_logits - logits).abs().max() < 1e-3, lengths
        assert (graph_cache - eager_cache).abs().max() < 1e-4, lengths  # other GEMM shapes: rounding only
        replayed = {t for t, n in backend.replays.items() if n != before.get(t, 0)}
        assert replayed == ({key} if key else set()), (lengths, replayed)
        assert padded.graph_serves(len(lengths), width) == (key is not None)
    assert set(backend.recorded) == warmed  # nothing compiled after warm-up


def test_rehearsal_holds_each_key_to_its_first_shapes():
    """The rehearsal's one promise: a key called at other shapes (a table one column wider, another cache) raises,
    naming the key and both shapes, as a GE graph would compile again; the same shapes replay."""
    from ascend_spec.graph.backends.rehearsal import GraphShapeError

    backend = RehearsalBackend("raise")
    graph = backend.compile(lambda table, cache: (table.sum(),), "draft_bs4_q3")
    graph(torch.zeros(4, 8), (torch.zeros(9, 16, 512), torch.zeros(9, 16, 64)))
    graph(torch.ones(4, 8), (torch.zeros(9, 16, 512), torch.zeros(9, 16, 64)))
    assert backend.replays == {"draft_bs4_q3": 2}
    with pytest.raises(GraphShapeError, match=r"'draft_bs4_q3' was compiled for shapes .*\(4, 8\).*\(4, 9\)"):
        graph(torch.zeros(4, 9), (torch.zeros(9, 16, 512), torch.zeros(9, 16, 64)))
    with pytest.raises(GraphShapeError):
        graph(torch.zeros(4, 8), torch.zeros(9, 16, 576))
