#!/usr/bin/env python3
"""Train the bundled DSA miniature: GLM-5's architecture (MLA + DeepSeek Sparse Attention, MoE, a layer that
shares the top-k of the one before it, one MTP layer) in miniature, deterministically, on CPU.

``index_topk`` (32) is below the training context (256) and the contexts the tests and benches use, so the
indexer's choice changes what attention reads. The objective is tools/train_tiny.py's (next token, plus the MTP
loss for token t+2, then the MTP layer self-distilled against the frozen target), trained through the sparse
attention, plus DeepSeek-V3.2's indexer loss: for each layer with its own indexer, KL from the layer's dense
attention (averaged over heads, no gradient) to the softmax of the indexer's scores. The indexer's inputs are
detached, as in DeepSeek-V3.2: only that loss trains it. The tokenizer is the bundled model's.

    python tools/train_tiny_dsa.py --out ascend_spec/models/tiny-glm5-dsa-mtp
"""
from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny  # noqa: E402
from train_tiny import (TrainConfig, adamw, batches, corpus_files, distill, encode_stream, evaluate,  # noqa: E402
                        losses, lr_schedule, read_texts)

from ascend_spec.graph.config import MoEConfig  # noqa: E402
from ascend_spec.graph.dsa.config import DsaConfig, IndexerConfig  # noqa: E402
from ascend_spec.graph.dsa.model import DsaAttention, DsaForCausalLM  # noqa: E402
from ascend_spec.graph.weights import save_model  # noqa: E402
from ascend_spec.models import FIXTURE_MODEL_DIR  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass(frozen=True)
class DsaTrainConfig:
    hidden_size: int = 256
    num_hidden_layers: int = 3
    index_topk: int = 32
    steps: int = 500
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 2e-3
    indexer_weight: float = 1.0
    distill_steps: int = 150
    seed: int = 0


def model_config(c: DsaTrainConfig, eos: int) -> DsaConfig:
    """GLM-5 in miniature: dense layer 0, MoE from layer 1 (8 routed experts, top-2, one shared), layer 1 reuses
    layer 0's top-k, interleaved indexer RoPE, one MTP layer with its own indexer."""
    return DsaConfig(vocab_size=2048, hidden_size=c.hidden_size, intermediate_size=2 * c.hidden_size,
                     num_hidden_layers=c.num_hidden_layers, num_attention_heads=4, kv_lora_rank=128,
                     qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, q_lora_rank=128,
                     max_position_embeddings=1024, eos_token_id=eos, bos_token_id=eos, model_type="glm_moe_dsa",
                     moe=MoEConfig(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=c.hidden_size // 2,
                                   n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1),
                     indexer=IndexerConfig(n_heads=4, head_dim=64, topk=c.index_topk, rope="interleaved",
                                           layer_types=("full", "shared") + ("full",) * (c.num_hidden_layers - 2)))


def indexer_loss(model: DsaForCausalLM, inputs: list[tuple[DsaAttention, torch.Tensor]]) -> torch.Tensor:
    """Σ over layers with an indexer of KL(dense attention, mean over heads ‖ softmax(index scores)), per token."""
    total = torch.zeros(())
    for attn, x in inputs:
        x = x.detach().float()
        b, s, _ = x.shape
        positions = torch.arange(s).expand(b, s)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        with torch.no_grad():
            q_resid, kv_a = attn._a_proj(x)
            q_nope, q_pe, c_kv, k_pe = attn._heads(q_resid, kv_a, positions)
            cfg = attn.cfg
            kv = attn.kv_b_proj(c_kv).view(b, s, attn.num_heads, -1)[..., : cfg.qk_nope_head_dim]
            scores = (torch.einsum("bqhn,bkhn->bhqk", q_nope, kv)
                      + torch.einsum("bqhr,bkr->bhqk", q_pe, k_pe)) * cfg.softmax_scale
            target = scores.masked_fill(~causal, float("-inf")).softmax(-1).mean(1)  # [B, S, S]
        keys, weights = attn.indexer.project(x, positions)
        index = attn.indexer._scores(weights, q_resid.detach(), positions, keys)
        # masked entries: target 0 and log_p 0, so they add 0 and no inf reaches the gradient
        log_p = index.masked_fill(~causal, float("-inf")).log_softmax(-1).masked_fill(~causal, 0.0)
        kl = target * (target.clamp_min(1e-12).log() - log_p)
        total = total + kl.sum(-1).mean()
    return total


