#!/usr/bin/env python3
"""Per-position acceptance of the draft chain under each KV-length mode of the NPU attention op, on CPU.

The NPU path runs through the op's CPU stand-in (``tests/npu_standin.py``: the formula of torch_npu's
documentation, honouring whatever lengths it is given) inside torchair's pre-GE graph steps
(``graph/backends/ge_audit.py``), as ``tests/test_draft_kv_lengths.py`` runs it:

- ``upper_bound``: steps 2..K get the host's bound (the verify's length plus the step), so a draft token also
  attends the stale keys of rejected positions (npugraph_ex mode's lengths);
- ``exact``: steps 2..K get the device's ``seq_lens`` tensor (GE mode's default);
- ``reference``: the reference kernel (``gather_mla``), eagerly; and no speculation, for the greedy tokens.

Greedy, K = 3, block 128, nope/rope pair, fp32. Needs the torch_npu 2.14.0 wheel (downloaded once, never
installed, as the contract tests do) and the test dependencies; run from the checkout's root:

    python tools/bench_draft_lengths.py [--models bundled moe] [--max-tokens 64] [--prompts N]
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("upper_bound", "exact", "reference")


def _stand_ins():
    """The ``torch_npu`` stand-in (the wheel's schemas, torchair's ``air`` op) and a torchair whose NPU backend is
    its own front half."""
    import yaml

    from tests import npu_standin
    from tests.test_torchair_contract import NPU_OP_DECLARATIONS, _download_wheel

    with zipfile.ZipFile(_download_wheel()) as zf:
        decl = yaml.safe_load(zf.read(NPU_OP_DECLARATIONS))
        air = npu_standin.air_schemas(zf.read(npu_standin.AIR_ATTENTION_SOURCE).decode())
    schemas = {}
    for section in decl.values():
        for entry in section if isinstance(section, list) else ():
            if isinstance(entry, dict) and "func" in entry:
                schemas.setdefault(entry["func"].split("(", 1)[0], entry["func"])
    return npu_standin.register(schemas, air)


def _models(names: list[str], tmp: Path) -> dict[str, Path]:
    from ascend_spec.models import BUNDLED_MODEL_DIR
    from ascend_spec_tools.tiny_models import moe_from_bundled

    found = {}
    for name in names:
        if name == "bundled":
            found["bundled (tiny-dsv3-mtp, 12 layers)"] = BUNDLED_MODEL_DIR
        elif name == "moe":
            found["MoE (bundled-moe, 2 layers + MoE MTP)"] = moe_from_bundled(tmp / "bundled-moe")
        else:
            raise SystemExit(f"error: --models {name!r}; allowed: bundled, moe")
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["bundled", "moe"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=8, help="prompts from tools/bench_prompts.txt")
    args = p.parse_args(argv)

    import torch

    from ascend_spec.engine import load_engine
    from ascend_spec.graph.backends import torchair as torchair_backend
    from ascend_spec.sampling import SamplingParams
    from ascend_spec.tokenizer import TextTokenizer
    from tests.test_draft_kv_lengths import _config, _stand_in_torchair, run_lengths

    sys.modules["torch_npu"] = _stand_ins()
    torchair_backend._import_torchair = _stand_in_torchair
    texts = [t.replace("\\n", "\n") for t in (ROOT / "tools" / "bench_prompts.txt").read_text().splitlines()
             if t.strip()][:args.prompts]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in _models(args.models, Path(tmp)).items():
            tok = TextTokenizer(path)
            nospec_cfg = dataclasses.replace(_config("eager"), speculative=None)
            nospec = [o.token_ids for o in load_engine(path, nospec_cfg).generate(
                [tok.encode(t) for t in texts], SamplingParams(), args.max_tokens)[0]]
            for mode in MODES:
                torch._dynamo.reset()
                tokens, m, stats = run_lengths(path, {"exact": "auto"}.get(mode, mode), texts, args.max_tokens)
                rows.append((label, mode, m, tokens == nospec, stats.host_syncs))
    print(f"greedy, K = 3, {len(texts)} prompts × {args.max_tokens} tokens, max_num_seqs 4, block 128, pair, fp32")
    print("| model | draft KV lengths | accepted / drafted | pos 1 | pos 2 | pos 3 | mean accepted length "
          "| tokens = no-spec | host syncs |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, mode, m, same, syncs in rows:
        pos = " | ".join(f"{a}/{d} ({a / d:.3f})" if d else "-"
                         for a, d in zip(m.accepted_per_position, m.drafted_per_position))
        print(f"| {label} | {mode} | {m.num_accepted_tokens}/{m.num_draft_tokens} | {pos} | "
              f"{m.mean_accepted_length:.3f} | {'yes' if same else 'NO'} | {syncs if mode != 'reference' else '-'} |")
    return 0 if all(same for *_, same, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
