"""``ascend-spec generate``: text generation with MTP speculative decoding; ``ascend-spec inspect``: size a model."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path

from .config import (GRAPH_FAILURE_POLICIES, ConfigError, EngineConfig, SpeculativeConfig, GraphModeConfig,
                     load_yaml_config)
from .graph.config import DTYPES
from .model_info import add_inspect_parser
from .models import BUNDLED_MODEL_DIR, NAMED_MODELS
from .sampling import SamplingParams

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: an int >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {value}; allowed: an int >= 1")
    return value


DEFAULT_PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self"]


def _model_dir(value: str) -> Path:
    """A bundled model's name (``NAMED_MODELS``), else a folder."""
    return NAMED_MODELS.get(value, Path(value))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ascend-spec", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    # parsed by ascend_spec_tools.upgrade.cli (the installed command dispatches it); listed here for --help
    sub.add_parser("upgrade-check", add_help=False,
                   help="before a vLLM bump: API drift, and with --run-tests the parity suite and acceptance gate")
    g = sub.add_parser("generate", help="generate text (speculative decoding on by default)")
    g.add_argument("--model", type=_model_dir, default=BUNDLED_MODEL_DIR,
                   help=f"checkpoint folder, or one of {sorted(NAMED_MODELS)} (default: bundled, DeepSeek-V3's "
                        "shape; bundled-dsa: GLM-5's, DeepSeek Sparse Attention)")
    g.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    g.add_argument("--prompts-file", type=Path, help="a file with one prompt per line")
    g.add_argument("--max-tokens", type=_positive_int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--logprobs", type=int, default=None, metavar="N",
                   help="top-N logprobs of each generated token (vLLM's meaning; shown with --json)")
    g.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="run dtype (default: the checkpoint's torch_dtype; fp8 checkpoints are dequantised to it)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--kv-blocks", type=int, default=None, metavar="N",
                   help="KV cache pool in blocks of --block-size tokens (default: max_num_seqs full-length sequences); "
                        "blocks are taken as sequences grow, the newest request is preempted when they run out")
    g.add_argument("--block-size", type=int, default=None, metavar="N",
                   help="tokens per KV block, a multiple of 16 (default 16; FlashMLA uses 64, vllm-ascend's MLA 128)")
    g.add_argument("--kv-layout", choices=["single", "pair", "fused"], default=None,
                   help="KV cache layout: one 576-wide latent (single, vLLM's; 'fused' is its former name) or nope and "
                        "rope tensors apart (pair, vllm-ascend's); default single")
    g.add_argument("--config", type=Path, help="YAML with speculative_config and additional_config.torchair_graph_config")
    g.add_argument("--num-speculative-tokens", type=int, default=None)
    g.add_argument("--no-spec", action="store_true", help="decode without speculation")
    g.add_argument("--disable-padded-drafter-batch", action="store_true", default=None)
    g.add_argument("--backend", choices=["auto", "eager", "inductor", "torchair", "torchair-rehearsal"],
                   default=None)
    g.add_argument("--graph-batch-sizes", type=str, default=None, help="comma-separated bucket sizes, e.g. 1,2,4,8")
    k = g.add_mutually_exclusive_group()
    k.add_argument("--adaptive-k", dest="fixed_k", action="store_false",
                   help="(the default, but with --step-by-step) choose K in 0..num_speculative_tokens per batch "
                        "bucket from step costs measured at warm-up and the running acceptance; K = 0 where drafts "
                        "are expected not to pay")
    k.add_argument("--fixed-k", action="store_true",
                   help="draft num_speculative_tokens every step (compiles one graph instead of K + 1)")
    g.set_defaults(fixed_k=None)  # None: adaptive K, fixed with --step-by-step
    g.add_argument("--compile-all", action="store_true",
                   help="compile every graph the run may replay before the first token (every K adaptive K may "
                        "pick, the lone-request graphs); default: what the first steps run, the rest when needed")
    g.add_argument("--step-by-step", action="store_true",
                   help="run target, sampling and drafting as separate calls instead of one fused graph per step; "
                        "drafts num_speculative_tokens every step (fixed K)")
    g.add_argument("--graph-failure", choices=list(GRAPH_FAILURE_POLICIES), default=None,
                   help="a compiled graph that fails or needs the host (a device sync inside it): 'eager' reruns the "
                        "step eagerly and counts it (default, or $ASCEND_SPEC_GRAPH_FAILURE), 'raise' stops")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    g.add_argument("--output", type=Path, default=None,
                   help="write the result to this file (replaced only once generation succeeded) instead of stdout")
    g.add_argument("-v", "--verbose", action="store_true")
    g.set_defaults(func=cmd_generate)
    add_inspect_parser(sub)
    c = sub.add_parser("cache", help="the on-disk cache of compiled graphs and adaptive K's learnings "
                                     "($ASCEND_SPEC_CACHE_DIR, default ~/.cache/ascend-spec)")
    actions = c.add_subparsers(dest="action", required=True)
    info = actions.add_parser("info", help="the cache folder, its entries (label, size, age) and total size")
    info.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    clear = actions.add_parser("clear", help="remove every cached compiled graph and adaptive K's learnings (the "
                                             "next run compiles and learns again)")
    clear.add_argument("--learnings", action="store_true",
                       help="remove only adaptive K's learnings (acceptance and step costs kept from earlier runs)")
    c.set_defaults(func=cmd_cache)
    return ap


