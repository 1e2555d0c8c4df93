"""GLM-5.x and DeepSeek-V3.2 (the DSA family) drafted by ours inside vllm-ascend, on every vendored release, without
an NPU: vllm-ascend's factory (V1) and ``init_speculator`` (V2) build ours for a ``glm_moe_dsa`` / ``deepseek_v32``
draft; ours reads the draft config by its family, builds its MTP layer on vLLM's modules (``vllm_mtp_standin``, the
indexer's ``wq_b`` / ``wk_weights_proj`` / ``k_norm`` included), compiles its draft chain through torchair's shape
policy (one graph per bucket) and drafts on vllm-ascend's SFA cache at block 128, bound as the release binds it
(``tests/data/vllm_ascend/<tag>/vllm_ascend/attention/sfa_v1.py``): the whole tuple on the MLA layer (v0.23.0), or
the latent pair there and the indexer's keys on its own cache layer (from v0.24.0rc1). Over a greedy decode, on both
runners, its drafts and cache writes (so its per-position acceptance) equal our engine's eager proposer's on the
same inputs.
"""
from __future__ import annotations

import ast
import json
import types

import pytest
import torch

from ascend_spec.graph.backends.rehearsal import RehearsalBackend

from . import vllm_ascend_standin as standin
from . import vllm_mtp_standin
from .test_vllm_ascend_route import attn_metadata, release  # noqa: F401 (the fixture)
from .test_vllm_ascend_v2 import init_speculator, their_method, v2_config

pytest.importorskip("vllm")

BLOCK, NUM_BLOCKS, MAX_LEN = 128, 8, 64
#: (preset, K): GLM-5.2's shape (MoE, a shared-top-k target layer, interleaved indexer RoPE) and DeepSeek-V3.2's
#: (dense, the draft steps reusing the first step's top-k)
CASES = [("glm5-shared-topk", 2), ("v32-half-rope", 3)]


def splits_indexer_cache(tag: str) -> bool:
    """Whether ``tag`` binds the indexer's keys on their own layer (``_compose_sfa_kv_cache`` joins them)."""
    tree = ast.parse(standin.excerpt(tag, "vllm_ascend/attention/sfa_v1.py"))
    return any(isinstance(n, ast.FunctionDef) and n.name == "_compose_sfa_kv_cache" for n in ast.walk(tree))


def sfa_kernel_block_sizes(tag: str) -> list[int]:
    tree = ast.parse(standin.excerpt(tag, "vllm_ascend/attention/sfa_v1.py"))
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
              and n.name == "get_supported_kernel_block_sizes")
    return ast.literal_eval(fn.body[-1].value)


def draft_config(path, model_type_check: str) -> types.SimpleNamespace:
    """vLLM's draft model config as the drafter reads it: the checkpoint's HF config (vLLM renames the type to
    ``deepseek_mtp``; ``to_dict`` gives the config class's own)."""
    hf = json.loads((path / "config.json").read_text())
    assert hf["model_type"] == model_type_check
    return types.SimpleNamespace(hf_config=types.SimpleNamespace(to_dict=lambda: dict(hf)))


def v1_config(path, model_type: str, k: int) -> types.SimpleNamespace:
    spec = types.SimpleNamespace(method="mtp", num_speculative_tokens=k, draft_sample_method="greedy",
                                 use_step3p5_mtp=lambda: False, draft_model_config=draft_config(path, model_type))
    return types.SimpleNamespace(additional_config={"ascend_spec": {"enabled": True}}, speculative_config=spec,
                                 use_v2_model_runner=False,
                                 model_config=types.SimpleNamespace(max_model_len=MAX_LEN, dtype=torch.float32,
                                                                    quantization=None),
                                 scheduler_config=types.SimpleNamespace(max_num_seqs=4),
                                 parallel_config=types.SimpleNamespace(data_parallel_size=1, data_parallel_rank=0))


def sfa_cache(tag: str, cfg, layer: str, gen: torch.Generator) -> tuple[dict, tuple[torch.Tensor, ...]]:
    """vllm-ascend's SFA cache of the draft layer as ``tag`` binds it (``static_forward_context``), and the three
    tensors ``(k_nope, k_pe, indexer_k)`` ``[N, 128, 1, width]`` (unwritten slots hold noise)."""
    from ascend_spec.compat.sfa_cache import indexer_cache_layer

    widths = (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.indexer.head_dim)
    nope, rope, keys = (torch.randn(NUM_BLOCKS, BLOCK, 1, w, generator=gen) * 0.1 for w in widths)
    if splits_indexer_cache(tag):
        ctx = {layer: types.SimpleNamespace(kv_cache=(nope, rope)),
               indexer_cache_layer(layer): types.SimpleNamespace(kv_cache=(keys,))}
    else:
        ctx = {layer: types.SimpleNamespace(kv_cache=(nope, rope, keys))}
    return ctx, (nope, rope, keys)


