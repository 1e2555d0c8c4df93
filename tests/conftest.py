import importlib
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from ascend_spec.config import KEEP_LEARNINGS_ENV, EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import load_engine
from ascend_spec.graph.backends.base import GRAPH_FAILURE_ENV
from ascend_spec.graph.config import ModelConfig
from ascend_spec.graph.model import DeepseekV3ForCausalLM
from ascend_spec.graph.weights import save_model
from ascend_spec.models import BUNDLED_MODEL_DIR, FIXTURE_MODEL_DIR
from ascend_spec.sampling import SamplingParams

# The suite runs strict: a compiled graph that fails, or that needs the host (graph lint), fails its test instead
# of rerunning eagerly; tests of the eager fallback ask for graph_failure="eager" themselves. Subprocesses (the vLLM
# harness) inherit it.
os.environ.setdefault(GRAPH_FAILURE_ENV, "raise")
# Adaptive K starts afresh in every test: learnings an earlier test (or run) kept would change its choices. The
# tests of learnings ask for them (tests/test_learnings.py).
os.environ.setdefault(KEEP_LEARNINGS_ENV, "0")

def pytest_addoption(parser) -> None:
    parser.addoption("--plant-defect", default=None, metavar="NAME",
                     help="plant one defect (tests/planted_defects.py) to see the test guarding it fail")


# Under pytest-xdist (make test), modules are dealt whole to the workers in collection order: the longest first,
# so that no long module starts last and leaves a worker idle (seconds per module: docs/test-suite.md).
LONGEST_FIRST = ("test_fused_step", "test_vllm_tp", "test_vllm_dp", "test_vllm_v2", "test_vllm_amx_mla",
                 "test_moe_graph", "test_vllm_plugin", "test_vllm_sampling", "test_aot_graphs",
                 "test_vllm_bf16_cpu_mla", "test_kv_layouts",
                 "test_vllm_moe", "test_graph_mode", "test_ge_op_audit", "test_ge_op_audit_drafter",
                 "test_vllm_serve", "test_upgrade_check", "test_bundled_model", "test_vllm_memory", "test_guards",
                 "test_deferred_graphs", "test_vllm_quant", "test_draft_kv_lengths")


#: where ``pytest_runtest_protocol`` appends one JSON line per test: its CPU seconds (this process and the
#: subprocesses it waited for) and wall seconds, setup and teardown included; unset: nothing is written
CPU_LOG_ENV = "ASCEND_SPEC_TEST_CPU_LOG"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(CPU_LOG_ENV)
    if not path:
        yield
        return
    import resource

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    c0, t0 = cpu(), time.monotonic()
    yield
    with open(path, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "cpu": round(cpu() - c0, 2),
                            "wall": round(time.monotonic() - t0, 2)}) + "\n")


def matrix(*values, **kwargs):
    """A parameter set of the second tier (``make test-matrix``): a repeat of a subject that ``make test`` covers
    with another of its parameters (another K, sampling mode, checkpoint or runner). docs/test-suite.md names, for
    each, the test of ``make test`` that covers its subject."""
    return pytest.param(*values, marks=pytest.mark.matrix, **kwargs)


def matrix_selected(request) -> bool:
    """Whether this session runs a test of the second tier in the module asking (``request`` of a module fixture):
    its fixtures then run the engines those tests read as well. ``make test`` deselects every ``matrix`` test, so
    its engines are not run there; a plain ``pytest tests/test_x.py`` runs both tiers."""
    return any(item.get_closest_marker("matrix") is not None and item.path == request.path
               for item in request.session.items)


def for_tier(request, configs: list[dict]) -> list[dict]:
    """The engine configurations this session's tests of the module read: those tagged ``"matrix": True`` only
    where a ``matrix`` test of the module runs (:func:`matrix_selected`); the tag itself is dropped."""
    with_matrix = matrix_selected(request)
    return [{k: v for k, v in c.items() if k != "matrix"} for c in configs if with_matrix or not c.get("matrix")]


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


def pytest_configure(config) -> None:
    name = config.getoption("--plant-defect")
    if name:
        import tempfile

        from .planted_defects import plant

        plant(name)
        # graphs saved by unplanted runs would be loaded, not traced with the defect: compile into a fresh store
        os.environ["ASCEND_SPEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="ascend-spec-planted-")


TINY = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
                   kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=16,
                   max_position_embeddings=256, eos_token_id=0)