def engine_config_from_args(args: argparse.Namespace, num_prompts: int | None = None) -> EngineConfig:
    data = load_yaml_config(args.config) if args.config else {}
    spec = dict(data.get("speculative_config") or {"method": "deepseek_mtp"})
    graph = dict((data.get("additional_config") or {}).get("torchair_graph_config") or {})
    if args.num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = args.num_speculative_tokens
    if args.disable_padded_drafter_batch:
        spec["disable_padded_drafter_batch"] = True
    if args.backend is not None:
        graph["backend"] = args.backend
        if args.backend == "eager" and graph.get("enabled") is None:
            graph["enabled"] = False
    if args.graph_batch_sizes:
        try:
            graph["graph_batch_sizes"] = [int(x) for x in args.graph_batch_sizes.split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"--graph-batch-sizes={args.graph_batch_sizes!r}; allowed: comma-separated ints")
    kwargs = {}
    for key in ("max_model_len", "max_num_seqs", "kv_blocks", "block_size", "kv_layout"):
        value = getattr(args, key) if getattr(args, key) is not None else data.get(key)
        if value is not None:
            kwargs[key] = value
    if "max_num_seqs" not in kwargs and num_prompts:
        # No more graph buckets than the batch can use: warm-up compiles each one.
        kwargs["max_num_seqs"] = min(16, num_prompts)
    return EngineConfig(speculative=None if args.no_spec else SpeculativeConfig.from_dict(spec),
                        graph=GraphModeConfig.from_dict(graph), fused_step=not args.step_by_step,
                        adaptive_k=not (args.step_by_step if args.fixed_k is None else args.fixed_k),
                        warm_graphs="all" if args.compile_all else "first",
                        graph_failure=args.graph_failure, **kwargs)


def read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        if not args.prompts_file.is_file():
            raise ConfigError(f"--prompts-file {args.prompts_file}: no such file; allowed: a text file, one prompt "
                              "per line")
        lines = [line.rstrip("\n").replace("\\n", "\n") for line in args.prompts_file.read_text().splitlines()
                 if line.strip()]
        if not lines:
            raise ConfigError(f"--prompts-file {args.prompts_file} holds no prompt; allowed: one prompt per line")
        prompts += lines
    return prompts or list(DEFAULT_PROMPTS)


def check_output_path(path: Path | None) -> None:
    if path is not None and (path.is_dir() or not path.parent.is_dir()):
        raise ConfigError(f"--output {path}: allowed: a file path in an existing folder")