def ours_on_vllm(d, ours, cfg, w8a8: bool = False) -> None:
    """What ``_load_ours`` builds on vLLM's loaded MTP layer: our model on its modules (no copy)."""
    from ascend_spec.compat.host_weights import mtp_model_on_vllm, owned_tensor_bytes

    vllm_mtp = vllm_mtp_standin.deepseek_mtp(ours, npu_ops=False, w8a8=w8a8)
    moe = d._moe_context() if cfg.moe is not None else None
    d._ascend_tp = 1
    d._ascend_model = mtp_model_on_vllm(vllm_mtp, cfg, 1, torch.device("cpu"), moe)
    assert type(d._ascend_model) is type(ours)
    assert owned_tensor_bytes(d._ascend_model, vllm_mtp) == 0  # every weight is vLLM's


class Target:
    """Greedy verification by our DSA model's dense reference forward (the target's final-normed hidden states)."""

    def __init__(self, model) -> None:
        self.model = model

    @torch.no_grad()
    def __call__(self, ids: list[int]) -> tuple[torch.Tensor, list[int]]:
        hidden = self.model.target_dense(torch.tensor([ids]))[0]
        return hidden, self.model.logits(hidden).argmax(-1).tolist()


class Decode:
    """A greedy speculative decode of ``prompts`` as vllm-ascend's V1 runner drives its drafter (padded drafter
    batch: every row verifies the same count of tokens, ``token_indices_to_sample`` at the last accepted one). Each
    :meth:`step` hands the verified batch to a drafter and returns its drafts, checked against ``reference`` (our
    eager proposer) fed the inputs ours was given; ``accepted`` counts the accepted drafts per position."""

    def __init__(self, target: Target, prompts: list[list[int]], k: int, reference) -> None:
        self.target, self.k, self.reference = target, k, reference
        self.rows = len(prompts)
        self.accepted, self.made = [0] * k, 0
        self.committed = [list(p) for p in prompts]
        hid, greedy = zip(*(target(p) for p in prompts))
        self.nxt = [g[-1] for g in greedy]
        self.ids = torch.tensor([t for p in prompts for t in p])
        self.pos = torch.cat([torch.arange(len(p)) for p in prompts])
        self.hidden = torch.cat(hid)
        self.qsl = [0]
        for p in prompts:
            self.qsl.append(self.qsl[-1] + len(p))
        self.tis = [q - 1 for q in self.qsl[1:]]
        self.seq_lens = [len(p) for p in prompts]

    def step(self, d, verify_drafts: bool = True) -> torch.Tensor:
        """``d`` drafts from the verified batch; then the target verifies the next token and (``verify_drafts``)
        the drafts, else the next token alone (a decode node's first step after a remote prefill)."""
        seen = []
        chain = d._ascend
        propose = chain.propose
        chain.propose = lambda inputs, return_logits=False: seen.append(inputs) or propose(inputs, return_logits)
        table = torch.tensor([[3], [5]], dtype=torch.int32)[:self.rows]
        cam = attn_metadata(self.qsl, self.seq_lens, self.k, table)
        widths = torch.tensor([b - a for a, b in zip(self.qsl, self.qsl[1:])])
        cam = type(cam)(**{**cam.__dict__, "slot_mapping": torch.repeat_interleave(table[:, 0].long(), widths)
                           * BLOCK + self.pos})
        try:
            if d.ascend_stats.runner == "v2":  # vllm-ascend's V2 runner: its propose(input_batch, ...) positionally
                qsl = torch.tensor(self.qsl)
                batch = types.SimpleNamespace(
                    num_reqs=self.rows, num_scheduled_tokens=widths.numpy(), query_start_loc=qsl,
                    idx_mapping=torch.arange(self.rows), positions=self.pos, input_ids=self.ids,
                    seq_lens=torch.tensor(self.seq_lens), seq_lens_cpu_upper_bound=torch.tensor(self.seq_lens))
                rejected = qsl[1:] - 1 - torch.tensor(self.tis)
                drafts = d.propose(batch, {}, {d._ascend_layer: cam.slot_mapping}, self.hidden, None,
                                   torch.ones(self.rows, dtype=torch.long), rejected,
                                   torch.tensor(self.nxt).view(-1, 1), torch.zeros(4, dtype=torch.long),
                                   torch.zeros(4), torch.zeros(4), None, False, False, None, False)
            else:
                drafts = d._propose(target_token_ids=self.ids, target_positions=self.pos,
                                    target_hidden_states=self.hidden, next_token_ids=torch.tensor(self.nxt),
                                    token_indices_to_sample=torch.tensor(self.tis), common_attn_metadata=cam,
                                    sampling_metadata=None, target_model_batch_desc=object(), req_scheduled_tokens={},
                                    long_seq_metadata=None, num_prefill_reqs=0, num_decode_reqs=0,
                                    scheduler_output=object(), num_scheduled_tokens=self.qsl[-1],
                                    num_rejected_tokens_gpu=None)
        finally:
            chain.propose = propose
        (inputs,) = seen
        assert torch.equal(drafts, self.reference.propose(inputs)), "ours differs from the eager proposer"
        q = 1 + self.k if verify_drafts else 1
        hid, pos, ids, self.tis, nxt, self.seq_lens = [], [], [], [], [], []
        for r in range(self.rows):
            start = len(self.committed[r])
            verify = [self.nxt[r], *drafts[r].tolist()][:q]
            h, g = self.target(self.committed[r] + verify)
            a = 0
            while a < q - 1 and verify[1 + a] == g[start + a]:
                self.accepted[a] += 1
                a += 1
            self.made += verify_drafts
            hid.append(h[start:start + q])
            pos.append(torch.arange(start, start + q))
            ids.extend(verify)
            self.tis.append(r * q + a)
            nxt.append(g[start + a])
            self.seq_lens.append(start + q)
            self.committed[r] += verify[:1 + a]
        self.hidden, self.pos, self.ids, self.nxt = torch.cat(hid), torch.cat(pos), torch.tensor(ids), nxt
        self.qsl = [r * q for r in range(self.rows + 1)]
        return drafts