def random_model(cfg: ModelConfig = TINY, seed: int = 0) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.1)
            else:
                p.uniform_(0.8, 1.2)
    return model.eval()


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A random-weight checkpoint in the bundled format (config.json + model.safetensors)."""
    d = tmp_path_factory.mktemp("tiny_ckpt")
    save_model(random_model(), d)
    (d / "config.json").write_text(json.dumps(TINY.to_hf_dict()))
    return d


def _checkpoint(path: Path) -> Path:
    if not (path / "model.safetensors").is_file():
        pytest.fail(f"checkpoint missing in {path}; run tools/train_tiny.py")
    return path


@pytest.fixture(scope="session")
def trained_dir() -> Path:
    """The small trained fixture (2 target layers): confident logits, fast to compile. Most tests use it."""
    return _checkpoint(FIXTURE_MODEL_DIR)


@pytest.fixture(scope="session")
def bundled_dir() -> Path:
    """The bundled model (12 target layers to 1 MTP layer): the demo and benchmark checkpoint."""
    return _checkpoint(BUNDLED_MODEL_DIR)


@pytest.fixture(scope="session")
def moe_ckpts(tmp_path_factory):
    """The tiny MoE + YaRN checkpoints of tools/make_tiny_moe.py, written once per session: name → folder.

    The random presets, plus ``bundled-moe`` (the bundled trained model made MoE + YaRN: drafts get accepted).
    """
    from ascend_spec_tools.tiny_models import PRESETS, moe_from_bundled, write_checkpoint

    root = tmp_path_factory.mktemp("tiny_moe")
    return {**{name: write_checkpoint(root / name, name) for name in PRESETS},
            "bundled-moe": moe_from_bundled(root / "bundled-moe")}


@pytest.fixture(scope="session")
def dsa_ckpts(tmp_path_factory):
    """The DSA family's miniatures (``ascend_spec_tools.tiny_models.DSA_PRESETS``), written once per session:
    ``(preset, "random")`` → random weights (HF parity), ``(preset, "agreeing")`` → drafts get accepted."""
    from ascend_spec_tools.tiny_models import DSA_PRESETS, agreeing_checkpoint, write_checkpoint

    root = tmp_path_factory.mktemp("tiny_dsa")
    made = {}
    for name in DSA_PRESETS:
        made[(name, "random")] = write_checkpoint(root / f"{name}-random", name)
        made[(name, "agreeing")] = agreeing_checkpoint(root / f"{name}-agreeing", name)
    return made


#: the buckets of a compiled engine whose subject is not a lone request's one-row graph (a lone request pads to two)
TWO_ROW_BUCKETS = (2, 4)


def inductor_config(k: int, batch_sizes: tuple[int, ...] = (1, 2, 4)) -> EngineConfig:
    """The compiled engine of test_fused_step, test_graph_mode, test_guards and test_aot_graphs: one model,
    max_model_len and KV pool, so that an engine warmed up as an earlier one was (in either test worker) loads its
    graphs from the compile cache instead of compiling them again."""
    spec = SpeculativeConfig(num_speculative_tokens=k) if k else None
    return EngineConfig(max_model_len=128, max_num_seqs=4, speculative=spec,
                        graph=GraphModeConfig(backend="inductor", graph_batch_sizes=batch_sizes), adaptive_k=False)


def generate_without_recompiles(engine, prompts, max_tokens):
    """Generate under ``fail_on_recompile``, recording the batch size of every step: (stats, batch sizes seen)."""
    from ascend_spec.sampling import SamplingParams

    seen: set[int] = set()
    runner = engine.runner
    run = runner.run

    def tracking(plan, *args):
        if plan.running:
            seen.add(len(plan.running))
        return run(plan, *args)

    runner.run = tracking
    try:
        with torch.compiler.set_stance("fail_on_recompile"):
            _, stats, _ = engine.generate(prompts, SamplingParams(), max_tokens)
    finally:
        del runner.run
    return stats, seen


SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                 "spec_decode_num_accepted_tokens_per_pos")


def assert_moe_counters_close(ours: dict, theirs: dict, what: str) -> None:
    """vLLM's spec-decode counters, ours vs vLLM's drafter, on a MoE checkpoint: equal up to a flipped draft or two.

    On MoE checkpoints the drafts are the same but for rare flips (seen: 1 draft token in 160): both drafters run
    vLLM's own MoE module, but routing's top-k is a hard choice, so a last-bit difference before it (our paged
    MLA is not vLLM's attention kernel) can pick another expert. Output tokens are compared exactly elsewhere.
    Dense checkpoints compare counters exactly.
    """
    a, b = ({c: r["metrics"][c] for c in SPEC_COUNTERS} for r in (ours, theirs))
    print(f"{what}: ours {a}, vLLM's {b}")
    for c in SPEC_COUNTERS[:3]:
        assert abs(a[c] - b[c]) <= max(2, 0.02 * b[c]), (what, c, a, b)


def run_harness(configs: list[dict], checkpoint: Path, tmp: Path, timeout: int = 1500,
                runner: str = "v1", processes: int = 1) -> dict[str, dict]:
    """vLLM engine runs of ``ascend_spec_tools/vllm_harness.py`` on ``checkpoint`` (engine core in-process) on
    vLLM's ``runner`` model runner: name → result. ``processes`` > 1 deals the runs to that many harness processes
    running side by side (:func:`deal_runs`), for runs independent of each other: one harness process keeps about
    one core busy, and this host kind has two. Fails with the log's tail when a harness does."""
    groups = deal_runs(configs, processes)
    procs = [_start_harness(group, checkpoint, tmp / f"harness{i}" if processes > 1 else tmp, runner)
             for i, group in enumerate(groups) if group]
    results: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    try:
        for proc, out, log in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0 and out.is_file(), \
                f"harness failed (rc {proc.returncode}):\n{log.read_text()[-4000:]}"
            results.update({r["name"]: r for r in json.loads(out.read_text())})
    finally:
        for proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


#: the ``llm`` settings that shape our drafter's graphs (its compile cache key); the others (KV pool, batch) do not
GRAPH_LLM_KEYS = ("max_model_len", "tensor_parallel_size", "dtype", "block_size", "attention_backend")


def graph_group(cfg: dict) -> str:
    """Runs of one group build our drafter's graphs under one compile cache key: the first compiles, the rest
    load, if they run in the same process after it (two processes side by side would both compile)."""
    if cfg.get("drafter") != "ours":
        return ""
    llm = {k: v for k, v in cfg.get("llm", {}).items() if k in GRAPH_LLM_KEYS}
    return json.dumps([cfg.get("checkpoint"), cfg.get("k", 2), cfg.get("graph"), cfg.get("spec"), llm],
                      sort_keys=True)


def deal_runs(configs: list[dict], processes: int) -> list[list[dict]]:
    """``configs`` dealt to ``processes`` lists: each graph group whole to one process (it compiles once), the
    heaviest first, each to the least loaded process (a run weighs one, the compile of a group of ours two more);
    each list keeps the order of ``configs``."""
    groups: dict[str, list[int]] = {}
    for i, c in enumerate(configs):
        groups.setdefault(graph_group(c) or f"run {i}", []).append(i)

    def weight(members: list[int]) -> int:
        return len(members) + (2 if configs[members[0]].get("drafter") == "ours" else 0)

    load, dealt = [0] * processes, [[] for _ in range(processes)]
    for members in sorted(groups.values(), key=weight, reverse=True):
        p = min(range(processes), key=lambda j: load[j])
        dealt[p] += members
        load[p] += weight(members)
    return [[configs[i] for i in sorted(d)] for d in dealt]


def _start_harness(configs: list[dict], checkpoint: Path, tmp: Path, runner: str):
    """One harness process on ``configs``, started: (process, its results file, its log)."""
    import subprocess

    from ascend_spec_tools.vllm_harness import runner_env

    tmp.mkdir(parents=True, exist_ok=True)
    cfg, out, log = tmp / "configs.json", tmp / "results.json", tmp / "engine.log"
    cfg.write_text(json.dumps(configs))
    env = runner_env(runner, {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    env.pop("VLLM_PLUGINS", None)
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "ascend_spec_tools.vllm_harness", str(cfg), "--out", str(out),
                                 "--checkpoint", str(checkpoint)], cwd=Path(__file__).resolve().parent.parent,
                                env=env, stdout=f, stderr=subprocess.STDOUT)
    return proc, out, log


TOOLS = Path(__file__).resolve().parents[1] / "tools"


def tool_module(name: str):
    """A script of tools/, imported as a module."""
    sys.path.insert(0, str(TOOLS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(TOOLS))


def amx_cpu() -> bool:
    """Whether vLLM-CPU takes its AMX paths on this host (x86 with AMX tiles, vLLM's own test): the AMX_MLA
    attention backend (bf16 only, block sizes a multiple of 32) unless CPU_MLA is pinned, and W8A8 int8 GEMMs
    that take bf16 / fp16 activations only."""
    import platform

    return platform.machine().lower() in ("x86_64", "amd64") and bool(torch.cpu._is_amx_tile_supported())


def vllm_cpu_dtype() -> str:
    """The activation dtype every vLLM-CPU kernel the tests run takes on this host: bf16 on AMX (its W8A8 int8
    GEMM and AMX_MLA have no float32 path), float32 elsewhere."""
    return "bfloat16" if amx_cpu() else "float32"


#: top-2 logprob gap below which two greedy runs may pick different tokens, per dtype: a few float32 roundings,
#: or two bf16 steps of a logit below 16 (bf16 logits there sit on a grid of 2**-4 or finer, and another batch
#: shape, e.g. a verify instead of a decode, moves one by a step)
TIE_BY_DTYPE = {"float32": 2e-3, "bfloat16": 2 * 2 ** -4}


def npu_available() -> bool:
    """An Ascend NPU with torch_npu and CANN (never installed in CI: importing torch_npu needs CANN)."""
    try:
        import torch_npu  # noqa: F401

        return torch.npu.is_available()
    except Exception:
        return False


def record_draft_calls(model_dir, k, prompts):
    """Run the eager engine step by step (the proposer drafts every step, as inside vLLM) and record each padded
    draft call: its inputs, the draft cache before it, its outputs."""
    eng = load_engine(model_dir, EngineConfig(max_model_len=128, max_num_seqs=4,
                                              speculative=SpeculativeConfig(num_speculative_tokens=k),
                                              graph=GraphModeConfig(enabled=False, backend="eager"),
                                              fused_step=False, adaptive_k=False))
    calls = []
    original = eng.proposer.propose

    def recording(inputs, return_logits=False):
        before = eng.proposer.draft_cache.clone()
        ids, logits = original(inputs, return_logits=True)
        if inputs.target_token_ids.shape[1] == 1 + k:
            calls.append((inputs, before, ids, logits))
        return (ids, logits) if return_logits else ids

    eng.proposer.propose = recording
    eng.generate(prompts, SamplingParams(), [6, 9, 12, 15, 18, 21][: len(prompts)])
    return eng.model, calls


def prefill_inputs(model, lengths: list[int], width: int, seed: int = 0):
    """A prompt-prefill draft batch, ragged ``lengths`` right-padded to ``width`` with inert tokens: each row owns
    blocks of its own; the shapes vLLM's prefill proposes with."""
    from ascend_spec.graph.steps import slots_for
    from ascend_spec.proposer import DraftInputs

    gen = torch.Generator().manual_seed(seed)
    b, blocks = len(lengths), 8
    lens = torch.tensor(lengths)
    valid = torch.arange(width).view(1, -1) < lens.view(-1, 1)
    table = torch.arange(b * blocks).view(b, blocks) + 1
    pos = torch.where(valid, torch.arange(width).expand(b, -1), 0)
    return DraftInputs(
        target_token_ids=torch.where(valid, torch.randint(1, model.cfg.vocab_size, (b, width), generator=gen), 0),
        target_positions=pos,
        target_hidden_states=torch.randn(b, width, model.cfg.hidden_size, generator=gen) * valid.unsqueeze(-1),
        target_slot_mapping=torch.where(valid, slots_for(pos, table, 16), -1),
        next_token_ids=torch.randint(1, model.cfg.vocab_size, (b,), generator=gen),
        token_indices_to_sample=lens - 1, block_table=table, seq_lens=lens)