def write_result(text: str, path: Path | None) -> None:
    """stdout, or ``path`` replaced atomically: a failed run never leaves it truncated."""
    if path is None:
        print(text)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import load_engine
    from .tokenizer import TextTokenizer

    check_output_path(args.output)
    if not args.model.is_dir():
        raise ConfigError(f"--model {args.model}: no such folder; allowed: a checkpoint folder (config.json, "
                          "tokenizer.json, *.safetensors)")
    prompts = read_prompts(args)
    cfg = engine_config_from_args(args, len(prompts))
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, logprobs=args.logprobs)
    tok = TextTokenizer(args.model)
    # Counting host syncs costs a Python hook per eager op; --json reports the measured figure.
    engine = load_engine(args.model, cfg, count_host_syncs=args.json, dtype=args.dtype)
    # A bar on stderr while graphs compile; --json keeps stdout clean either way.
    outputs, stats, metrics = engine.generate([tok.encode(p) for p in prompts], params, args.max_tokens,
                                              seed=args.seed, progress=sys.stderr.isatty() or not args.json)
    tokens_per_s = stats.generated_tokens / stats.decode_seconds if stats.decode_seconds else 0.0
    spec_name = f"{cfg.speculative.method} K={cfg.speculative.num_speculative_tokens}" if cfg.speculative else "off"
    if args.json:
        result = {
            "outputs": [{"prompt": p, "token_ids": o.token_ids, "text": tok.decode(o.token_ids),
                         "finish_reason": o.finish_reason,
                         **({"logprobs": o.logprobs} if o.logprobs is not None else {})}
                        for p, o in zip(prompts, outputs)],
            "dtype": str(engine.dtype).removeprefix("torch."),
            "backend": engine.backend_name,
            "speculative": spec_name,
            "tokens_per_s": round(tokens_per_s, 2),
            "generated_tokens": stats.generated_tokens,
            "num_steps": stats.num_steps,
            "host_syncs_per_step": stats.host_syncs_per_step,
            # device -> host reads of each decode step (the fused path's one: its tokens)
            "host_transfers_per_step": stats.host_transfers_per_step,
            # compiled graphs that failed (each step reran eagerly) and ops needing the host found in graphs
            "graph_failures": stats.graph_failures,
            "graph_host_ops": stats.graph_host_ops,
            "recompiles_after_warmup": stats.recompiles_after_warmup,
            "deferred_compiles": stats.deferred_compiles,
            "deferred_compile_seconds": round(stats.deferred_compile_seconds, 2),
            "first_token_seconds": round(stats.first_token_seconds, 3),
            "graphs_compiled": stats.graphs_compiled,
            "compile_seconds": round(stats.compile_seconds, 2),
            # measured on fused steps only (the step-by-step path interleaves host work with its graph calls)
            "host_us_per_step": (round(1e6 * stats.host_seconds / sum(stats.steps_per_k.values()), 1)
                                 if stats.steps_per_k else None),
            "steps_per_k": stats.steps_per_k,
            "k_by_bucket": stats.k_by_bucket,
            "k_switches": stats.k_switches,
            "switch_seconds": round(stats.switch_seconds, 4),
            # the step-time account: where decode_seconds went
            "decode_seconds": round(stats.decode_seconds, 4),
            "graph_seconds": round(stats.graph_seconds, 4),
            "host_seconds": round(stats.host_seconds, 4),
            "prefill_seconds": round(stats.prefill_seconds, 4),
            **(metrics.as_dict() if metrics else {"acceptance_rate": None, "mean_accepted_length": None,
                                                 "acceptance_per_position": []}),
        }
        write_result(json.dumps(result, indent=2), args.output)
        return 0
    parts = [f"--- prompt: {p!r}\n{p}{tok.decode(o.token_ids)}\n" for p, o in zip(prompts, outputs)]
    line = (f"backend={engine.backend_name} spec={spec_name} | {len(prompts)} prompts, {stats.generated_tokens} "
            f"tokens in {stats.decode_seconds:.2f}s ({tokens_per_s:.1f} tok/s, first token after "
            f"{stats.first_token_seconds:.2f}s)")
    if metrics:
        line += (f" | acceptance {metrics.acceptance_rate:.2f}, mean accepted length "
                 f"{metrics.mean_accepted_length:.2f}")
    line += f" | graph failures {stats.graph_failures}, host ops in graphs {stats.graph_host_ops}"
    write_result("\n".join(parts + [line]), args.output)
    return 0


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _k_values(ks: list[int]) -> str:
    if len(ks) > 1 and ks == list(range(ks[0], ks[-1] + 1)):
        return f"{ks[0]}-{ks[-1]}"
    return ", ".join(map(str, ks)) or "none"