def decode_as_eager(d, ours, release: str, layer: str, k: int, seed: int, steps: int = 6) -> None:
    """Bind an SFA cache to ``d`` and decode two prompts greedily for ``steps`` steps: every draft through ours'
    graphs, equal to the eager proposer's on the same inputs (:class:`Decode`), the cache written in place as the
    eager proposer writes its copy, and drafts accepted."""
    from ascend_spec.config import SpeculativeConfig
    from ascend_spec.proposer import MtpProposer

    cfg = ours.cfg
    gen = torch.Generator().manual_seed(seed)
    ctx, bound = sfa_cache(release, cfg, layer, gen)
    d.vllm_config.compilation_config = types.SimpleNamespace(static_forward_context=ctx)
    reference_cache = tuple(t.squeeze(2).clone() for t in bound)
    reference = MtpProposer(ours, SpeculativeConfig(num_speculative_tokens=k), MAX_LEN, reference_cache)
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist() for n in (9, 14)]
    run = Decode(Target(ours), prompts, k, reference)
    for _ in range(steps):
        run.step(d)
    st = d.ascend_stats
    assert st.graph_calls == steps and st.eager_calls == st.fallback_calls == 0, st
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(d._ascend.draft_cache, bound))  # vllm-ascend's own
    for got, want in zip(bound, reference_cache):
        torch.testing.assert_close(got.squeeze(2), want, rtol=1e-5, atol=1e-6)
    assert run.accepted[0] > 0, (run.accepted, run.made)  # drafts that verify: the decode exercised acceptance


def ours_drafting_on_sfa(release, path, k, monkeypatch, backend, w8a8: bool = False):
    """The V1 adapter the release's factory builds for the DSA draft at ``path``, built on vLLM's modules and
    warmed on the SFA cache's shapes: ``(adapter, our DSA model, its config, the draft layer's name)``."""
    import vllm_ascend.spec_decode as sd

    from ascend_spec.compat import draft_core
    from ascend_spec.compat.host_weights import config_from_vllm
    from ascend_spec.compat.sfa_cache import indexer_cache_layer
    from ascend_spec.graph.weights import load_model

    ours = load_model(path)
    monkeypatch.setattr(draft_core, "get_backend", lambda *a, **kw: backend)
    d = sd.get_spec_decode_method("mtp", v1_config(path, ours.cfg.model_type, k), "cpu", None)
    assert type(d).__name__ == "AscendSpecNpuMtpProposer" and d.ascend_enabled
    cfg = config_from_vllm(d.vllm_config)
    assert cfg.model_type == ours.cfg.model_type and cfg.indexer == ours.cfg.indexer
    ours_on_vllm(d, ours, cfg, w8a8)
    layer = f"model.layers.{cfg.num_hidden_layers}.self_attn.attn"
    d._ascend_block_size = BLOCK  # what NPUModelRunner passes to initialize_attn_backend
    d._build_on_stand_in([layer, indexer_cache_layer(layer)] if splits_indexer_cache(release) else [layer],
                         NUM_BLOCKS)
    return d, ours, cfg, layer


