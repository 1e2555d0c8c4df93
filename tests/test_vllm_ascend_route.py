"""The Ascend route (compat/ascend.py) against every supported vllm-ascend release's own sources, without an NPU.

Per release (tests/data/vllm_ascend/<tag>, excerpts of its source archive): the runner's calls on its drafter bind to
our adapter; our adapter accepts every parameter of ``AscendEagleProposer``'s methods; vllm-ascend's real factory,
patched through the import hook, returns our adapter when enabled and its own drafter otherwise; the runner's
isinstance guards accept our adapter; ``_propose``'s keywords become the right ``DraftInputs`` (the V2 runner: test_vllm_ascend_v2.py). vllm-ascend's own files run where they can (factory, AscendEagleProposer); see vllm_ascend_standin.py.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import types

import pytest
import torch

from ascend_spec.graph.backends import ShapePolicy
from ascend_spec.graph.backends.lint import GraphLint
from ascend_spec.graph.backends.rehearsal import RehearsalBackend

from ascend_spec.compat import ascend, ascend_hook, schedule_k
from ascend_spec.config import ConfigError

from . import vllm_ascend_standin as standin
from .conftest import npu_available

TAGS = standin.TAGS
#: NPUModelRunner methods holding the guards our drafter must pass (the MTP path reaches all three)
GUARDED = ("initialize_kv_cache", "_check_and_update_cudagraph_mode", "_build_attention_metadata")
#: the drafter methods the Ascend runner calls for mtp
RUNNER_CALLS = ("_propose", "prepare_next_token_ids_padded", "prepare_inputs_padded", "dummy_run", "load_model",
                "initialize_attn_backend", "initialize_cudagraph_keys")


def vllm_config(enabled: bool | None = True, method: str = "mtp", k: int = 2, step3p5: bool = False,
                v2: bool = False) -> types.SimpleNamespace:
    extra = {} if enabled is None else {"ascend_spec": {"enabled": enabled}}
    spec = types.SimpleNamespace(method=method, num_speculative_tokens=k, draft_sample_method="greedy",
                                 use_step3p5_mtp=lambda: step3p5)
    return types.SimpleNamespace(additional_config=extra, speculative_config=spec, use_v2_model_runner=v2,
                                 model_config=types.SimpleNamespace(max_model_len=64, dtype=torch.float32),
                                 scheduler_config=types.SimpleNamespace(max_num_seqs=4),
                                 parallel_config=types.SimpleNamespace(data_parallel_size=1, data_parallel_rank=0))


@pytest.fixture(params=TAGS)
def release(request, tmp_path, monkeypatch):
    """vllm-ascend ``tag`` importable from tmp_path, with the route's import hook installed first."""
    tag = request.param
    standin.forget()
    ascend_hook.uninstall()
    standin.build(tag, tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(schedule_k, "runner_passes_k", schedule_k.runner_passes_k)  # install sets it
    ascend.install()
    yield tag
    standin.forget()
    ascend_hook.uninstall()


def runner_class(tag: str) -> ast.ClassDef:
    tree = ast.parse(standin.excerpt(tag, "vllm_ascend/worker/model_runner_v1.py"))
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NPUModelRunner")


def drafter_calls(tag: str) -> dict[str, list[ast.Call]]:
    """``self.drafter.<method>(...)`` calls in the release's NPUModelRunner."""
    out: dict[str, list[ast.Call]] = {}
    for n in ast.walk(runner_class(tag)):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                and ast.unparse(n.func.value) == "self.drafter":
            out.setdefault(n.func.attr, []).append(n)
    return out


def their_methods(tag: str) -> dict[str, ast.FunctionDef]:
    """Methods of AscendEagleProposer in the release: its own, then AscendSpecDecodeBaseProposer's."""
    out: dict[str, ast.FunctionDef] = {}
    for path, cls in (("vllm_ascend/spec_decode/eagle_proposer.py", "AscendEagleProposer"),
                      ("vllm_ascend/spec_decode/llm_base_proposer.py", "AscendSpecDecodeBaseProposer")):
        for n in ast.parse(standin.excerpt(tag, path)).body:
            if isinstance(n, ast.ClassDef) and n.name == cls:
                for f in n.body:
                    if isinstance(f, ast.FunctionDef):
                        out.setdefault(f.name, f)
    return out


def adapter_class() -> type:
    return ascend.ascend_adapter_class()


# ------------------------------------------------------------------------------------------ signatures


@pytest.mark.parametrize("tag", TAGS)
def test_runner_calls_on_the_drafter_bind_to_our_adapter(tag, tmp_path, monkeypatch):
    calls = drafter_calls(tag)
    assert set(RUNNER_CALLS) <= set(calls), f"{tag}: the runner no longer calls {set(RUNNER_CALLS) - set(calls)}"
    standin.forget()
    standin.build(tag, tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cls = ascend.build_ascend_adapter_class(
            __import__("vllm_ascend.spec_decode.eagle_proposer", fromlist=["x"]).AscendEagleProposer)
        for name in RUNNER_CALLS:
            sig = inspect.signature(getattr(cls, name))
            for call in calls[name]:
                if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
                    continue
                args = [object()] * (1 + len(call.args))  # self + positional
                kwargs = {k.arg: object() for k in call.keywords}
                try:
                    sig.bind(*args, **kwargs)
                except TypeError as e:
                    pytest.fail(f"{tag}: runner line {call.lineno} `{ast.unparse(call)[:120]}` does not bind to "
                                f"our {name}{sig}: {e}")
        assert all(not c.args for c in calls["_propose"]), "the runner passes _propose positionally now"
    finally:
        standin.forget()


@pytest.mark.parametrize("tag", TAGS)
def test_adapter_accepts_every_parameter_of_ascend_eagle_proposer(tag, tmp_path, monkeypatch):
    theirs = their_methods(tag)
    standin.build(tag, tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    standin.forget()
    try:
        base = __import__("vllm_ascend.spec_decode.eagle_proposer", fromlist=["x"]).AscendEagleProposer
        cls = ascend.build_ascend_adapter_class(base)
        for name in ("_propose", "prepare_next_token_ids_padded", "prepare_inputs_padded", "dummy_run",
                     "load_model"):
            fn = theirs[name]
            ours = inspect.signature(getattr(cls, name)).parameters
            var_kw = any(p.kind is p.VAR_KEYWORD for p in ours.values())
            var_pos = any(p.kind is p.VAR_POSITIONAL for p in ours.values())
            their_pos = [a.arg for a in fn.args.args][1:]
            their_kw = [a.arg for a in fn.args.kwonlyargs]
            for i, p in enumerate(their_pos + their_kw):
                assert p in ours or var_kw, f"{tag}: our {name} does not accept {p!r}"
            # positional order: where theirs can be called positionally, ours takes the same name at the index
            our_pos = [p.name for p in ours.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]
            if name != "_propose":  # called with keywords only (checked on the runner above)
                for i, p in enumerate(their_pos):
                    assert i < len(our_pos) and our_pos[i] in (p, "discard_request_mask", "target_model") \
                        or (i >= len(our_pos) and var_pos), f"{tag}: {name} positional #{i} {p!r} vs ours {our_pos}"
            # nothing we require that they do not pass
            required = [p.name for p in ours.values() if p.default is p.empty
                        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name != "self"]
            assert len(required) <= len(their_pos) + len(their_kw), f"{tag}: our {name} requires {required}"
    finally:
        standin.forget()


# ------------------------------------------------------------------------------------------ the factory


def test_patched_factory_returns_our_adapter_only_when_enabled(release):
    import vllm_ascend.spec_decode as sd
    from vllm_ascend.spec_decode.eagle_proposer import AscendEagleProposer

    assert getattr(sd.get_spec_decode_method, "__ascend_spec_patched__", None) is not None
    ours = sd.get_spec_decode_method("mtp", vllm_config(True), "cpu", runner="R")
    assert isinstance(ours, AscendEagleProposer) and type(ours) is not AscendEagleProposer
    assert type(ours).__ascend_spec_adapter__ and ours.ascend_enabled and ours.runner == "R"
    for cfg, method in ((vllm_config(None), "mtp"), (vllm_config(False), "mtp"), (vllm_config(True), "eagle"),
                        (vllm_config(True, method="eagle"), "eagle")):
        theirs = sd.get_spec_decode_method(method, cfg, "cpu", "R")
        assert type(theirs) is AscendEagleProposer, (release, cfg.additional_config, method)
    other = sd.get_spec_decode_method("mtp", vllm_config(True, step3p5=True), "cpu", "R")
    assert type(other).__name__ == "AscendStep3p5MTPProposer"


def test_runner_module_binds_the_patched_factory_in_either_import_order(release):
    import vllm_ascend.worker.model_runner_v1 as runner_mod

    assert runner_mod.get_spec_decode_method is sys.modules["vllm_ascend.spec_decode"].get_spec_decode_method
    # imported before the hook (another plugin imported vllm-ascend first): install() patches in place
    standin.forget()
    ascend_hook.uninstall()
    import vllm_ascend.worker.model_runner_v1 as early

    assert getattr(early.get_spec_decode_method, "__ascend_spec_patched__", None) is None
    ascend.install()
    assert getattr(early.get_spec_decode_method, "__ascend_spec_patched__", None) is not None
    assert early.get_spec_decode_method is sys.modules["vllm_ascend.spec_decode"].get_spec_decode_method


def test_v2_runner_imported_before_the_hook_is_rebound(release):
    standin.forget()
    ascend_hook.uninstall()
    import vllm_ascend.worker.v2.model_runner as v2_runner

    assert getattr(v2_runner.init_speculator, "__ascend_spec_patched__", None) is None
    ascend.install()
    assert getattr(v2_runner.init_speculator, "__ascend_spec_patched__", None) is not None


def test_bad_settings_raise_from_the_factory(release):
    import vllm_ascend.spec_decode as sd

    cfg = vllm_config(True)
    cfg.additional_config["ascend_spec"]["warmpu"] = True
    with pytest.raises(ConfigError, match=r"warmpu.*allowed keys"):
        sd.get_spec_decode_method("mtp", cfg, "cpu", None)


# ------------------------------------------------------------------------------------------ isinstance guards


def test_runner_isinstance_guards_accept_our_adapter(release):
    import vllm_ascend.spec_decode as sd
    from vllm_ascend.spec_decode.eagle_proposer import AscendEagleProposer

    drafter = sd.get_spec_decode_method("mtp", vllm_config(True), "cpu", None)
    methods = {f.name: f for f in runner_class(release).body if isinstance(f, ast.FunctionDef)}
    for name in GUARDED:
        guards = [n.args[1] for n in ast.walk(methods[name]) if isinstance(n, ast.Call)
                  and ast.unparse(n.func) == "isinstance" and ast.unparse(n.args[0]) == "self.drafter"]
        ns = {x.id: type(x.id, (), {}) for g in guards for x in ast.walk(g) if isinstance(x, ast.Name)}
        ns["AscendEagleProposer"] = AscendEagleProposer
        accepted = [ast.unparse(g) for g in guards if isinstance(drafter, eval(ast.unparse(g), ns))]  # noqa: S307
        assert accepted, f"{release}: NPUModelRunner.{name}: no isinstance guard accepts our drafter: " \
                         f"{[ast.unparse(g) for g in guards]}"


# ------------------------------------------------------------------------------------------ _propose


class RecordingDraft:
    """Where the adapter hands its DraftInputs: records them (the compiled draft itself is tested elsewhere)."""

    def __init__(self, k: int, cache: torch.Tensor) -> None:
        self.num_speculative_tokens = k
        self.draft_cache = cache
        self.inputs = []
        self.model = types.SimpleNamespace(takes_host_lengths=False)  # the reference kernel's: device lengths
        self.graph = types.SimpleNamespace(rows_for=lambda b: b if b <= 4 else None, num_failures=0, max_size=4,
                                           tokens_for=lambda b, q: (b + b % 2) * max(q, 8))  # even rows, q >= 8
        # torchair's policy: GE graphs take full-width block tables (the NPU attention op reads the live blocks)
        self.backend = types.SimpleNamespace(lint=GraphLint(strict=True), shapes=ShapePolicy(
            dynamic_batch=False, exact_batch=False, trim_context=False))

    @property
    def table_width(self) -> int:  # max_model_len 64 in blocks of the cache's size
        return -(-64 // self.draft_cache.shape[1])

    def graph_serves(self, batch: int, query: int) -> bool:  # prompt chunks up to 32 tokens replay a graph
        return query <= 32 and self.graph.rows_for(batch) is not None

    def propose(self, inputs):
        self.inputs.append(inputs)
        return torch.full((inputs.next_token_ids.shape[0], self.num_speculative_tokens), 7)

    def dummy_run(self, num_reqs: int) -> None:
        self.inputs.append(("dummy_run", num_reqs))

    def forward_tokens(self, batch: int, query: int) -> tuple[int, int]:
        return self.graph.tokens_for(batch, query), batch


def attn_metadata(qsl: list[int], seq_lens: list[int], k: int, block_table: torch.Tensor):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q = torch.tensor(qsl, dtype=torch.int32)
    t = qsl[-1]
    return CommonAttentionMetadata(
        query_start_loc=q, query_start_loc_cpu=q.clone(), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(qsl) - 1, num_actual_tokens=t, max_query_len=max(b - a for a, b in zip(qsl, qsl[1:])),
        max_seq_len=max(seq_lens), block_table_tensor=block_table, slot_mapping=torch.arange(100, 100 + t))


def recorded_inputs(qsl: list[int], seq_lens: list[int], tis: list[int], k: int = 2) -> dict:
    """A step as NPUModelRunner.propose_draft_token_ids passes it to ``_propose`` (padded drafter batch)."""
    t = qsl[-1]
    cam = attn_metadata(qsl, seq_lens, k, torch.tensor([[3, 4], [5, 6]], dtype=torch.int32)[: len(qsl) - 1])
    return dict(target_token_ids=torch.arange(10, 10 + t), target_positions=torch.arange(t) + 20,
                target_hidden_states=torch.arange(t * 4, dtype=torch.float32).view(t, 4),
                next_token_ids=torch.tensor([91, 92][: len(qsl) - 1]), token_indices_to_sample=torch.tensor(tis),
                common_attn_metadata=cam, target_model_batch_desc=object(), sampling_metadata=None,
                req_scheduled_tokens={"a": 3}, long_seq_metadata=None, num_prefill_reqs=0, num_decode_reqs=0,
                scheduler_output=object(), num_scheduled_tokens=t, num_rejected_tokens_gpu=None)


def built_adapter(k: int = 2, chains: tuple[int, ...] = ()):
    """The adapter with recording draft chains: K's, and one per K in ``chains`` (a per-batch-size schedule's)."""
    import vllm_ascend.spec_decode as sd

    d = sd.get_spec_decode_method("mtp", vllm_config(True, k=k), "cpu", None)
    d._ascend_chains = {j: RecordingDraft(j, torch.zeros(8, 16, 5)) for j in {k, *chains}}
    d._ascend = d._ascend_chains[k]
    d._ascend_cache_bound = True
    return d


def test_propose_translates_a_decode_step_into_draft_inputs(release):
    import vllm_ascend.ascend_forward_context as fc

    d = built_adapter()
    fc.CALLS.clear()
    # two requests verifying 1 + K = 3 tokens each; request 0 accepted 1 draft, request 1 all
    out = d._propose(**recorded_inputs([0, 3, 6], [13, 23], [1, 5]))
    assert out.shape == (2, 2) and d.ascend_stats.graph_calls == 1 and d.ascend_stats.fallback_calls == 0
    (x,) = d._ascend.inputs
    assert torch.equal(x.target_token_ids, torch.arange(10, 16).view(2, 3))
    assert torch.equal(x.target_positions, (torch.arange(6) + 20).view(2, 3))
    assert torch.equal(x.target_hidden_states, torch.arange(24, dtype=torch.float32).view(2, 3, 4))
    assert torch.equal(x.target_slot_mapping, torch.arange(100, 106).view(2, 3))
    assert x.token_indices_to_sample.tolist() == [1, 2]  # flat [1, 5] made per-request
    assert x.next_token_ids.tolist() == [91, 92] and x.seq_lens.tolist() == [13, 23]
    assert x.block_table.shape == (2, 4) and x.block_table[:, :2].tolist() == [[3, 4], [5, 6]]  # 64 / 16 blocks
    # drafted inside vllm-ascend's forward context, sized as the draft's graph runs (rows and width padded)
    (name, args), = fc.CALLS
    assert name == "set_ascend_forward_context" and args["num_tokens"] == 16 and args["is_draft_model"] is True
    assert args["attn_metadata"] is None and args["vllm_config"] is d.vllm_config


def test_propose_repacks_a_ragged_prefill_step(release):
    d = built_adapter()
    d._propose(**recorded_inputs([0, 4, 5], [4, 9], [3, 4]))
    (x,) = d._ascend.inputs
    assert x.target_token_ids.tolist() == [[10, 11, 12, 13], [14, 0, 0, 0]]
    assert x.target_slot_mapping.tolist() == [[100, 101, 102, 103], [104, -1, -1, -1]]
    assert x.token_indices_to_sample.tolist() == [3, 0]
    assert d.ascend_stats.graph_calls == 1 and d.ascend_stats.eager_calls == 0  # a 4-token chunk: a graph's width



def test_attention_reading_host_lengths_gets_the_runners_aligned_to_each_query_block(release):
    """torch_npu's attention reads KV lengths from the host (``npu_mla``): the adapter hands the runner's host
    lengths (optimistic under async scheduling), never the device's, each where its row's query block ends: a
    decode row's verify length; a prefill span right-padded to the batch's width ends as much later."""
    d = built_adapter()
    d._ascend.model.takes_host_lengths = True
    d.runner = types.SimpleNamespace(optimistic_seq_lens_cpu=torch.tensor([13, 23, 0]))
    d._propose(**recorded_inputs([0, 3, 6], [13, 23], [1, 5]))
    d.runner = types.SimpleNamespace(optimistic_seq_lens_cpu=torch.tensor([4, 9, 0]))
    d._propose(**recorded_inputs([0, 4, 5], [4, 9], [3, 4]))  # spans of 4 and 1 token, packed 4 wide
    decode, prefill = d._ascend.inputs
    assert decode.seq_lens_host == (13, 23) and prefill.seq_lens_host == (4, 12)
    assert all(type(n) is int for n in decode.seq_lens_host + prefill.seq_lens_host)


def test_propose_packs_an_unpadded_decode_step_at_the_decode_width(release):
    """vLLM's unpadded drafter batch: rejected tokens compacted away, spans of at most 1 + K tokens. Repacked on
    device at the decode width 1 + K (the warm decode graph), the forward context sized for it."""
    import vllm_ascend.ascend_forward_context as fc

    d = built_adapter()
    fc.CALLS.clear()
    d._propose(**recorded_inputs([0, 2, 3], [12, 21], [1, 2]))  # one draft accepted, then none
    (x,) = d._ascend.inputs
    assert x.target_token_ids.tolist() == [[10, 11, 0], [12, 0, 0]]
    assert x.target_slot_mapping.tolist() == [[100, 101, -1], [102, -1, -1]]
    assert x.token_indices_to_sample.tolist() == [1, 0]
    assert d.ascend_stats.graph_calls == 1 and d.ascend_stats.eager_calls == 0
    (name, args), = fc.CALLS
    assert args["num_tokens"] == d._ascend.graph.tokens_for(2, 3)

def test_propose_hands_what_it_cannot_draft_to_vllm_ascend(release):
    import vllm_ascend.spec_decode.llm_base_proposer as base

    d = built_adapter()
    base.CALLS.clear()
    step = recorded_inputs([0, 3, 6], [13, 23], [1, 5])
    step["long_seq_metadata"] = object()  # prefill context parallel
    assert d._propose(**step) == ("vllm-ascend", "_propose")
    (name, args), = [c for c in base.CALLS if c[0] == "_propose"]
    assert args["long_seq_metadata"] is step["long_seq_metadata"] and args["target_model_batch_desc"] is \
        step["target_model_batch_desc"]
    # K from the runner (main passes it; older releases do not take it, so it is not forwarded there)
    step = recorded_inputs([0, 3, 6], [13, 23], [1, 5])
    assert d._propose(num_speculative_tokens=1, **step) == ("vllm-ascend", "_propose")
    first, forwarded = [c[1] for c in base.CALLS if c[0] == "_propose"]
    takes_k = their_methods(release)["_propose"].args.args[1].arg == "num_speculative_tokens"
    assert takes_k == (release == "main")
    assert ("num_speculative_tokens" in forwarded) == takes_k and forwarded.get("num_speculative_tokens", 1) == 1
    assert first.get("num_speculative_tokens", 2) == 2  # not passed by the runner: the drafter's own K
    assert d.ascend_stats.fallbacks_by_reason == {"context_parallel": 1, "dynamic_k": 1}
    assert not d._ascend.inputs


def test_k_per_batch_size_where_the_runner_hands_each_steps_k_to_the_drafter(release):
    """vllm-ascend runs vLLM's scheduler, so the measured K per batch size (``k_schedule`` auto) is installed there
    too, where the runner passes each step's K to ``_propose`` (main); where it does not (up to v0.25.1rc1), K
    stays fixed, as a step must draft what was scheduled. A step's K is drafted by that K's chain."""
    from ascend_spec.compat import schedule_k

    cfg = vllm_config(True, k=2)
    cfg.speculative_config.num_speculative_tokens_per_batch_size = None
    expected = "auto" if release == "main" else "fixed"
    assert schedule_k.schedule_mode(cfg) == expected
    assert schedule_k.draft_ks(cfg, 2) == ((0, 1, 2) if release == "main" else (2,))
    if release != "main":
        return
    d = built_adapter(2, chains=(0, 1))
    step = recorded_inputs([0, 2, 4], [13, 23], [0, 1], k=1)
    out = d._propose(num_speculative_tokens=1, **step)
    assert out.shape == (2, 1) and d.ascend_stats.fallback_calls == 0
    assert len(d._ascend_chains[1].inputs) == 1 and not d._ascend_chains[2].inputs


def test_initialize_attn_backend_passes_the_runners_block_size_on(release, monkeypatch):
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    from ascend_spec.compat.shims import draft_block_size

    seen = []
    monkeypatch.setattr(SpecDecodeBaseProposer, "initialize_attn_backend",
                        lambda self, kv_cache_config, kernel_block_sizes=None: seen.append((kv_cache_config,
                                                                                           kernel_block_sizes)))
    d = built_adapter()
    d.ascend_enabled = False  # only the forwarding is under test (building ours needs vllm-ascend's loaded model)
    d.initialize_attn_backend("kv-config", 128)  # NPUModelRunner.initialize_kv_cache's call
    assert seen == [("kv-config", 128)]
    assert not hasattr(d, "block_size") and draft_block_size(d) == 128


@pytest.mark.parametrize("per_virtual_engine", [True, False])
def test_our_proposer_drafts_on_vllm_ascends_nope_rope_cache(release, trained_dir, monkeypatch, per_virtual_engine):
    """vllm-ascend's MLA binds the draft cache as nope ``[N, 128, 1, 512]`` and rope ``[N, 128, 1, 64]`` (as a
    tuple, or inside the per-virtual-engine list of older vLLM). The adapter binds that pair (views, no copy) and
    our proposer drafts on it through torchair's shape policy (one graph per bucket, each held to the shapes it
    was warmed up with: the run's block-table width in blocks of 128), with the reference attention kernel: the
    drafts and every cache write equal the eager proposer's on the same inputs."""
    from ascend_spec import torchair_proposer
    from ascend_spec.compat import draft_core
    from ascend_spec.config import SpeculativeConfig
    from ascend_spec.graph.latent_cache import allocate_latent_cache
    from ascend_spec.graph.weights import load_model
    from ascend_spec.proposer import MtpProposer

    backend = RehearsalBackend("raise")
    monkeypatch.setattr(draft_core, "get_backend", lambda *a, **kw: backend)
    model = load_model(trained_dir)
    cfg = model.cfg
    k, block, num_blocks, layer = 2, 128, 8, f"model.layers.{cfg.num_hidden_layers}.self_attn.attn"
    d = built_adapter(k)
    d._ascend_model, d._ascend_layer = model, layer
    d._ascend_block_size = block  # what NPUModelRunner passes to initialize_attn_backend (its MLA kernel block)
    d._build_ascend(allocate_latent_cache("pair", num_blocks, block, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                          torch.float32, "cpu"))
    assert isinstance(d._ascend, torchair_proposer.MtpTorchairProposer)
    warmed = dict(backend.recorded)
    # every key warmed on the pair, with the table width a live step passes: max_model_len 64 in blocks of 128
    assert warmed and all(shapes[5][1] == 1 and shapes[8:] == ((num_blocks, block, cfg.kv_lora_rank),
                                                                (num_blocks, block, cfg.qk_rope_head_dim))
                          for shapes in warmed.values()), warmed
    seen = []
    propose = d._ascend.propose
    d._ascend.propose = lambda inputs, return_logits=False: seen.append(inputs) or propose(inputs, return_logits)
    g = torch.Generator().manual_seed(0)
    nope = torch.randn(num_blocks, block, 1, cfg.kv_lora_rank, generator=g) * 0.1
    rope = torch.randn(num_blocks, block, 1, cfg.qk_rope_head_dim, generator=g) * 0.1
    bound = (nope, rope)
    d.vllm_config.compilation_config = types.SimpleNamespace(static_forward_context={
        layer: types.SimpleNamespace(kv_cache=[bound] if per_virtual_engine else bound)})
    # two requests verifying 1 + K tokens at positions 10..12 and 20..22 of blocks 3 and 5
    step = recorded_inputs([0, 3, 6], [13, 23], [1, 5], k)
    pos = torch.tensor([10, 11, 12, 20, 21, 22])
    cam = step["common_attn_metadata"]
    step["common_attn_metadata"] = dataclasses.replace(
        cam, block_table_tensor=torch.tensor([[3], [5]], dtype=torch.int32),
        slot_mapping=torch.tensor([3, 3, 3, 5, 5, 5]) * block + pos)
    step.update(target_positions=pos, target_token_ids=torch.randint(1, cfg.vocab_size, (6,), generator=g),
                target_hidden_states=torch.randn(6, cfg.hidden_size, generator=g),
                next_token_ids=torch.tensor([5, 9]))
    reference_cache = (nope.squeeze(2).clone(), rope.squeeze(2).clone())
    drafts = d._propose(**step)
    assert d.ascend_stats.graph_calls == 1 and d.ascend_stats.fallback_calls == 0
    assert d._ascend.draft_cache[0].data_ptr() == nope.data_ptr()  # vllm-ascend's own tensors, written in place
    assert backend.recorded == warmed  # no graph key met a shape warm-up had not made
    (inputs,) = seen
    eager = MtpProposer(model, SpeculativeConfig(num_speculative_tokens=k), 64, reference_cache)
    assert torch.equal(drafts, eager.propose(inputs))
    for ours, theirs in zip((nope.squeeze(2), rope.squeeze(2)), reference_cache):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert not torch.equal(nope.squeeze(2)[3, 10:14], torch.zeros(4, cfg.kv_lora_rank))


def test_dummy_runs_are_vllm_ascends_until_ours_is_built(release):
    """Its profile run (before the KV pool is sized, our graphs not built) stays vllm-ascend's; once ours is built,
    the runner's dummy steps (ACL graph captures of its drafter) are inert drafts through our graphs, never a
    capture of its drafter."""
    import vllm_ascend.spec_decode.llm_base_proposer as base

    d = built_adapter()
    ours, d._ascend = d._ascend, None
    base.CALLS.clear()
    d.dummy_run(num_tokens=12, with_prefill=False, num_reqs=4, is_profile=True)
    assert [c[0] for c in base.CALLS] == ["dummy_run"]
    d._ascend = ours
    base.CALLS.clear()
    d.dummy_run(num_tokens=12, with_prefill=False, num_reqs=4, in_graph_capturing=True, is_profile=False)
    d.dummy_run(9)  # positional, no request count: rows from tokens / (1 + K), at most the largest bucket
    assert base.CALLS == [] and ours.inputs == [("dummy_run", 4), ("dummy_run", 3)]
    assert d.ascend_stats.own_dummy_runs == 2


def test_under_data_parallel_each_draft_and_dummy_run_syncs_once_as_vllm_ascends(release):
    """vllm-ascend's drafter calls its runner's ``_sync_metadata_across_dp(n, is_draft_model=True)`` once per
    ``_propose`` and once per ``dummy_run``: ours does too (with its first pass's tokens), so a busy rank's drafts
    and an idle rank's dummy steps stay paired; without data parallel it never calls it."""
    (sync,) = [f for f in runner_class(release).body if getattr(f, "name", "") == "_sync_metadata_across_dp"]
    assert [a.arg for a in sync.args.args[1:3]] == ["num_tokens", "is_draft_model"]  # the release's signature
    for dp in (1, 2):
        d = built_adapter()
        d.ascend_stats.dp_size = dp
        calls = []
        d.runner = types.SimpleNamespace(
            _sync_metadata_across_dp=lambda n, is_draft_model=False: calls.append((n, is_draft_model)))
        d._propose(**recorded_inputs([0, 3, 6], [13, 23], [1, 5]))
        d.dummy_run(num_tokens=12, with_prefill=False, num_reqs=4, is_profile=False)
        assert calls == ([] if dp == 1 else [(2 * 8, True), (4 * 8, True)]), calls  # rows x width of each pass
        assert d.ascend_stats.dp_syncs == len(calls)


def test_a_moe_mtp_layer_under_data_parallel_is_refused_on_vllm_ascend(release):
    d = built_adapter()
    d.ascend_stats.dp_size = 2
    with pytest.raises(ascend.CompatError, match="MoE MTP layer with data_parallel_size=2 is not supported"):
        d._refuse_unpaired_dp(moe=True)
    d._refuse_unpaired_dp(moe=False)


class Request:
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def get_token_id(self, i: int) -> int:
        return self.tokens[i] if i < len(self.tokens) else -1


def test_next_token_ids_from_the_runners_discard_indices_and_count(release):
    """NPUModelRunner passes (sampled, requests, input_batch, discard_request_indices.gpu, num_discarded_requests)."""
    import numpy as np

    calls = drafter_calls(release)["prepare_next_token_ids_padded"]
    assert all(len(c.args) == 5 and not c.keywords for c in calls), [ast.unparse(c) for c in calls]
    d = built_adapter()
    d._ascend_model = types.SimpleNamespace(cfg=types.SimpleNamespace(vocab_size=100))
    requests = {"a": Request([1, 2, 3, 4, 5]), "b": Request([6, 7, 8]), "c": Request([9, 10])}
    batch = types.SimpleNamespace(req_ids=["a", "b", "c"], num_tokens_no_spec=np.array([5, 3, 2]))
    sampled = torch.tensor([[11, 12, -1], [13, -1, -1], [14, 15, 16]])
    indices = torch.tensor([2, 0, 0, 0])  # the runner's buffer: only the first num_discarded entries count
    next_ids, count = d.prepare_next_token_ids_padded(sampled, requests, batch, indices, 1)
    assert next_ids.tolist() == [12, 13, 10]  # request c's sample is discarded: its last known token
    assert count.tolist() == [2, 1, 0]


# ------------------------------------------------------------------------------------------ the plugin


def test_register_on_ascend_patches_the_factory_and_leaves_vllms_global(monkeypatch):
    import vllm.v1.worker.gpu_model_runner as gmr

    from ascend_spec.compat import plugin

    ascend_hook.uninstall()
    before = gmr.EagleProposer
    monkeypatch.setattr(ascend, "on_ascend", lambda: True)
    monkeypatch.setattr(schedule_k, "runner_passes_k", schedule_k.runner_passes_k)  # install sets it
    plugin.register()
    try:
        assert gmr.EagleProposer is before
        assert ascend.FACTORY_MODULE in ascend_hook.hook().patches
    finally:
        ascend_hook.uninstall()


def test_on_ascend_reads_the_platforms_device_type(monkeypatch):
    import vllm.platforms as platforms

    monkeypatch.setattr(platforms, "_current_platform", types.SimpleNamespace(device_type="npu"))
    assert ascend.on_ascend()
    monkeypatch.setattr(platforms, "_current_platform", types.SimpleNamespace(device_type="cpu"))
    assert not ascend.on_ascend()


def test_vendored_excerpts_are_named_in_the_readme():
    readme = (standin.DATA / "README.md").read_text()
    for tag in TAGS:
        assert (standin.DATA / tag / "vllm_ascend" / "spec_decode" / "__init__.py").is_file()
        assert f"`{tag}`" in readme, tag


@pytest.mark.npu
@pytest.mark.skipif(not npu_available(), reason="needs an Ascend NPU with torch_npu, CANN and vllm-ascend")
def test_end_to_end_on_an_npu_ours_equals_vllm_ascend_mtp_equals_no_spec():
    """Greedy: our drafter, vllm-ascend's own MTP drafter and no speculation give the same tokens."""
    pytest.importorskip("vllm_ascend")
    from vllm import LLM, SamplingParams

    from ascend_spec.models import BUNDLED_MODEL_DIR

    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2}
    outs = {}
    for name, extra, sc in (("no-spec", {}, None),
                            ("vllm-ascend", {"ascend_spec": {"enabled": False}}, spec),
                            ("ours", {"ascend_spec": {"enabled": True},
                                      "torchair_graph_config": {"backend": "torchair", "graph_batch_sizes": [1, 2, 4]}},
                             spec)):
        llm = LLM(model=str(BUNDLED_MODEL_DIR), speculative_config=sc, additional_config=extra, max_model_len=256)
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if name == "ours":
            from ascend_spec.compat.drafter import live_stats

            assert any(s["drafter"] == "ascend_spec" and s["graph_calls"] > 0 for s in live_stats())
        del llm
    assert outs["ours"] == outs["vllm-ascend"] == outs["no-spec"]