def _learnings_info(entry) -> dict:  # noqa: ANN001 - compile_cache.EntryInfo
    """What a learnings entry holds, for ``cache info``: buckets, K values, drafts recorded, acceptance."""
    from .graph.backends.cache_entry import BadEntry
    from .learnings import Learnings

    info = {"digest": entry.digest, "what": entry.what, "path": str(entry.path), "size_bytes": entry.size,
            "age_seconds": round(entry.age_seconds), "problem": entry.problem}
    if entry.problem:
        return info
    try:
        learned = Learnings.from_entry_file(entry.path)
    except (BadEntry, ValueError, OSError) as exc:
        return {**info, "problem": f"unreadable ({exc})"}
    buckets = sorted(learned.step_seconds.keys() | learned.steps.keys())
    ks = sorted({k for costs in learned.step_seconds.values() for k in costs})
    rates = [round(a / o, 3) if o else None for a, o in zip(learned.accepted, learned.offered)]
    return {**info, "k_max": learned.k_max, "buckets": buckets, "k_values": ks, "drafts": learned.drafts,
            "acceptance": rates}


def cmd_cache(args: argparse.Namespace) -> int:
    # CacheDirError (a folder others can write) is a ValueError: main prints it and exits 2.
    from .graph.backends.compile_cache import CompileCache, folder_size
    from .learnings import Learnings

    cache = CompileCache()
    entries = cache.entries()
    learned = [e for e in entries if (e.what or "").startswith(Learnings.LABEL_PREFIX)]
    inductor_bytes = folder_size(cache.inductor_dir) if cache.inductor_dir.is_dir() else 0
    if args.action == "clear" and args.learnings:
        freed = 0
        for e in learned:
            with contextlib.suppress(FileNotFoundError):
                e.path.unlink()
                freed += e.size
                print(f"removed {e.path} ({e.what}, {_size(e.size)})")
        print(f"freed {_size(freed)} in {cache.root} (learnings only)")
        return 0
    if args.action == "clear":
        freed = cache.clear()
        for e in entries:
            print(f"removed {e.path} ({e.what or 'unreadable'}, {_size(e.size)})")
        if inductor_bytes:
            print(f"removed {cache.inductor_dir} (inductor working cache, {_size(inductor_bytes)})")
        print(f"freed {_size(freed)} in {cache.root}")
        return 0
    total = sum(e.size for e in entries) + inductor_bytes
    if args.json:
        print(json.dumps({
            "root": str(cache.root),
            "entries": [{"digest": e.digest, "what": e.what, "size_bytes": e.size, "age_seconds": round(e.age_seconds),
                         "torch_version": e.torch_version, "variants": e.variants, "path": str(e.path),
                         "problem": e.problem}
                        for e in entries],
            "learnings": [_learnings_info(e) for e in learned],
            "inductor_dir": str(cache.inductor_dir), "inductor_bytes": inductor_bytes, "total_bytes": total,
        }, indent=2))
        return 0
    print(f"compile cache: {cache.root}")
    for e in entries:
        if e in learned:
            continue
        note = f"  ({e.problem}: removed at the next load)" if e.problem else ""
        kind = f"{e.variants} variant(s)" if e.variants is not None else "artifacts"
        print(f"  {e.digest}  {e.what or '?':<32} {kind:>12} {_size(e.size):>10}  {_age(e.age_seconds):>8}  "
              f"torch {e.torch_version or '?'}{note}")
    if inductor_bytes:
        print(f"  inductor working cache {cache.inductor_dir}: {_size(inductor_bytes)}")
    if learned:
        print("learnings (adaptive K):")
    for info in map(_learnings_info, learned):
        if info["problem"]:
            what = f"({info['problem']}: removed at the next load)"
        else:
            rates = ", ".join("-" if r is None else f"{r:.2f}" for r in info["acceptance"])
            what = (f"K_max {info['k_max']}, buckets {', '.join(map(str, info['buckets'])) or 'none'}, "
                    f"K {_k_values(info['k_values'])}, {info['drafts']} drafts (acceptance {rates})")
        print(f"  {info['digest']}  {info['what'] or '?':<20} {what} {_size(info['size_bytes']):>10}  "
              f"{_age(info['age_seconds']):>8}")
    print(f"total: {len(entries)} entries, {_size(total)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["upgrade-check"]:  # a tool, not the runtime: the installed command dispatches it
        print("error: upgrade-check is ascend_spec_tools' command: run `python -m ascend_spec_tools.cli "
              "upgrade-check`, or reinstall (`pip install -e .`) where `ascend-spec` still points here",
              file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