@pytest.mark.parametrize("preset,k", CASES)
def test_ours_drafts_dsa_on_vllm_ascends_sfa_cache_in_graph_mode(release, dsa_ckpts, monkeypatch, preset, k):
    """V1: the release's factory builds ours for the DSA draft; our graphs are warmed on the SFA cache's shapes at
    block 128 (the release's own SFA kernel block), bind vllm-ascend's tensors (no copy) and draft a greedy decode
    with the same drafts, writes and per-position acceptance as the eager proposer."""
    from ascend_spec.config import SpeculativeConfig
    from ascend_spec.proposer import MtpProposer

    assert sfa_kernel_block_sizes(release) == [BLOCK]
    backend = RehearsalBackend("raise")
    d, ours, cfg, layer = ours_drafting_on_sfa(release, dsa_ckpts[(preset, "agreeing")], k, monkeypatch, backend)
    warmed = dict(backend.recorded)
    widths = (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.indexer.head_dim)
    assert warmed and all(shapes[-3:] == tuple((NUM_BLOCKS, BLOCK, w) for w in widths)
                          for shapes in warmed.values()), warmed
    decode_as_eager(d, ours, release, layer, k, seed=0)
    assert backend.recorded == warmed  # no graph met a shape warm-up had not made


@pytest.mark.parametrize("release", ["main"], indirect=True)
def test_a_w8a8_mtp_layer_drafts_through_vllm_ascends_quantised_modules(release, dsa_ckpts, monkeypatch):
    """A W8A8 GLM-5.x-style checkpoint whose MTP layer is quantised too: ours runs vllm-ascend's quantised linears
    (int8 weights, dynamic int8 activations; the indexer's ``wq_b`` among them) through its graphs, owns no weight,
    and drafts as the eager proposer on the same modules; drafts still verify."""
    from ascend_spec.config import SpeculativeConfig
    from ascend_spec.proposer import MtpProposer

    k = 3
    d, ours, cfg, layer = ours_drafting_on_sfa(release, dsa_ckpts[("v32-half-rope", "agreeing")], k, monkeypatch,
                                               RehearsalBackend("raise"), w8a8=True)
    called = set()
    forward = vllm_mtp_standin.W8A8Linear.forward
    monkeypatch.setattr(vllm_mtp_standin.W8A8Linear, "forward", lambda m, x: called.add(id(m)) or forward(m, x))
    gen = torch.Generator().manual_seed(3)
    ctx, bound = sfa_cache(release, cfg, layer, gen)
    d.vllm_config.compilation_config = types.SimpleNamespace(static_forward_context=ctx)
    reference = MtpProposer(d._ascend_model, SpeculativeConfig(num_speculative_tokens=k), MAX_LEN,
                            tuple(t.squeeze(2).clone() for t in bound))
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist() for n in (11, 20)]
    run = Decode(Target(ours), prompts, k, reference)
    for _ in range(6):
        run.step(d)
    assert d.ascend_stats.graph_calls == 6 and run.accepted[0] > 0, (d.ascend_stats, run.accepted)
    assert len(called) == 6  # fused_qkv_a, q_b, o, the indexer's wq_b, the MLP's gate_up and down