def pretrain(model: DsaForCausalLM, stream: np.ndarray, c: DsaTrainConfig, tc: TrainConfig) -> dict:
    captured: list[tuple[DsaAttention, torch.Tensor]] = []
    indexed = [layer.self_attn for layer in [*model.decoder_layers, model.mtp_layer(0)]
               if layer.self_attn.indexer is not None]
    for attn in indexed:  # record each indexed attention's input for the indexer loss

        def recording(x, selected=None, _attn=attn, _forward=attn.forward_dense_sparse):
            captured.append((_attn, x))
            return _forward(x, selected)

        attn.forward_dense_sparse = recording
    params = list({id(p): p for p in model.parameters()}.values())
    opt = adamw(params, c.lr, tc.weight_decay)
    lr_at = lr_schedule(c.lr, tc.warmup, c.steps)
    rng = np.random.default_rng(c.seed)
    model.train()
    bar = tqdm(range(c.steps), desc="train", mininterval=30)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        captured.clear()
        main_loss, mtp_loss, _, _ = losses(model, batches(stream, tc, rng))
        idx_loss = indexer_loss(model, captured)
        loss = main_loss + tc.mtp_weight * mtp_loss + c.indexer_weight * idx_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 20 == 0 or step == c.steps - 1:
            bar.set_postfix(loss=f"{main_loss.item():.3f}", mtp=f"{mtp_loss.item():.3f}", idx=f"{idx_loss.item():.3f}")
    for attn in indexed:
        del attn.forward_dense_sparse
    return {"loss": main_loss.item(), "mtp_loss": mtp_loss.item(), "indexer_kl": idx_loss.item()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=DsaTrainConfig.steps)
    ap.add_argument("--distill-steps", type=int, default=DsaTrainConfig.distill_steps)
    args = ap.parse_args()
    c = DsaTrainConfig(steps=args.steps, distill_steps=args.distill_steps)
    train_tiny.AUTOCAST_BF16 = False  # fp32: bf16 backward matmuls are ~10x slower on CPUs without native bf16
    torch.manual_seed(c.seed)
    t0 = time.time()
    tok = Tokenizer.from_file(str(FIXTURE_MODEL_DIR / "tokenizer.json"))
    files = corpus_files()
    heldout_files = files[::40]
    train_files = [f for i, f in enumerate(files) if i % 40]
    train = encode_stream(tok, read_texts(train_files))
    heldout = encode_stream(tok, read_texts(heldout_files))
    tc = TrainConfig(seq_len=c.seq_len, batch_size=c.batch_size, steps=c.steps, lr=c.lr,
                     distill_steps=c.distill_steps, seed=c.seed)
    mcfg = model_config(c, tok.token_to_id("<|endoftext|>"))
    model = DsaForCausalLM(mcfg)
    for name, p in model.named_parameters():
        if p.dim() >= 2:  # matrices and stacked experts
            torch.nn.init.normal_(p, std=0.02)
        elif name.endswith("e_score_correction_bias"):
            torch.nn.init.zeros_(p)
    final = pretrain(model, train, c, tc)
    before = evaluate(model, heldout, tc)
    dist = distill(model, train, tc)
    after = evaluate(model, heldout, tc)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    save_model(model.eval(), out)
    (out / "config.json").write_text(json.dumps(mcfg.to_hf_dict(), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(FIXTURE_MODEL_DIR / name, out / name)
    summary = {"train_config": asdict(c), "torch": torch.__version__, "python": platform.python_version(),
               "train_tokens": int(len(train)), "heldout_tokens": int(len(heldout)), "final_train": final,
               "heldout": before, "distill": dist, "heldout_distilled": after,
               "minutes": round((time.time() - t0) / 60, 1)}
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
