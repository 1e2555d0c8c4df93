#!/usr/bin/env python3
"""Train the bundled tiny DeepSeek-V3-architecture model with one MTP layer, deterministically, on CPU.

Corpus: the Python standard library's own source files (present on every machine with Python).
Tokenizer: byte-level BPE (``tokenizers``). Objective: next-token cross-entropy plus DeepSeek-V3's MTP
loss (depth 1: predict token t+2 from the target's hidden state at t and the embedding of token t+1),
weighted by ``--mtp-weight``. As in DeepSeek-V3 the MTP module shares the embedding and output head
with the main model; the checkpoint stores them under both names, as HF DeepSeek-V3 does.

    python tools/train_tiny.py --out ascend_spec/models/tiny-dsv3-mtp
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
from ascend_spec.graph.weights import save_model

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class TrainConfig:
    vocab_size: int = 2048
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 1000
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    seed: int = 0
    heldout_every: int = 40  # every 40th file (sorted by path) is held out


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
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.target_dense(x[:, :-1])
        logits = model.logits(hidden)
        # MTP at position t: hidden h_t and embedding of token t+1 → token t+2.
        mtp_hidden = model.mtp_dense(x[:, 1:-1], hidden[:, :-1])
        mtp_logits = model.mtp_logits(mtp_hidden)
    main = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
    mtp = F.cross_entropy(mtp_logits.float().flatten(0, 1), x[:, 2:].flatten())
    return main, mtp, logits, mtp_logits


@torch.no_grad()
def evaluate(model: DeepseekV3ForCausalLM, stream: np.ndarray, cfg: TrainConfig, n_batches: int = 8) -> dict:
    model.eval()
    rng = np.random.default_rng(1234)
    tot = {"loss": 0.0, "mtp_loss": 0.0, "acc": 0.0, "mtp_acc": 0.0}
    for _ in range(n_batches):
        x = batches(stream, cfg, rng)
        main, mtp, logits, mtp_logits = losses(model, x)
        tot["loss"] += main.item()
        tot["mtp_loss"] += mtp.item()
        tot["acc"] += (logits.argmax(-1) == x[:, 1:]).float().mean().item()
        tot["mtp_acc"] += (mtp_logits.argmax(-1) == x[:, 2:]).float().mean().item()
    model.train()
    return {k: v / n_batches for k, v in tot.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--threads", type=int, default=2, help="fixed thread count keeps runs bitwise repeatable")
    args = ap.parse_args()
    cfg = TrainConfig(steps=args.steps)
    torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.seed)
    t0 = time.time()

    files = corpus_files()
    train_files = [f for i, f in enumerate(files) if i % cfg.heldout_every != 0]
    heldout_files = [f for i, f in enumerate(files) if i % cfg.heldout_every == 0]
    train_texts, heldout_texts = read_texts(train_files), read_texts(heldout_files)
    tok = train_tokenizer(train_texts, cfg.vocab_size)
    train_stream, heldout_stream = encode_stream(tok, train_texts), encode_stream(tok, heldout_texts)
    print(f"corpus: {len(train_files)} train files ({len(train_stream):,} tokens), "
          f"{len(heldout_files)} held-out files ({len(heldout_stream):,} tokens); tokenizer {time.time() - t0:.0f}s")

    mcfg = ModelConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
                       num_attention_heads=cfg.num_attention_heads, kv_lora_rank=512, qk_nope_head_dim=32,
                       qk_rope_head_dim=64, v_head_dim=32, max_position_embeddings=1024,
                       eos_token_id=tok.token_to_id(EOS), bos_token_id=tok.token_to_id(EOS))
    model = DeepseekV3ForCausalLM(mcfg)
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    params = list({id(p): p for p in model.parameters()}.values())
    decay = [p for p in params if p.dim() == 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))

    rng = np.random.default_rng(cfg.seed)
    model.train()
    bar = tqdm(range(cfg.steps), desc="train", mininterval=10)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        main_loss, mtp_loss, _, _ = losses(model, batches(train_stream, cfg, rng))
        loss = main_loss + cfg.mtp_weight * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 20 == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{main_loss.item():.3f}", mtp=f"{mtp_loss.item():.3f}")
    train_final = {"loss": main_loss.item(), "mtp_loss": mtp_loss.item()}
    heldout = evaluate(model, heldout_stream, cfg)
    minutes = (time.time() - t0) / 60
    print(f"final train loss {train_final['loss']:.3f} (MTP {train_final['mtp_loss']:.3f}); held-out loss "
          f"{heldout['loss']:.3f}, acc {heldout['acc']:.3f}, MTP(t+2) acc {heldout['mtp_acc']:.3f}; {minutes:.1f} min")

    args.out.mkdir(parents=True, exist_ok=True)
    save_model(model, args.out)
    (args.out / "config.json").write_text(json.dumps(mcfg.to_hf_dict(), indent=2) + "\n")
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": EOS, "pad_token": EOS,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": mcfg.max_position_embeddings}, indent=2) + "\n")
    (args.out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": mcfg.eos_token_id, "bos_token_id": mcfg.bos_token_id}, indent=2) + "\n")
    (args.out / "training_summary.json").write_text(json.dumps({
        "train_config": asdict(cfg), "python": platform.python_version(), "torch": torch.__version__,
        "train_files": len(train_files), "heldout_files": len(heldout_files),
        "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(heldout_stream)),
        "final_train": train_final, "heldout": heldout, "minutes": round(minutes, 1)}, indent=2) + "\n")
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