@pytest.mark.parametrize("transferred", ["sfa_tuple", "latent_only"])
def test_a_decode_node_drafts_on_the_prompt_kv_the_prefill_node_wrote(release, dsa_ckpts, monkeypatch,
                                                                      transferred):
    """Prefill-decode disaggregation: the prefill node's drafter writes the prompt's draft-layer KV (latents and
    indexer keys); the decode node's drafter, which never saw the prompt, gets that KV as transferred and drafts
    from its first step as one node would. Transferring the latent pair without the indexer's keys (``latent_only``,
    the shape of a transfer that forgets the SFA tuple's third tensor) makes its drafts differ: the test sees it.
    Random weights: their drafts follow which tokens the indexer picks (a trained miniature's barely do)."""
    from ascend_spec.config import SpeculativeConfig
    from ascend_spec.proposer import MtpProposer

    k, path = 2, dsa_ckpts[("glm5-shared-topk", "random")]
    prefill_node, ours, cfg, layer = ours_drafting_on_sfa(release, path, k, monkeypatch, RehearsalBackend("raise"))
    decode_node, *_ = ours_drafting_on_sfa(release, path, k, monkeypatch, RehearsalBackend("raise"))
    gen = torch.Generator().manual_seed(2)
    ctx, bound = sfa_cache(release, cfg, layer, gen)
    prefill_node.vllm_config.compilation_config = types.SimpleNamespace(static_forward_context=ctx)
    reference = MtpProposer(ours, SpeculativeConfig(num_speculative_tokens=k), MAX_LEN,
                            tuple(t.squeeze(2).clone() for t in bound))
    # prompts longer than the indexer's top-k (16): which tokens a draft attends depends on the keys
    prompts = [torch.randint(1, cfg.vocab_size, (n,), generator=gen).tolist() for n in (27, 34)]
    run = Decode(Target(ours), prompts, k, reference)
    run.step(prefill_node, verify_drafts=False)  # the prefill node: the prompt; its drafts are not sent
    # the decode node's pool: noise, then the prompt's blocks (3 and 5) as the KV transfer writes them
    ctx_d, bound_d = sfa_cache(release, cfg, layer, gen)
    sent = bound if transferred == "sfa_tuple" else bound[:2]
    for src, dst in zip(sent, bound_d):
        dst[[3, 5]] = src[[3, 5]]
    decode_node.vllm_config.compilation_config = types.SimpleNamespace(static_forward_context=ctx_d)
    steps = 5
    if transferred == "sfa_tuple":
        for _ in range(steps):
            run.step(decode_node)
        assert decode_node.ascend_stats.graph_calls == steps
        return
    with pytest.raises(AssertionError, match="ours differs from the eager proposer"):
        for _ in range(steps):
            run.step(decode_node)


@pytest.mark.parametrize("preset,k", CASES)
def test_v2_speculator_drafts_dsa_on_the_sfa_cache(release, dsa_ckpts, monkeypatch, preset, k):
    """V2: the release's ``init_speculator`` builds ours for the DSA draft; ``set_attn`` finds the draft layer's
    group (block 128) among the layers vLLM registered for it (the indexer's key cache among them where the
    release binds it apart) and builds ours on the SFA cache's shapes; ``propose`` (vllm-ascend's arguments) binds
    its tensors and drafts a greedy decode as the eager proposer does on the same inputs, step by step."""
    from ascend_spec.compat.host_weights import config_from_vllm
    from ascend_spec.compat import draft_core
    from ascend_spec.compat.sfa_cache import indexer_cache_layer
    from ascend_spec.config import SpeculativeConfig
    from ascend_spec.graph.weights import load_model
    from ascend_spec.proposer import MtpProposer

    path = dsa_ckpts[(preset, "agreeing")]
    ours = load_model(path)
    backend = RehearsalBackend("raise")
    monkeypatch.setattr(draft_core, "get_backend", lambda *a, **kw: backend)
    vc = v2_config(True, k=k)
    vc.model_config.max_model_len = MAX_LEN
    vc.speculative_config.draft_model_config = draft_config(path, ours.cfg.model_type)
    d = init_speculator(release)(vc, "cpu")
    cfg = config_from_vllm(d.vllm_config)
    ours_on_vllm(d, ours, cfg)
    layer = f"model.layers.{cfg.num_hidden_layers}.self_attn.attn"
    names = {layer, indexer_cache_layer(layer)} if splits_indexer_cache(release) else {layer}
    d.draft_attn_layer_names = names
    group = types.SimpleNamespace(layer_names=sorted(names), kv_cache_spec=types.SimpleNamespace(block_size=BLOCK))
    kv_cfg = types.SimpleNamespace(kv_cache_groups=[group], num_blocks=NUM_BLOCKS)
    tables = types.SimpleNamespace(input_block_tables=[torch.tensor([[3], [5]], dtype=torch.int32)],
                                   slot_mappings=[torch.tensor([3] * 3 + [5] * 3) * BLOCK])
    extra = [object()] * (len(their_method(release, "set_attn").args.args) - 4)  # main: target buffers, groups
    d.set_attn("model-state", kv_cfg, tables, *extra)
    assert d._ascend_layer == layer and d._block_size == BLOCK
    decode_as_eager(d, ours, release, layer, k, seed=1)


