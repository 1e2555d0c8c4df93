#!/usr/bin/env python3
"""Train the bundled tiny DeepSeek-V3-architecture model with one MTP layer, deterministically, on CPU.

Depth ratio as DeepSeek-V3's (61 target layers to 1 MTP layer): 12 target layers to 1, so that one draft
step costs a small fraction of a target step, as it does in a real deployment.

Corpus: the Python standard library's own source files (present on every machine with Python).
Tokenizer: byte-level BPE (``tokenizers``). Objective: next-token cross-entropy plus DeepSeek-V3's MTP
loss (depth 1: predict token t+2 from the target's hidden state at t and the embedding of token t+1),
weighted by ``--mtp-weight``. Then the MTP layer is **self-distilled** against the frozen target
(KL to the target's own distribution for token t+2): greedy acceptance is agreement with the target, not
with the corpus. As in DeepSeek-V3 the MTP module shares the embedding and output head
with the main model; the checkpoint stores them under both names, as HF DeepSeek-V3 does.

    python tools/train_tiny.py --out ascend_spec/models/tiny-dsv3-12l-mtp
    python tools/train_tiny.py --out DIR --distill-only    # re-run only the distillation on DIR's weights
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from ascend_spec.graph.config import ModelConfig
from ascend_spec.graph.model import DeepseekV3ForCausalLM
from ascend_spec.graph.weights import load_model, save_model

EOS = "<|endoftext|>"
#: forward passes under bf16 autocast (the DSA miniature's script turns it off: on CPUs without native bf16, bf16
#: backward matmuls run ~10x slower than fp32)
AUTOCAST_BF16 = True


@dataclass(frozen=True)
class TrainConfig:
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 12
    num_attention_heads: int = 4
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 700
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    seed: int = 0
    heldout_every: int = 40  # every 40th file (sorted by path) is held out
    distill_steps: int = 200
    distill_lr: float = 1e-3


def corpus_files() -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__")
    files = [p for p in sorted(stdlib.rglob("*.py")) if not any(part in skip for part in p.relative_to(stdlib).parts)]
    return files


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for p in files:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def batches(stream: np.ndarray, cfg: TrainConfig, rng: np.random.Generator) -> torch.Tensor:
    starts = rng.integers(0, len(stream) - cfg.seq_len - 2, size=cfg.batch_size)
    return torch.from_numpy(np.stack([stream[s: s + cfg.seq_len + 1] for s in starts]))


def losses(model: DeepseekV3ForCausalLM, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Main loss (t+1), MTP loss (t+2), and their logits."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST_BF16):
        hidden = model.target_dense(x[:, :-1])
        logits = model.logits(hidden)
        # MTP at position t: hidden h_t and embedding of token t+1 → token t+2.
        mtp_hidden = model.mtp_dense(x[:, 1:-1], hidden[:, :-1])
        mtp_logits = model.mtp_logits(mtp_hidden)
    main = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
    mtp = F.cross_entropy(mtp_logits.float().flatten(0, 1), x[:, 2:].flatten())
    return main, mtp, logits, mtp_logits


def distill_loss(model: DeepseekV3ForCausalLM, x: torch.Tensor) -> torch.Tensor:
    """KL(target ‖ MTP) for token t+2: the teacher is the frozen target's own distribution at t+1."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST_BF16):
        hidden = model.target_dense(x[:, :-1])
        teacher = model.logits(hidden[:, 1:]).float()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST_BF16):
        student = model.mtp_logits(model.mtp_dense(x[:, 1:-1], hidden[:, :-1]))
    return F.kl_div(F.log_softmax(student.float(), -1).flatten(0, 1), F.log_softmax(teacher, -1).flatten(0, 1),
                    log_target=True, reduction="batchmean")


@torch.no_grad()
def evaluate(model: DeepseekV3ForCausalLM, stream: np.ndarray, cfg: TrainConfig, n_batches: int = 8) -> dict:
    """Held-out losses and accuracies; ``mtp_agree`` is the MTP argmax agreeing with the target's argmax for
    token t+2 (given the true t+1): the greedy acceptance of the first draft position, teacher-forced."""
    model.eval()
    rng = np.random.default_rng(1234)
    tot = {"loss": 0.0, "mtp_loss": 0.0, "acc": 0.0, "mtp_acc": 0.0, "mtp_agree": 0.0}
    for _ in range(n_batches):
        x = batches(stream, cfg, rng)
        main, mtp, logits, mtp_logits = losses(model, x)
        tot["loss"] += main.item()
        tot["mtp_loss"] += mtp.item()
        tot["acc"] += (logits.argmax(-1) == x[:, 1:]).float().mean().item()
        tot["mtp_acc"] += (mtp_logits.argmax(-1) == x[:, 2:]).float().mean().item()
        tot["mtp_agree"] += (mtp_logits.argmax(-1) == logits[:, 1:].argmax(-1)).float().mean().item()
    model.train()
    return {k: v / n_batches for k, v in tot.items()}


