"""One process, several models: a graph compiled for one model must not change how the next one compiles.

Dynamo keeps a profile of every function it compiles, process-wide, keyed by the function's file, line, name and
the code it closes over, not by the model: our graph functions of the same tag (``spec_k1_greedy``) share one
across models. With automatic dynamic on, a second model's config values that differ from the first's (its YaRN
factor, its ranks) were made dynamic; a float among them turned into a graph input read with ``.item()`` inside a
nested compile region, and Dynamo's trace failed ("lift_tracked_freevar_to_input should not be called on root
SubgraphTracer"). The suite met it as ``test_dsa_family``'s compiled test failing after other modules had compiled
DSA graphs in its worker; a server that builds engines in turn meets it the same way.
"""
from __future__ import annotations

import dataclasses

import pytest

from ascend_spec.config import EngineConfig, GraphModeConfig, SpeculativeConfig
from ascend_spec.engine import load_engine
from ascend_spec.graph.backends.cache_dir import ENV_CACHE_DIR
from ascend_spec.graph.config import ModelConfig, YarnScaling
from ascend_spec.sampling import SamplingParams
from ascend_spec_tools.tiny_models import write_checkpoint

pytestmark = pytest.mark.slow

#: one decoder layer, MLA, YaRN: the attention's softmax scale compares the YaRN factor inside the layer's region
SMALL = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                    kv_lora_rank=64, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, q_lora_rank=32,
                    max_position_embeddings=256, eos_token_id=0, bos_token_id=0)
PROMPTS = [list(range(1, 20)), list(range(30, 41))]
MAX_TOKENS = [12, 10]


def _config(graph: GraphModeConfig) -> EngineConfig:
    return EngineConfig(max_model_len=64, max_num_seqs=2, speculative=SpeculativeConfig(num_speculative_tokens=1),
                        graph=graph, adaptive_k=False)


def test_a_second_models_graphs_compile_as_the_first_ones_did(tmp_path, monkeypatch):
    """Two models alike but for their YaRN factor (4 and 2), each engine compiled (inductor, graphs saved whole)
    and warmed in turn in this process: the second traces and compiles too, and its graphs give the tokens of its
    eager engine with no recompile after warm-up."""
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path / "graphs"))  # a store of its own: every graph is traced here
    compiled = GraphModeConfig(backend="inductor", graph_batch_sizes=(2,), prefill_query_widths=())
    for factor in (4.0, 2.0):
        cfg = dataclasses.replace(SMALL, rope_scaling=YarnScaling(factor=factor, original_max_position_embeddings=64,
                                                                  mscale=1.0, mscale_all_dim=1.0))
        path = write_checkpoint(tmp_path / f"yarn{factor:g}", cfg)
        engine = load_engine(path, _config(compiled))
        report = engine.warmup(progress=False)
        assert report.graphs_compiled > 0 and not report.cache_hit, report
    got, stats, _ = engine.generate(PROMPTS, SamplingParams(), MAX_TOKENS)
    ref, _, _ = load_engine(path, _config(GraphModeConfig(enabled=False, backend="eager"))).generate(
        PROMPTS, SamplingParams(), MAX_TOKENS)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert (stats.backend, stats.recompiles_after_warmup, stats.graph_failures) == ("inductor", 0, 0)