def test_the_glm_gate_runs_vllm_ascends_drafter_eagerly_and_ours_in_graph_mode(release, dsa_ckpts):
    """The release's ``_is_glm_model`` (run as written) catches GLM-5's draft, so vllm-ascend's own drafter runs it
    eagerly; enabled, the factory builds ours instead (its graphs: the test above); disabled, vllm-ascend's own."""
    import vllm_ascend.spec_decode as sd

    tree = ast.parse(standin.excerpt(release, "vllm_ascend/spec_decode/llm_base_proposer.py"))
    ns: dict = {}
    exec(compile(ast.Module([n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_is_glm_model"],
                            []), "_is_glm_model", "exec"), ns)

    def text_config(model_type: str) -> types.SimpleNamespace:
        return types.SimpleNamespace(hf_text_config=types.SimpleNamespace(model_type=model_type))

    assert ns["_is_glm_model"](text_config("glm_moe_dsa")) and not ns["_is_glm_model"](text_config("deepseek_v32"))
    path = dsa_ckpts[("glm5-shared-topk", "agreeing")]
    enabled = sd.get_spec_decode_method("mtp", v1_config(path, "glm_moe_dsa", 2), "cpu", None)
    assert type(enabled).__name__ == "AscendSpecNpuMtpProposer" and enabled.ascend_enabled
    off = v1_config(path, "glm_moe_dsa", 2)
    off.additional_config = {"ascend_spec": {"enabled": False}}
    theirs = sd.get_spec_decode_method("mtp", off, "cpu", None)
    assert type(theirs).__name__ == "AscendEagleProposer"


@pytest.mark.parametrize("release", ["v0.23.0", "main"], indirect=True)
@pytest.mark.parametrize("keys", ["model_dtype", "int8_with_scale"])
def test_the_sfa_cache_is_checked_at_start(release, dsa_ckpts, monkeypatch, keys):
    """NPUModelRunner binds the KV cache before it calls ``initialize_attn_backend``: there ours binds the SFA
    cache at once, so int8 indexer keys (a scale cache beside them) are one error at start, naming them."""
    import vllm_ascend.spec_decode as sd
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from ascend_spec.compat import draft_core
    from ascend_spec.compat.host_weights import config_from_vllm
    from ascend_spec.compat.sfa_cache import indexer_cache_layer
    from ascend_spec.compat.shims import CompatError
    from ascend_spec.graph.weights import load_model

    path = dsa_ckpts[("v32-half-rope", "agreeing")]
    ours = load_model(path)
    monkeypatch.setattr(draft_core, "get_backend", lambda *a, **kw: RehearsalBackend("raise"))
    d = sd.get_spec_decode_method("mtp", v1_config(path, ours.cfg.model_type, 2), "cpu", None)
    cfg = config_from_vllm(d.vllm_config)
    ours_on_vllm(d, ours, cfg)
    layer = f"model.layers.{cfg.num_hidden_layers}.self_attn.attn"
    names = [layer, indexer_cache_layer(layer)] if splits_indexer_cache(release) else [layer]
    monkeypatch.setattr(SpecDecodeBaseProposer, "initialize_attn_backend",  # vLLM's: the draft attention groups
                        lambda self, kv_cache_config, kernel_block_sizes=None: setattr(
                            self, "draft_attn_groups", [types.SimpleNamespace(layer_names=names)]))
    ctx, bound = sfa_cache(release, cfg, layer, torch.Generator().manual_seed(4))
    if keys == "int8_with_scale":
        int8 = bound[2].to(torch.int8)
        scale = torch.ones(NUM_BLOCKS, BLOCK, 1, 1)
        if splits_indexer_cache(release):
            ctx[indexer_cache_layer(layer)].kv_cache = (int8, scale)
        else:
            ctx[layer].kv_cache = (*bound[:2], int8, scale)
    d.vllm_config.compilation_config = types.SimpleNamespace(static_forward_context=ctx)
    kv_cfg = types.SimpleNamespace(num_blocks=NUM_BLOCKS)
    if keys == "int8_with_scale":
        with pytest.raises(CompatError, match=r"int8 indexer keys \(sparse LI C8\) are not read by ours"):
            d.initialize_attn_backend(kv_cfg, BLOCK)
        return
    d.initialize_attn_backend(kv_cfg, BLOCK)
    assert d._ascend_cache_bound and d._ascend.draft_cache[2].data_ptr() == bound[2].data_ptr()