def lr_schedule(peak: float, warmup: int, steps: int):
    def lr_at(step: int) -> float:
        if step < warmup:
            return peak * (step + 1) / warmup
        frac = (step - warmup) / max(1, steps - warmup)
        return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
    return lr_at


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    decay = [p for p in params if p.dim() == 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))


def pretrain(model: DeepseekV3ForCausalLM, stream: np.ndarray, cfg: TrainConfig) -> dict:
    params = list({id(p): p for p in model.parameters()}.values())
    opt = adamw(params, cfg.lr, cfg.weight_decay)
    lr_at = lr_schedule(cfg.lr, cfg.warmup, cfg.steps)
    rng = np.random.default_rng(cfg.seed)
    model.train()
    bar = tqdm(range(cfg.steps), desc="train", mininterval=30)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        main_loss, mtp_loss, _, _ = losses(model, batches(stream, cfg, rng))
        loss = main_loss + cfg.mtp_weight * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 20 == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{main_loss.item():.3f}", mtp=f"{mtp_loss.item():.3f}")
    return {"loss": main_loss.item(), "mtp_loss": mtp_loss.item()}


def distill(model: DeepseekV3ForCausalLM, stream: np.ndarray, cfg: TrainConfig) -> dict:
    """Train only the MTP layer's own weights (the shared embedding and head stay frozen with the target)."""
    mtp_ids = {id(p) for p in model.mtp_layer(0).parameters()} - {id(model.model.embed_tokens.weight),
                                                                   id(model.lm_head.weight)}
    for p in model.parameters():
        p.requires_grad_(id(p) in mtp_ids)
    params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    opt = adamw(params, cfg.distill_lr, cfg.weight_decay)
    lr_at = lr_schedule(cfg.distill_lr, cfg.warmup // 2, cfg.distill_steps)
    rng = np.random.default_rng(cfg.seed + 1)
    model.train()
    bar = tqdm(range(cfg.distill_steps), desc="distill", mininterval=30)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss = distill_loss(model, batches(stream, cfg, rng))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 20 == 0 or step == cfg.distill_steps - 1:
            bar.set_postfix(kl=f"{loss.item():.4f}")
    for p in model.parameters():
        p.requires_grad_(True)
    return {"kl": loss.item()}


def grow(small: DeepseekV3ForCausalLM, mcfg: ModelConfig, placement: tuple[int, ...]) -> DeepseekV3ForCausalLM:
    """Function-preserving depth growth: ``small``'s decoder layer j lands at index ``placement[j]`` of a deeper
    model; every new layer starts with zero output projections (``o_proj``, ``down_proj``), so it adds nothing to
    the residual stream and the grown model computes exactly what ``small`` did, at the deeper model's cost.
    Joint training then puts the new layers to work. The embedding, final norm, head and MTP layer carry over."""
    n_small = small.cfg.num_hidden_layers
    if len(placement) != n_small or len(set(placement)) != n_small or max(placement) >= mcfg.num_hidden_layers:
        raise ValueError(f"placement={placement}: need {n_small} distinct indices below {mcfg.num_hidden_layers}")
    model = DeepseekV3ForCausalLM(mcfg)
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    state = model.state_dict()
    new_layers = set(range(mcfg.num_hidden_layers)) - set(placement)
    for i in new_layers:
        state[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
        state[f"model.layers.{i}.mlp.down_proj.weight"].zero_()
    moved = {str(j): str(i) for j, i in enumerate(placement)}
    moved[str(n_small)] = str(mcfg.num_hidden_layers)  # the MTP layer follows the target layers
    for key, value in small.state_dict().items():
        parts = key.split(".")
        if parts[:2] == ["model", "layers"]:
            parts[2] = moved[parts[2]]
        state[".".join(parts)].copy_(value)
    return model


def save_checkpoint(model: DeepseekV3ForCausalLM, mcfg: ModelConfig, tok: Tokenizer, out: Path, summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, out)
    (out / "config.json").write_text(json.dumps(mcfg.to_hf_dict(), indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS, "pad_token": EOS,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": mcfg.max_position_embeddings}, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": mcfg.eos_token_id, "bos_token_id": mcfg.bos_token_id}, indent=2) + "\n")
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--layers", type=int, default=TrainConfig.num_hidden_layers, help="target decoder layers")
    ap.add_argument("--seq-len", type=int, default=TrainConfig.seq_len)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr, help="peak learning rate of the joint training")
    ap.add_argument("--distill-steps", type=int, default=TrainConfig.distill_steps)
    ap.add_argument("--grow-from", type=Path, default=None,
                    help="start from this shallower trained checkpoint (its tokenizer too), grown to the configured "
                         "depth without changing its function (see grow())")
    ap.add_argument("--distill-only", action="store_true",
                    help="load --out's checkpoint and run only the MTP self-distillation")
    ap.add_argument("--threads", type=int, default=2, help="fixed thread count keeps runs bitwise repeatable")
    args = ap.parse_args()
    cfg = TrainConfig(steps=args.steps, distill_steps=args.distill_steps, lr=args.lr, num_hidden_layers=args.layers,
                      seq_len=args.seq_len)
    torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.seed)
    t0 = time.time()

    files = corpus_files()
    train_files = [f for i, f in enumerate(files) if i % cfg.heldout_every != 0]
    heldout_files = [f for i, f in enumerate(files) if i % cfg.heldout_every == 0]
    train_texts, heldout_texts = read_texts(train_files), read_texts(heldout_files)
    if args.distill_only or args.grow_from:
        tok = Tokenizer.from_file(str((args.grow_from or args.out) / "tokenizer.json"))
    else:
        tok = train_tokenizer(train_texts, cfg.vocab_size)
    train_stream, heldout_stream = encode_stream(tok, train_texts), encode_stream(tok, heldout_texts)
    print(f"corpus: {len(train_files)} train files ({len(train_stream):,} tokens), "
          f"{len(heldout_files)} held-out files ({len(heldout_stream):,} tokens); tokenizer {time.time() - t0:.0f}s")

    summary = {"train_config": asdict(cfg), "python": platform.python_version(), "torch": torch.__version__,
               "train_files": len(train_files), "heldout_files": len(heldout_files),
               "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(heldout_stream))}
    if args.distill_only:
        model = load_model(args.out)
        mcfg = model.cfg
        summary.update({k: v for k, v in json.loads((args.out / "training_summary.json").read_text()).items()
                        if k in ("final_train", "heldout", "minutes")})
    else:
        mcfg = ModelConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                           intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                           num_attention_heads=cfg.num_attention_heads, kv_lora_rank=512, qk_nope_head_dim=32,
                           qk_rope_head_dim=64, v_head_dim=32, max_position_embeddings=1024,
                           eos_token_id=tok.token_to_id(EOS), bos_token_id=tok.token_to_id(EOS))
        if args.grow_from:
            small = load_model(args.grow_from)
            # first trained layer first, last trained layer last, new layers between them
            n = small.cfg.num_hidden_layers
            placement = tuple(range(n - 1)) + (cfg.num_hidden_layers - 1,)
            model = grow(small, mcfg, placement)
            summary["grown_from"] = {"dir": args.grow_from.name, "layers": n, "placement": list(placement),
                                     "heldout": evaluate(small, heldout_stream, cfg)}
            del small
        else:
            model = DeepseekV3ForCausalLM(mcfg)
            for p in model.parameters():
                if p.dim() == 2:
                    torch.nn.init.normal_(p, std=0.02)
        summary["final_train"] = pretrain(model, train_stream, cfg)
        summary["heldout"] = evaluate(model, heldout_stream, cfg)
        summary["minutes"] = round((time.time() - t0) / 60, 1)
        h = summary["heldout"]
        print(f"pretrained: held-out loss {h['loss']:.3f}, acc {h['acc']:.3f}, MTP(t+2) acc {h['mtp_acc']:.3f}, "
              f"MTP agrees with target {h['mtp_agree']:.3f}; {summary['minutes']} min")
        save_checkpoint(model, mcfg, tok, args.out, summary)  # a usable checkpoint even if distillation is cut short

    if cfg.distill_steps == 0:
        return
    t1 = time.time()
    summary["distill"] = distill(model, train_stream, cfg)
    summary["heldout_distilled"] = evaluate(model, heldout_stream, cfg)
    summary["distill_minutes"] = round((time.time() - t1) / 60, 1)
    h = summary["heldout_distilled"]
    print(f"distilled: MTP(t+2) acc {h['mtp_acc']:.3f}, MTP agrees with target {h['mtp_agree']:.3f} "
          f"(before {summary['heldout']['mtp_agree']:.3f}); {summary['distill_minutes']} min")
    save_checkpoint(model, mcfg, tok, args.out, summary)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
