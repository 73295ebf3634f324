"""The k="auto" policy, driven by a simulated machine with known costs and acceptance, so that the
best k is known in closed form and the policy's throughput can be compared with it."""

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest

from tinydraft_mlx.engine.policy import FIRST_LOOK, RECENT, DraftLengthPolicy


def simulate(policy, alpha_at, cost, rounds, seed=0):
    """Run `rounds` rounds. alpha_at(r): acceptance probability (iid per position) at round r;
    cost(k): seconds of a round drafting k. Returns (tokens, seconds, chosen ks)."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    ks = []
    for r in range(rounds):
        k = policy.choose(1000)
        n = 0
        while n < k and rng.random() < alpha_at(r):
            n += 1
        policy.update(k, n, cost(k))
        tokens += n + 1
        seconds += cost(k)
        ks.append(k)
    return tokens, seconds, ks


def best_rate(alpha, cost, k_max=8):
    """max over k of E(k) / cost(k) with E(k) = sum_{j<=k} alpha^j: the policy's target."""
    return max(sum(alpha**j for j in range(k + 1)) / cost(k) for k in range(k_max + 1))


def test_a_new_pair_drafts_one_token_three_times_then_times_plain_rounds():
    """While the draft is in step with the target (after the prefill) exploring costs no
    catch-up: a new pair drafts k = 1 until three rounds are timed (a traced round is not), then
    measures R(0); after a plain round it no longer explores before R(0) is known. R(1) is the
    median of its timings, R(0) a running mean of plain stretches' medians: one round at 3x
    decides neither."""
    policy = DraftLengthPolicy()
    assert policy.choose(10) == 1
    policy.update(1, 1, 0.0)  # traced: acceptance only
    for seconds in (2.0, 6.0):
        assert policy.choose(10) == 1
        policy.update(1, 1, seconds)
    assert policy.choose(10) == 1
    policy.update(1, 0, 2.0)
    assert policy.round_seconds[1] == 2.0  # the median of 2, 6, 2 (their mean: 3.3)
    assert policy.choose(10) == 0  # R(0) next
    assert policy.choose(0) == 0  # nothing left to draft for
    policy.update(0, 0, 2.0)  # a stretch's first round waits for two steps: left out
    policy.update(0, 0, 1.0)  # pending: it may be the stretch's last (which waits for little)
    assert 0 not in policy.round_seconds
    policy.update(0, 0, 1.1)
    assert policy.round_seconds == {0: 1.0, 1: 2.0}  # the first estimate, at once
    for seconds in (1.2, 3.6, 1.3, 0.1):  # the rest of the stretch, one round at 3x; 0.1 its last
        policy.update(0, 0, seconds)
    assert policy.round_seconds[0] == 1.0  # booked when the stretch ends (or every 8 rounds)
    policy.update(1, 1, 2.0)
    # the running mean over rounds of the stretches' medians: 1.0 (one round), then the median of
    # 1.1, 1.2, 3.6, 1.3 for four (the last round, 0.1, left out): the round at 3x does not weigh
    # (a mean of the rounds, 1.64, would favour drafting as the median R(1) does not)
    assert policy.round_seconds[0] == pytest.approx((1.0 + 4 * 1.25) / 5)
    other = DraftLengthPolicy()
    other.update(0, 0, 0.0)  # a plain round first (untimed): the draft is now behind
    assert other.choose(10) == 0


def test_round_cost_interpolates_and_extrapolates():
    policy = DraftLengthPolicy(draft_ratio=0.5)
    policy.round_seconds = {0: 1.0}
    assert policy.round_cost(2) == pytest.approx(2.0)  # prior: draft steps at half the cost
    policy.round_seconds = {0: 1.0, 1: 2.0, 3: 2.6}
    assert policy.round_cost(2) == pytest.approx(2.3)
    assert policy.round_cost(5) == pytest.approx(3.2)  # slope of the two largest: 0.3 per k
    policy.round_seconds = {0: 1.0, 1: 2.5}
    assert policy.round_cost(3) == pytest.approx(3.5)  # draft steps only: 0.5 per k
    policy.round_seconds = {0: 1.0, 1: 2.0, 2: 3.5}
    assert policy.round_cost(4) == pytest.approx(6.5)  # measured: 1.5 per k, not the prior's 0.5


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.6, 0.8, 0.9, 0.95])
@pytest.mark.parametrize("machine", ["gpu-like", "cpu-like"])
def test_throughput_close_to_the_best_fixed_choice(alpha, machine):
    # gpu-like: verification nearly free, draft 10% of the target; cpu-like: verify grows 50%
    # per extra token, draft 40%. Bound: >= 0.95 of the closed-form optimum over 2000 rounds; the
    # policy loses its probes (budget 2%), the first rounds' exploration and alpha's estimation
    # noise (about 1/sqrt(33) with the default decay).
    slope_v, draft = (0.02, 0.1) if machine == "gpu-like" else (0.5, 0.4)

    def cost(k):
        return 1.0 + slope_v * k + draft * k

    tokens, seconds, ks = simulate(DraftLengthPolicy(), lambda r: alpha, cost, 2000)
    assert tokens / seconds >= 0.95 * best_rate(alpha, cost), (tokens / seconds, ks[-20:])


def test_hopeless_speculation_costs_little():
    # acceptance 0 and a draft round costing 2x a plain one: all speculative rounds are waste. The
    # policy may spend its first probe plus ~2% of the time on probes (probe_budget).
    def cost(k):
        return 1.0 + k

    tokens, seconds, ks = simulate(DraftLengthPolicy(), lambda r: 0.0, cost, 1000)
    assert tokens / seconds >= 0.97  # plain decoding: 1 token per second
    assert ks.count(0) > 900
    assert any(k > 0 for k in ks[500:])  # it keeps probing now and then


def test_recovers_when_the_text_becomes_easy():
    def cost(k):
        return 1.0 + 0.15 * k

    def alpha_at(r):
        return 0.0 if r < 300 else 0.95

    _, _, ks = simulate(DraftLengthPolicy(), alpha_at, cost, 600)
    assert sum(k > 0 for k in ks[250:300]) <= 10  # mostly plain while hopeless
    assert sum(k >= 3 for k in ks[400:]) >= 180  # long drafts again once acceptance is high


def test_histogram_of_choices():
    """`chosen` books exactly what was played, and with easy text and cheap drafts the policy
    leaves plain decoding after its first round and settles on long drafts (closed form best:
    k = 8 at alpha 0.9, cost 1 + 0.1 k)."""
    policy = DraftLengthPolicy()
    _, _, ks = simulate(policy, lambda r: 0.9, lambda k: 1.0 + 0.1 * k, 50)
    assert policy.chosen == Counter(ks)
    assert ks[:2] == [1, 1] and policy.chosen[0] <= 3
    assert sum(n for k, n in policy.chosen.items() if k >= 5) >= 35, policy.chosen


def test_shared_policy_per_pair():
    from tinydraft_mlx.engine.policy import shared_policy

    class Model:  # any weak-referenceable object
        pass

    target, draft, other = Model(), Model(), Model()
    first = shared_policy(target, draft, 0.25)
    first.update(0, 0, 1.0)
    assert shared_policy(target, draft, 0.25) is first  # measurements carry over
    assert shared_policy(target, other, 0.25) is not first
    assert shared_policy(target, "PromptLookup(3, 2)", 0.0) is shared_policy(
        target, "PromptLookup(3, 2)", 0.0)
    del draft
    fresh = shared_policy(target, Model(), 0.25)
    assert fresh is not first and not fresh.round_seconds


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7])
def test_catch_up_prices_the_switch_not_sustained_drafting(alpha):
    """After plain rounds the draft catches up (here 0.3 + 0.01 per token it is behind, in units
    of a plain round) before drafting again. Booked as the switch cost, the policy stays >= 0.95
    of the best fixed choice (gpu-like machine); folded into the drafting round's own time it
    overestimates sustained drafting: 0.85 at alpha 0.3 with these costs."""
    def cost(k):
        return 1.0 + 0.12 * k

    rng = random.Random(0)
    policy = DraftLengthPolicy()
    tokens = seconds = 0.0
    behind = 0
    for _ in range(3000):
        k = policy.choose(1000)
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        catch_up = 0.3 + 0.01 * behind if k > 0 and behind > 1 else 0.0
        behind = behind + 1 if k == 0 else 0
        policy.update(k, n, cost(k), catch_up=catch_up)
        tokens += n + 1
        seconds += cost(k) + catch_up
    assert tokens / seconds >= 0.95 * best_rate(alpha, cost)


def test_switches_timed_at_one_stretch_length_do_not_price_a_short_catch_up_as_a_long_one():
    """The catch-up's fit (a fixed part plus a part per plain round missed) cannot tell its two
    parts apart from switches timed after stretches of one length (a policy file written by
    processes that each looked once after ~54 plain rounds, at 3.45 ms): without the prior point
    (a catch-up on almost nothing costs a plain round, 1.7 ms) all of it was the fixed part, and a
    look after 10 plain rounds was priced at 3.45 ms, where the line through both says 2.02.
    Where switches at several lengths tell the parts apart, the prior point moves the fit little;
    before any switch the price is a plain round."""
    from tinydraft_mlx.engine.policy import RoundCosts

    costs = RoundCosts()
    for _ in range(3):
        costs.book_switch(54, 3.45e-3)
    assert costs.switch_cost(10) == pytest.approx(3.45e-3)  # the fit alone: all fixed
    line = 1.7e-3 + (3.45e-3 - 1.7e-3) / 54 * 10  # through (0, 1.7 ms) and (54, 3.45 ms)
    assert costs.switch_cost(10, anchor=1.7e-3) == pytest.approx(line, rel=1e-6)
    policy = DraftLengthPolicy(4, costs=costs)
    policy.round_seconds[0], policy.behind = 1.7e-3, 10
    assert policy._switch_price() == pytest.approx(line, rel=1e-6)
    spread = RoundCosts()  # 0.2 + 0.1 per round, timed after 3 and 13 plain rounds
    spread.book_switch(3, 0.5)
    spread.book_switch(13, 1.5)
    assert spread.switch_cost(23, anchor=1.0) == pytest.approx(2.5, rel=0.07)
    assert RoundCosts().switch_cost(10, anchor=1.7e-3) == pytest.approx(1.7e-3)


def test_shared_policy_keeps_costs_per_pair_and_acceptance_per_sampling_regime():
    """Acceptance learned greedily must not steer sampled requests (on the server, T = 0
    acceptance steered T = 1 requests for tens of rounds); costs are the pair's, whatever the
    sampling."""
    from tinydraft_mlx.engine.policy import MAX_REGIMES, shared_policy

    class Model:
        pass

    target, draft = Model(), Model()
    greedy = shared_policy(target, draft, 0.25, (0.0, 1.0, 0, 0.0))
    for _ in range(20):
        greedy.update(4, 4, 0.004)  # everything accepted at T = 0
    greedy.update(0, 0, 0.002)  # a stretch's first round: not R(0)'s first estimate
    greedy.update(0, 0, 0.001)
    greedy.update(0, 0, 0.001)
    hot = shared_policy(target, draft, 0.25, (1.0, 1.0, 0, 0.0))
    assert hot is not greedy
    assert hot.round_seconds == {4: pytest.approx(0.004), 0: pytest.approx(0.001)}  # shared
    assert sum(hot.accepted) == sum(hot.rejected) == 0  # its own acceptance: nothing yet
    assert min(greedy.acceptance_means()) > 0.8
    hot.update(1, 0, 0.002, catch_up=0.5)
    assert greedy.costs.switch_cost(0) == 0.5 and 1 in greedy.round_seconds
    assert greedy.accepted[0] > 0 and greedy.rejected[0] == 0  # T = 1's rejection stays there
    assert shared_policy(target, draft, 0.25, (0.0, 1.0, 0, 0.0)) is greedy
    for i in range(MAX_REGIMES):
        shared_policy(target, draft, 0.25, (0.5 + i, 1.0, 0, 0.0))
    assert shared_policy(target, draft, 0.25, (0.0, 1.0, 0, 0.0)) is not greedy  # bounded


def test_generations_at_different_temperatures_get_their_own_acceptance(pair):
    from tinydraft_mlx import generate

    target, draft, tok = pair
    _, cold = generate(target, draft, tok, "def f(x):", k="auto", max_tokens=16)
    _, cold_again = generate(target, draft, tok, "def g(y):", k="auto", max_tokens=16)
    _, hot = generate(target, draft, tok, "def f(x):", k="auto", max_tokens=16,
                      temperature=1.0, seed=0)
    assert cold.policy is cold_again.policy  # learning carries over within a regime
    assert hot.policy is not cold.policy and hot.policy.costs is cold.policy.costs


def test_a_fresh_pair_times_k_1_before_concluding_plain():
    """Speculation that cannot pay (acceptance 0, a draft round at 2x a plain one): a pair with
    no evidence still times k = 1 before settling on plain decoding, so one unlucky first probe
    does not decide for the whole process: up to EXPLORE_TIMES times, until the first position
    stops looking promising (two rejections: mean acceptance 1/4 under a uniform prior)."""
    from tinydraft_mlx.engine.policy import EXPLORE_KS, EXPLORE_TIMES

    policy = DraftLengthPolicy()
    _, _, ks = simulate(policy, lambda r: 0.0, lambda k: 1.0 + k, 60)
    assert EXPLORE_KS == (1,) and policy.timed[1] == 2, policy.timed
    assert sum(k > 0 for k in ks) <= len(EXPLORE_KS) * EXPLORE_TIMES + 2
    assert ks[-30:].count(0) >= 29  # then plain


def test_a_catch_ups_predictions_are_booked_as_runs_of_accepted_drafts():
    """observe(matches): a greedy draft starting after token t has its first i drafts accepted
    while matches[t..t+i-1] hold; positions past the catch-up are not observed. By hand, for
    matches 1 1 0 1: starts 0..3 reach position 0 four times (accepted 3), position 1 twice
    (from t = 0 and t = 1, accepted once), position 2 once (rejected)."""
    policy = DraftLengthPolicy(4)
    policy.observe([True, True, False, True])
    assert policy.accepted == [3.0, 1.0, 0.0, 0.0]
    assert policy.rejected == [1.0, 1.0, 1.0, 0.0]
    many = DraftLengthPolicy(4)
    many.observe([True] * 32)  # overlapping runs: at most CATCH_UP_WEIGHT rounds' worth
    assert many.accepted[0] == pytest.approx(8.0) and many.rejected == [0.0] * 4


def test_a_hopeless_draft_by_a_looks_evidence_is_not_explored():
    """A new pair whose draft never predicted the token that followed on the text a look caught
    it up on does not explore k = 1 (without that evidence it does), and with acceptance 0 and a
    round of k costing 1 + k plain rounds it drafts only now and then afterwards."""
    hopeless = DraftLengthPolicy()
    hopeless.looks = True
    hopeless.observe([False] * 16)
    ks = []
    for _ in range(200):
        ks.append(hopeless.choose(100))
        hopeless.update(ks[-1], 0, 1.0 + ks[-1])
    # the probe budget (2% of the plain time: a probe priced at a plain round every ~50) and a
    # few Thompson draws while the evidence fades: under 5% of the time in all
    assert ks[:3] == [0, 0, 0] and sum(ks) <= 10, [(i, k) for i, k in enumerate(ks) if k]
    assert DraftLengthPolicy().choose(100) == 1


def test_thompson_probes_where_the_evidence_is_thin_not_where_it_is_strong():
    """Plain decoding wins on the means in both; with 3 rejected rounds behind it a policy
    still tries drafting now and then (a hard start must not decide a whole generation); with
    40 it does not."""
    def tried(rejected: float) -> int:
        policy = DraftLengthPolicy(4)
        policy.round_seconds.update({0: 1.0, 1: 1.3})
        policy.timed.update({0: 5, 1: 5})
        policy.costs.here.update({0, 1})  # timed in this process
        policy.rejected[0] = rejected
        count = 0
        for _ in range(300):
            policy.plain_seconds = 0.0  # no probe budget: Thompson draws alone
            count += policy.choose(4) > 0
        return count

    assert tried(3.0) >= 10
    assert tried(40.0) == 0


def _first_probe(looks: bool, accepted: float, rejected: float) -> int:
    """Plain rounds (1 s each) until a policy whose k = 1 costs 3 plain rounds (hopeless at its
    cost: no Thompson probe, only the budget's), both timed in this process (nothing left to
    explore), with the first position's evidence as given, first drafts (2000: never)."""
    policy = DraftLengthPolicy(4)
    policy.looks = looks
    policy.round_seconds.update({0: 1.0, 1: 3.0})
    policy.timed.update({0: 5, 1: 5})
    policy.accepted[0], policy.rejected[0] = accepted, rejected
    policy.costs.here.update({0, 1})
    policy.costs.book_switch(10, 0.2)
    for rounds in range(1, 2000):
        if policy.choose(100) > 0:
            return rounds
        policy.update(0, 0, 1.0)
    return 2000


def test_a_probe_that_looks_first_is_priced_at_its_catch_up_only():
    """Where the loop looks before it leaps, a probe that finds drafting hopeless costs only
    the catch-up (the round then stays plain), so the budget allows it far sooner (a fair
    draft: no evidence that a look would find it worthless)."""
    assert _first_probe(True, 30.0, 30.0) < 30 < _first_probe(False, 30.0, 30.0)


def test_a_look_first_probe_waits_longer_where_the_last_look_found_the_draft_hopeless():
    """Where the loop looks first the budget is spent at the rate of the chance that a look
    finds the draft worth exploring (first-position acceptance >= EXPLORE_MIN): a draft the
    last look found always rejected is probed later than a fair one, yet still probed as the
    evidence fades."""
    fair, hopeless = _first_probe(True, 4.0, 4.0), _first_probe(True, 0.0, 8.0)
    assert fair < 30
    assert 2 * fair < hopeless < 400


def test_no_budgeted_probe_in_a_generations_last_tokens():
    """A budgeted probe's finding pays over the tokens after it: with fewer than HORIZON left it
    is not taken however much plain time has earned it (warm, alpha 0 on the demo pair: a probe
    after ~60 of 64 plain rounds cost 4% of the generation for nothing it could use)."""
    from tinydraft_mlx.engine.policy import HORIZON

    policy = DraftLengthPolicy(4)
    policy.looks = True
    policy.round_seconds.update({0: 1.0, 1: 3.0})
    policy.timed.update({0: 5, 1: 5})
    policy.costs.here.update({0, 1})
    # hopeless at its cost (k = 1 at 3x a plain round): no look is worth it, only the budget
    # probes (a fair draft: the look's chance of finding it worth exploring is ~1)
    policy.accepted[0] = policy.rejected[0] = 30.0
    policy.costs.book_switch(10, 0.2)
    policy.behind, policy.plain_seconds = 20, 100.0  # the budget has earned a probe
    assert policy.choose(HORIZON - 1) == 0
    assert policy.choose(HORIZON) > 0


def test_a_round_accepted_whole_books_the_position_after_it():
    """`observe_beyond(k, accepted)`: what a round drafting k + 1 would have booked at position
    k + 1 (given the first k accepted); nothing beyond k_max."""
    policy = DraftLengthPolicy(4)
    policy.observe_beyond(1, True)
    policy.observe_beyond(1, False)
    policy.observe_beyond(1, True)
    policy.observe_beyond(4, True)  # position 5 of a 4-position policy: not booked
    assert policy.accepted == [0.0, 2.0, 0.0, 0.0] and policy.rejected == [0.0, 1.0, 0.0, 0.0]


def test_a_policy_drafting_one_token_moves_to_two_where_the_second_would_pay():
    """With k = 1 rounds only, position 2 is never reached; the evidence from rounds accepted
    whole tells the policy that k = 2 pays (simulated: acceptance 0.7 then 0.95 given the first;
    R(0), R(1), R(2) = 1, 1.5, 2: k = 2 pays only if position 2 is accepted well above the first
    position's rate, which is where it would be assumed without that evidence)."""
    policy = DraftLengthPolicy(4)
    policy.round_seconds.update({0: 1.0, 1: 1.5, 2: 2.0})
    policy.timed.update({0: 5, 1: 5, 2: 1})
    policy.costs.here.update({0, 1, 2})
    rng = random.Random(0)
    ks = []
    for _ in range(60):
        k = policy.choose(8)
        ks.append(k)
        n = 0
        while n < k and rng.random() < (0.7 if n == 0 else 0.95):
            n += 1
        policy.update(k, n, 0.0)  # acceptance only: the costs stay as set
        if n == k and k < 4:
            policy.observe_beyond(k, rng.random() < 0.95)
    assert Counter(ks[-20:]).most_common(1)[0][0] >= 2, ks


def test_one_more_position_is_asked_for_while_its_evidence_is_thin():
    """`wants_beyond(k)`: after a round drafting k accepted whole, the next round reads whether
    position k + 1 would have been accepted while that position has fewer than BEYOND_EVIDENCE
    (discounted) observations (reading it every round cost ~4% of a generation drafting
    k = 1); once drafting rounds fade them (`decay`) below that, again; never past k_max."""
    from tinydraft_mlx.engine.policy import BEYOND_EVIDENCE

    policy = DraftLengthPolicy(4)
    assert policy.wants_beyond(1) and policy.wants_beyond(3)
    for _ in range(int(BEYOND_EVIDENCE)):
        assert policy.wants_beyond(1)
        policy.observe_beyond(1, True)
    assert not policy.wants_beyond(1)
    assert policy.wants_beyond(2)  # another position's evidence is its own
    policy.update(1, 1, 0.0)  # a drafting round fades all evidence by `decay`
    assert policy.wants_beyond(1)
    assert not policy.wants_beyond(4)  # position 5 of a 4-position policy: never booked


def test_one_more_position_is_asked_for_only_while_it_could_change_the_choice():
    """Once R(0) is known, position k + 1 is read only while drafting k + 1, were that position
    always accepted, would beat drafting k at the means: a k + 1 timed too dear to pay makes the
    read worthless (it still cost 1-4% of a run's rounds), an untimed one (its cost extrapolated
    optimistically) or a cheap one keeps it worth reading."""
    policy = DraftLengthPolicy(4, draft_ratio=0.25)
    policy.accepted[0], policy.rejected[0] = 9.0, 1.0
    assert policy.wants_beyond(1)  # nothing timed: read
    policy._book(0, 1.0, 8)
    policy._book(1, 1.6, 1)
    # E(1) ~ 1.85 in 1.6 (1.16 a second); k = 2 at R(1) + a draft step 1.85: up to 2.7 in 1.85
    assert policy.wants_beyond(1)
    policy._book(2, 3.0, 1)  # at most 2.7 in 3.0: k = 2 cannot pay, whatever position 2 does
    assert not policy.wants_beyond(1)
    cheap = DraftLengthPolicy(4, draft_ratio=0.25)
    cheap.accepted[0], cheap.rejected[0] = 9.0, 1.0
    for k, seconds in [(0, 1.0), (1, 1.6), (2, 2.0)]:
        cheap._book(k, seconds, 8 if k == 0 else 1)
    assert cheap.wants_beyond(1)  # up to 2.7 in 2.0 beats 1.85 in 1.6


def test_the_chance_of_a_round_accepted_whole_is_the_product_of_the_mean_acceptances():
    """`whole_chance(k)`: the product of the first k positions' posterior means (each
    (accepted + 2 * pooled) / (reached + 2), pooled = (1 + all accepted) / (2 + all reached))."""
    policy = DraftLengthPolicy(4)
    assert policy.whole_chance(0) == 1.0
    assert policy.whole_chance(2) == pytest.approx(0.25)  # no evidence: 0.5 each
    policy.accepted[:2], policy.rejected[:2] = [8.0, 6.0], [2.0, 2.0]
    # pooled 15 / 20 = 0.75; means 9.5 / 12 and 7.5 / 10
    assert policy.whole_chance(1) == pytest.approx(9.5 / 12)
    assert policy.whole_chance(2) == pytest.approx(9.5 / 12 * 0.75)


def test_costs_loaded_from_the_file_give_way_to_this_processs_timings():
    """A cost loaded from the policy file is replaced by the first timing of that k in this
    process (not blended in), and once a drafting round has been timed here, a k timed only in
    another process is estimated from this process's timings (optimistically), so that a stale,
    inflated cost there cannot keep it untried."""
    from tinydraft_mlx.engine.policy import RoundCosts

    costs = RoundCosts()
    costs.load({"round_seconds": {"0": 1.0, "1": 2.0, "2": 9.0}, "timed": {"0": 50, "1": 50,
                "2": 50}, "switch_fit": [0.0] * 5, "switches": 0})
    policy = DraftLengthPolicy(4, draft_ratio=0.25, costs=costs)
    assert policy.round_cost(2) == 9.0  # nothing timed here yet: the file's
    policy.update(1, 1, 1.6)
    assert policy.round_seconds[1] == pytest.approx(1.6)  # replaced, not blended
    assert policy.round_cost(2) == pytest.approx(1.6 + 0.25)  # R(1) here + a draft step
    assert policy.round_cost(0) == 1.0  # R(0) from the file until a stretch is timed here
    policy.update(2, 2, 2.4)
    assert policy.round_cost(2) == pytest.approx(2.4)
    policy.update(2, 2, 3.4)
    assert policy.round_cost(2) == pytest.approx(2.9)  # then the median of its timings here


def test_a_ratio_measured_over_a_run_bounds_a_ks_first_timings_from_above():
    """A k's first rounds after a switch are its dearest (the draft cold after plain rounds, no
    step ahead after a rejection): judged on three of them, a fresh process found k = 1 at 1.9x
    a plain round where a run costs 1.4-1.5x, and decoded the rest plainly. R(k) is held at most
    at R(0) times the ratio a full window of k's rounds measured (`RoundCosts.hope`: this
    process's, or the policy file's) until this process's own timings fill a window; never
    raised by it (a file that says drafting is dearer must not keep a process plain); saved
    only from a full window (a process that timed k three times does not overwrite it)."""
    from tinydraft_mlx.engine.policy import RECENT, RoundCosts

    def loaded(hope: float) -> DraftLengthPolicy:
        costs = RoundCosts()
        costs.load({"round_seconds": {"0": 1.0, "1": 1.4}, "timed": {"0": 50, "1": 50},
                    "switch_fit": [0.0] * 5, "switches": 0, "hope": {"1": hope}})
        policy = DraftLengthPolicy(4, draft_ratio=0.25, costs=costs)
        for _ in range(3):  # a stretch times R(0) here: 2.0 (this process is slower)
            policy.update(0, 0, 2.0)
        policy.end_stretch()
        assert policy.round_cost(0) == pytest.approx(2.0)
        return policy

    policy = loaded(1.4)
    for _ in range(3):  # k = 1's first rounds here, cold: 1.9x R(0)
        policy.update(1, 1, 3.8)
    assert policy.round_cost(1) == pytest.approx(2.8)  # 1.4 R(0), not 3.8
    assert policy.costs.hope == {1: 1.4}  # three timings do not overwrite it
    policy.accepted[0], policy.rejected[0] = 13.0, 7.0  # acceptance 0.65: k = 1 pays at 1.4
    policy.behind = 0  # (at 1.9 plain wins on the means: E(1) = 1.65 tokens for 1.9 rounds)
    assert policy.choose(8) > 0
    for _ in range(RECENT - 3):  # a full window here: its own median decides, and is saved
        policy.update(1, 1, 3.6)
    assert policy.round_cost(1) == pytest.approx(3.6)
    assert policy.costs.to_json()["hope"] == {"1": pytest.approx(1.8)}
    pessimistic = loaded(3.0)  # a file that says k = 1 costs 3x a plain round
    pessimistic.update(1, 1, 2.6)
    assert pessimistic.round_cost(1) == pytest.approx(2.6)  # this process's timing stands


def test_a_loaded_large_k_does_not_let_a_fresh_process_jump_to_k_max():
    """The reach of an optimistic estimate is the largest k timed plus one: in this process
    once it has timed a drafting round, whatever larger k the file holds."""
    from tinydraft_mlx.engine.policy import RoundCosts

    costs = RoundCosts()
    costs.load({"round_seconds": {"0": 1.0, "1": 1.5, "5": 2.5}, "timed": {"0": 9, "1": 9,
                "5": 9}, "switch_fit": [0.0] * 5, "switches": 0})
    policy = DraftLengthPolicy(8, draft_ratio=0.1, costs=costs)
    policy.accepted = [50.0] * 8  # every position accepted: the longest affordable k wins
    policy.costs.here.add(0)  # R(0) timed here (the file's value, for the arithmetic)
    assert policy.choose(8) == 6  # from the file's drafting costs: 5 timed, reach 6
    policy.update(1, 1, 1.5)
    assert policy.choose(8) == 2  # timed here: k = 1, reach 2


def test_sampled_evidence_books_expected_counts_along_the_text():
    """`observe` with probabilities (sampled looks: sum min(p, q) per position): a draft from
    each position reaches the next with the product of the probabilities so far; worked by
    hand for [0.5, 1.0, 0.0]: reached [3, 1.5, 0.5], accepted [1.5, 0.5, 0]."""
    policy = DraftLengthPolicy(4)
    policy.observe([0.5, 1.0, 0.0])
    assert policy.accepted == pytest.approx([1.5, 0.5, 0.0, 0.0])
    assert policy.rejected == pytest.approx([1.5, 1.0, 0.5, 0.0])


def test_a_file_that_says_plain_does_not_keep_a_process_from_timing_drafts():
    """Drafting costs in the policy file measured under another process's load (here 3x a plain
    round) must not keep a new process plain: a process that decodes plainly never times a
    drafting round, and saves the stale costs again for the next one (seen: a benchmark's
    processes with the file decoded 100-128 of 128 tokens plainly, three runs in a row, where
    k = 1 was 1.25x faster). Where the first position is promising a process times k = 1 itself
    (up to EXPLORE_TIMES rounds) before concluding plain decoding; where it is not, it does not
    explore."""
    from tinydraft_mlx.engine.policy import RoundCosts

    def loaded(accepted, rejected):
        costs = RoundCosts()
        costs.load({"round_seconds": {"0": 1.0, "1": 3.0, "2": 4.0},
                    "timed": {"0": 50, "1": 50, "2": 50}, "switch_fit": [0.0] * 5,
                    "switches": 0})
        policy = DraftLengthPolicy(4, draft_ratio=0.25, costs=costs)
        policy.accepted, policy.rejected = [accepted] * 4, [rejected] * 4
        return policy

    policy = loaded(8.0, 2.0)  # acceptance ~0.8: plain wins only on the file's costs
    assert policy.choose(8) == 1
    policy.update(1, 1, 0.0)  # traced: not a timing
    assert policy.choose(8) == 1
    policy.update(1, 1, 1.3)  # this process's own R(1)
    assert policy.choose(8) > 0  # drafting pays at this process's costs
    hopeless = loaded(0.5, 9.5)  # ~0.05: not worth a look
    assert hopeless.choose(8) == 0


def _near_break_even(accepted: float, rejected: float, behind: int) -> DraftLengthPolicy:
    """A policy whose k = 1 round costs 1.5 plain rounds (break-even at acceptance 0.5) with
    the first position's evidence as given, `behind` plain rounds since it last drafted."""
    policy = DraftLengthPolicy(4)
    policy.round_seconds.update({0: 1.0, 1: 1.5})
    policy.timed.update({0: 5, 1: 5})
    policy.costs.here.update({0, 1})
    policy.accepted[0], policy.rejected[0] = accepted, rejected
    policy.behind = behind
    return policy


def test_in_step_thompson_keeps_drafting_while_the_evidence_is_thin():
    """Plain decoding wins on the means (acceptance 0.4 where 0.5 breaks even). A drafting
    round measures acceptance as it goes and costs no catch-up, a plain round learns nothing
    until the next look: so a policy whose draft is in step (it drafted last round, or has just
    caught up) keeps drafting as often as a draw from a thin posterior says drafting is not
    worse than plain by more than a switch back would cost over HORIZON tokens (here: a draw
    above ~0.46); on strong evidence at the same mean it stops (the draws sit at the mean: 2.3
    rounds' loss over 32 tokens against a switch of 1); behind the target it switches only when
    a draw repays the catch-up."""
    def drafts(accepted: float, rejected: float, behind: int = 0,
               caught_up: bool = False) -> int:
        policy = _near_break_even(accepted, rejected, behind)
        count = 0
        for _ in range(400):
            policy.plain_seconds = 0.0  # no probe budget
            count += policy.choose(4, caught_up=caught_up) > 0
        return count

    thin_in_step = drafts(4.0, 6.0)
    assert 80 <= thin_in_step <= 240, thin_in_step
    assert drafts(4.0, 6.0, behind=10, caught_up=True) == pytest.approx(thin_in_step, abs=60)
    assert drafts(4.0, 6.0, behind=10) < thin_in_step / 2
    assert drafts(400.0, 600.0) == 0


def test_hopeless_drafting_in_step_stops_at_once():
    """Where drafting clearly loses (acceptance 0.1 on 20 rounds' evidence) being in step does
    not keep it drafting."""
    policy = _near_break_even(2.0, 18.0, 0)
    assert sum(policy.choose(4) > 0 for _ in range(200)) <= 2


def test_a_generations_first_plain_stretch_looks_once():
    """Where the loop looks before it leaps, a policy that has not looked at a generated text yet
    (a fresh process: its evidence is the prompt's and the first tokens', and the first tokens
    after a prompt are often the hardest: three rejected k = 1 rounds there kept fresh processes
    plain for 30-60 rounds where k = 1 pays throughout) looks at a generation's text after
    FIRST_LOOK rounds however much its evidence says drafting loses, once: a look that books a
    catch-up ends it. Without looks, no such probe. A policy that has looked at generated text
    before (a warm process) looks at a new generation's text only where a look is worth its
    catch-up (`_look_value`): not where much evidence says the draft is rarely right,
    nor where it says drafting loses by a clear margin (warm processes looked once a generation
    there and found nothing); and none in a generation's last HORIZON tokens."""
    from tinydraft_mlx.engine.policy import FIRST_LOOK, HORIZON

    def rounds_to_look(accepted: float, rejected: float, looks: bool = True,
                       due: bool = True, seen: bool = False, tokens: int = 200) -> int:
        policy = _near_break_even(accepted, rejected, 0)  # no Thompson draw acts in 100 rounds
        policy.looks, policy.look_due, policy.seen_text = looks, due, seen
        policy.update(0, 0, 1.0)  # behind: 1
        for _ in range(1, 100):
            policy.plain_seconds = 0.0  # no probe budget: the look alone
            if policy.choose(tokens - policy.behind) > 0:
                return policy.behind
            policy.update(0, 0, 1.0)
        return 100

    promising_but_losing = (35.0, 65.0)  # acceptance 0.35 where 0.5 breaks even
    assert rounds_to_look(*promising_but_losing) == FIRST_LOOK
    assert rounds_to_look(*promising_but_losing, looks=False) == 100
    assert rounds_to_look(*promising_but_losing, due=False) == 100
    assert rounds_to_look(0.0, 8.0) == FIRST_LOOK  # thin evidence against: it looks
    assert rounds_to_look(0.5, 39.5) == FIRST_LOOK  # strong: a fresh policy looks all the same
    assert rounds_to_look(*promising_but_losing, seen=True) == 100  # a warm one does not
    assert rounds_to_look(0.5, 39.5, seen=True) == 100
    # nor where what it finds has no tokens left to pay over: the generation's last HORIZON
    assert rounds_to_look(*promising_but_losing, tokens=FIRST_LOOK + HORIZON) == FIRST_LOOK
    assert rounds_to_look(*promising_but_losing, tokens=FIRST_LOOK + HORIZON - 1) == 100
    policy = _near_break_even(0.5, 9.5, FIRST_LOOK)
    policy.looks, policy.look_due = True, True
    assert policy.choose(100) > 0
    policy.update(0, 0, 1.0, catch_up=0.5)  # the look found plain decoding better
    assert not policy.look_due
    policy.observe([0.0] * 16)  # what it booked: generated text
    assert policy.seen_text


def test_a_look_is_worth_what_it_may_find():
    """`_look_value`: the expected saving of drafting over plain decoding where it saves
    anything, E[max(0, 1/plain_rate - R(k) / E(k))] over the first position's posterior (the
    later positions at their means), times min(rest of the generation, LOOK_HORIZON) tokens.
    Checked against the same expectation integrated here on a fine grid (20000 points; the
    policy's 24-point grid is within 5% of it where the value matters), for k = 1 and k = 2."""
    import math

    from tinydraft_mlx.engine.policy import LOOK_HORIZON

    policy = _near_break_even(3.0, 5.0, 10)  # R(0) = 1, R(1) = 1.5: breaks even at 0.5
    policy.round_seconds[2] = 2.2
    policy.costs.here.add(2)
    policy.accepted[1], policy.rejected[1] = 6.0, 2.0
    alphas = policy.acceptance_means()

    def reference(ks, remaining):
        a, r = policy.accepted[0], policy.rejected[0]
        n = 20000
        total = saving = 0.0
        for i in range(n):
            x = (i + 0.5) / n
            w = math.exp(a * math.log(x) + r * math.log1p(-x))
            total += w
            best = min(policy.round_seconds[k]
                       / policy.expected_tokens([x, *alphas[1:]], k) for k in ks)
            saving += w * max(0.0, 1.0 - best)
        return min(remaining, LOOK_HORIZON) * saving / total

    for ks in ([1], [1, 2]):
        for remaining in (20, 500):
            got = policy._look_value(ks, alphas, 1.0, remaining)
            assert got == pytest.approx(reference(ks, remaining), rel=0.05), (ks, remaining)
    assert policy._look_value([1], alphas, 1.0, 20) < policy._look_value([1], alphas, 1.0, 500)
    policy.accepted[0], policy.rejected[0] = 0.0, 60.0  # hopeless on much evidence: worthless
    assert policy._look_value([1, 2], alphas, 1.0, 500) < 1e-6
    # against a threshold it may return a bound instead (Cantelli's): never one that changes
    # whether the look is worth its price
    for a, r in ((0.0, 60.0), (2.0, 20.0), (3.0, 5.0), (10.0, 10.0), (1.0, 40.0)):
        policy.accepted[0], policy.rejected[0] = a, r
        value = policy._look_value([1, 2], alphas, 1.0, 500)
        for price in (1e-4, 0.01, 0.1, 0.5, 1.0, 3.0):
            bounded = policy._look_value([1, 2], alphas, 1.0, 500, price)
            assert bounded >= value - 1e-12 and (bounded > price) == (value > price), (a, r)


def test_a_warm_process_near_break_even_does_not_look_every_few_rounds():
    """Acceptance 0.4 where a k = 1 round costs 1.5 plain rounds (plain decoding 1.07x faster)
    and a catch-up 0.7 of one; 20 generations of 128 tokens in one process (no probe budget: it
    restarts every generation, and is left out here). A Thompson draw every plain round made a
    look whenever one draw came out high: 124 looks in the 20 generations, 0.96x plain
    decoding. Taken where its expected value (`_look_value`) repays its catch-up: 42 looks,
    0.98x. Bounds: half the looks, 0.98x."""
    policy = _near_break_even(0.0, 0.0, 0)
    policy.costs.here.discard(1)
    run = looking_simulation(policy, 0.4, lambda r, k: 1.0 + k / 2, generations=20, tokens=128,
                             catch_up=0.7, budget=False, seed=1)
    assert run.looks <= 62, run.looks
    assert run.tokens / run.seconds >= 0.98, (run.tokens / run.seconds, run.looks, policy.chosen)


def test_a_file_whose_plain_round_is_stale_does_not_keep_a_process_drafting():
    """The mirror case: a file's R(0) measured under load (3x this process's) makes drafting
    look good whatever the acceptance, and a process that drafts never times a plain round.
    A process times R(0) itself before its costs decide: at acceptance 0.35, where a k = 1
    round costs 1.5 plain rounds (plain decoding 1.1x faster), it ends up decoding plainly."""
    from tinydraft_mlx.engine.policy import RoundCosts

    costs = RoundCosts()
    costs.load({"round_seconds": {"0": 3.0, "1": 1.5}, "timed": {"0": 50, "1": 50},
                "switch_fit": [0.0] * 5, "switches": 0})
    policy = DraftLengthPolicy(4, draft_ratio=0.25, costs=costs)
    policy.accepted[0], policy.rejected[0] = 3.5, 6.5  # a file's acceptance: 0.35
    _, _, ks = simulate(policy, lambda r: 0.35, lambda k: 1.0 + 0.5 * k, 200)
    assert 0 in policy.costs.here and policy.round_seconds[0] == pytest.approx(1.0)
    assert ks[-100:].count(0) >= 80, ks


@dataclass
class Looking:
    """What `looking_simulation` played: the k of each round, the rounds that began with a look
    (a catch-up), the tokens emitted and the seconds spent (rounds and catch-ups)."""

    ks: list[int] = field(default_factory=list)
    looked: list[int] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0

    @property
    def looks(self) -> int:
        return len(self.looked)


def looking_simulation(policy: DraftLengthPolicy, alpha: float, cost, rounds: int = 0, *,
                       generations: int = 0, tokens: int = 128, catch_up=0.5,
                       budget: bool = True, seed: int = 0, prompt: int = 0,
                       ahead: bool = True) -> Looking:
    """Drive `policy` as the loop drives it where it looks before it leaps: a round that drafts
    after plain rounds first catches the draft up (priced `catch_up` s, a constant or a function
    of the tokens it feeds; booked as its 16 positions' predictions), then chooses again,
    `caught_up`; every prediction and every draft position is accepted with probability `alpha`.
    `cost(r, k)`: seconds of round r drafting k.
    Either `rounds` rounds of one endless generation, or `generations` generations of `tokens`
    tokens each (each starts as `shared_policy` starts one, and a round may emit the tokens
    left). `budget=False`: no budgeted probe (its budget is spent every round). `alpha` may be
    a function of the round: the text's acceptance then. `prompt`: each generation's draft
    starts empty, as the loop's does (`speculative._prefill`): its first round is plain without
    a choice, and its first catch-up (a fill) feeds the prompt too, its predictions those of
    the generated tokens only. `ahead`: as the loop's pipelined plain rounds, a plain round
    (not a generation's first nor its last) chooses the next round's k before it is booked."""
    from tinydraft_mlx.engine.policy import CATCH_UP_EVIDENCE

    rng = random.Random(seed)
    policy.looks = True
    run, r = Looking(), 0
    for _ in range(max(1, generations)):
        policy.start_generation()  # as `shared_policy` starts one
        policy.empty = prompt
        emitted, chosen = 0, None
        while (emitted < tokens) if generations else (r < rounds):
            limit = tokens - 1 - emitted if generations else 1000
            if not budget:
                policy.plain_seconds = 0.0
            now = alpha(r) if callable(alpha) else alpha
            filled = bool(policy.empty)
            if chosen is not None:
                k, chosen = chosen, None
            else:
                k = 0 if filled and not emitted else policy.choose(limit)
            looked = 0.0
            if k > 0 and (policy.behind > 0 or filled):
                run.looked.append(r)
                fed = policy.behind + policy.empty
                looked = catch_up(fed) if callable(catch_up) else catch_up
                seen = min(CATCH_UP_EVIDENCE, emitted) if filled else CATCH_UP_EVIDENCE
                policy.observe([float(rng.random() < now) for _ in range(seen)])
                k = policy.choose(limit, caught_up=True)
            n = 0
            while n < k and rng.random() < now:
                n += 1
            seconds = cost(r, k)
            if ahead and k == 0 and 0 < emitted and (emitted < tokens - 1 or not generations):
                chosen = policy.choose(limit - 1)  # the next round's, before this one is booked
            policy.update(k, n, seconds, catch_up=looked, filled=filled and looked > 0)
            run.ks.append(k)
            run.seconds += seconds + looked
            emitted += n + 1
            r += 1
        run.tokens += emitted
    return run


def test_a_plain_cost_booked_in_a_busy_moment_does_not_keep_a_rejected_draft_drafting():
    """A warm pair (k = 1 timed at 1.9 plain rounds, acceptance 0.7) whose draft is then always
    rejected, on a machine busy at 3x for 12 rounds in every 150 (twelve placements). Where a
    busy moment falls at a plain stretch's end, R(0) is booked at ~2x and the plain time it
    earned pays a probe right after: drafting at R(1) = 1.9 then beats that R(0) whatever the
    acceptance, and drafting never re-times R(0), so it went on drafting rejected rounds (up to
    469 of a run's ~1500; 0.78-0.85 of plain decoding in 7 of 12 placements). R(0) is held to
    R(1) / (1 + k * draft_ratio / 2) once R(1) is timed now: each run drafts a few dozen rounds
    at most and stays within 4% of plain decoding under the same noise."""
    for placement in range(12):
        offset = placement * 97 % 150

        def cost(r: int, k: int, offset: int = offset) -> float:
            return (1.0 + 0.9 * k) * (3.0 if (r + offset) % 150 < 12 else 1.0)

        policy = DraftLengthPolicy(4, draft_ratio=0.25)
        looking_simulation(policy, 0.7, lambda r, k: 1.0 + 0.9 * k, generations=2,
                           catch_up=_fill, prompt=20)
        run = looking_simulation(policy, 0.0, cost, generations=12, catch_up=_fill, prompt=20)
        plain = sum(cost(r, 0) for r in range(run.tokens))  # a token a round, the same noise
        drafted = sum(1 for k in run.ks if k)
        assert drafted <= 40, (offset, drafted)
        assert run.tokens / run.seconds >= 0.96 * run.tokens / plain, (offset, drafted)


def test_a_ratio_to_an_r0_the_bound_set_is_not_kept_as_hope():
    """R(0) booked at 3.0 in a busy stretch, then a full window of k = 1 at 1.9: the bound lowers
    R(0) to 1.9 / (1 + 0.25 / 2), and the window's ratio to that R(0) (1.125) is the bound's, not
    a measurement: kept as k = 1's hope (`RoundCosts.hope`, saved to the policy file), it would
    let a later process, or this one after a switch, draft k = 1 at 1.125x a plain round where it
    costs 1.9x until a full window came. Once plain rounds book R(0) again, a window measures."""
    policy = DraftLengthPolicy(4, draft_ratio=0.25)
    for _ in range(20):
        policy.update(0, 0, 3.0)
    for _ in range(RECENT):
        policy.update(1, 1, 1.9)
    assert policy.round_seconds[0] == pytest.approx(1.9 / 1.125)
    assert 1 not in policy.costs.hope
    policy.end_stretch()
    for _ in range(40):
        policy.update(0, 0, 1.0)
    for _ in range(RECENT):
        policy.update(1, 1, 1.9)
    assert policy.costs.hope[1] == pytest.approx(1.9 / policy.round_seconds[0])
    # a full window is judged on its median alone, also where R(0) is bounded (an older, lower
    # hope does not cap it)
    bounded = DraftLengthPolicy(4, draft_ratio=0.25)
    bounded.costs.hope[1] = 1.0
    for _ in range(20):
        bounded.update(0, 0, 3.0)
    for _ in range(RECENT):
        bounded.update(1, 1, 1.9)
    assert bounded.costs.plain_bounded and bounded.round_seconds[1] == pytest.approx(1.9)
    assert bounded.costs.hope[1] == 1.0


def test_a_drafting_cost_timed_in_a_busy_moment_does_not_keep_a_process_plain():
    """A round drafting k costs 1 + k / 2 plain rounds and each position is accepted 0.7 of the
    time: k = 1 pays (1.7 tokens for 1.5 rounds; k = 2: 2.19 for 2). For 10 rounds the machine
    is busy and drafting rounds take twice as long: R(1), the median of its latest timings, is
    then a busy one, and plain decoding wins on it. Plain rounds never re-time R(1), and a probe
    that looks first judged drafting on the same stale cost, so the process stayed plain for
    good (the last 550 rounds). A k not timed for STALE_ROUNDS rounds
    is judged after a look on the lowest cost measured for it and timed afresh: the process
    drafts again."""
    policy = _near_break_even(0.0, 0.0, 0)
    policy.costs.here.discard(1)  # k = 1 to be timed by the run

    def cost(r: int, k: int) -> float:
        busy = 40 <= r < 50
        return 1.0 if k == 0 else (1.0 + k / 2) * (2.0 if busy else 1.0)

    ks = looking_simulation(policy, 0.7, cost, 600).ks
    # busy timings were booked: it drafted before and during the busy moment (from its first
    # look, after FIRST_LOOK plain rounds where its first two drafts were rejected)
    assert ks[10:40].count(1) >= 25 and ks[40:50].count(1) >= 3, ks[:50]
    assert ks[-200:].count(1) >= 150, Counter(ks[-200:])


def test_a_new_pair_that_looks_first_starts_plain_and_times_k1_after_its_first_look():
    """Where the loop looks before it leaps, a new pair (no costs, evidence at 0.5)
    decodes its first FIRST_LOOK rounds plainly (R(0) timed first), looks at the text then, and
    times k = 1 in step right after the look, next to R(0)'s timings: not on the first tokens
    after the prompt, often the hardest (the fresh benchmark's first three drafts were rejected
    in every run, and R(1) timed there ran 8% above the same process's later R(1) / R(0))."""
    from tinydraft_mlx.engine.policy import EXPLORE_TIMES, FIRST_LOOK

    policy = DraftLengthPolicy(4)
    policy.accepted[0], policy.rejected[0] = 2.0, 2.0
    run = looking_simulation(policy, 0.7, lambda r, k: 1.0 + k / 2, generations=1, tokens=128)
    # the loop chooses the round after a pipelined plain one while that one is decoded (before
    # it is booked): the look FIRST_LOOK plain rounds call for comes a round later
    first = FIRST_LOOK + 1
    assert run.ks[:first] == [0] * first, run.ks[:12]
    assert run.looked[0] == first and run.ks[first] > 0, (run.looked, run.ks[:12])
    assert all(k > 0 for k in run.ks[first : first + EXPLORE_TIMES]), run.ks[:16]
    assert sum(k > 0 for k in run.ks) >= 0.8 * len(run.ks), run.ks


def test_the_plain_start_does_not_force_a_look_on_every_generation():
    """The plain start holds only until the first look falls due; the look itself is the first
    look's rule's (once, whatever the evidence, before the policy has seen a text; afterwards
    only where a look is worth it). A warm process whose texts are hopeless never times a
    drafting round: taking the look in the start's own branch forced one every generation (80
    looks in 20 generations of 128 tokens, where the rule's own were 61 with a prompt's evidence
    at 0.5 booked every generation)."""
    run = looking_simulation(DraftLengthPolicy(4), 0.0, lambda r, k: 1.0 + k / 2,
                             generations=20, tokens=128)
    assert run.looks <= 65, run.looks
    assert not any(run.ks), Counter(run.ks)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_pair_whose_first_drafts_were_timed_in_a_busy_moment_drafts_again(seed):
    """A new pair (no costs, evidence at 0.5) whose first generation is too short
    for a first look (fewer than HORIZON tokens after it): its first three rounds draft k = 1,
    then plain rounds measure R(0). The machine is busy for that generation (every round at 2x:
    R(1) booked at 3, R(0)'s first estimate at 2), and the next generation's first 40 tokens are
    hard (nothing accepted: its first look finds plain decoding better), then k = 1 pays
    (acceptance 0.7, a round at 1.5 plain ones). R(0) follows the machine back to 1 while R(1)
    stays at its busy 3: a stale cost is judged at its lowest R(1) / R(0), but the first drafts
    were timed before R(0) had been, so there was none, and the process stayed plain for good
    (the last 300 rounds, every seed). Their ratio over R(0)'s first estimate (1.5) lets a later
    look time k = 1 afresh."""
    policy = DraftLengthPolicy(4)
    policy.accepted[0], policy.rejected[0] = 4.0, 4.0
    busy = [True]

    def cost(r: int, k: int) -> float:
        return (1.0 if k == 0 else 1.0 + k / 2) * (2.0 if busy[0] else 1.0)

    short = looking_simulation(policy, 0.0, cost, generations=1, tokens=24, seed=seed).ks
    assert short[:4] == [1, 1, 1, 0], short[:4]
    assert policy.costs.best_ratio[1] == pytest.approx(1.5), policy.costs.best_ratio
    busy[0] = False
    ks = looking_simulation(policy, lambda r: 0.0 if r < 40 else 0.7, cost, 600, seed=seed).ks
    assert sum(k > 0 for k in ks[-300:]) >= 250, Counter(ks[-300:])


@pytest.mark.parametrize("alpha", [0.0, 0.4, 0.7])
def test_a_plain_choice_holds_for_a_few_rounds_as_if_made_every_round(alpha, monkeypatch):
    """`choose` makes its full choice in a plain stretch every HOLD_ROUNDS rounds (10-40 us of
    Python, 3-4x that in the decode loop on a busy 2-core CPU: ~1% of a plain round); between
    them a budgeted probe and a generation's first look are taken the round they fall due, and
    a drafting round or new evidence ends the hold. Driven with the hold and without it
    (HOLD_ROUNDS = 1) on the same draws, 20 generations of 128 tokens: where drafting pays
    (alpha 0.7) every round's k and every look are the same; where a look's slowly growing
    value decides when to look (near break-even, alpha 0.4, and where the draft is hopeless,
    alpha 0, whose budgeted probes wait for the evidence to fade: `_probe_share`) the looks
    move by a few rounds, as many of them, tokens per second within 1%. Where the draft is
    hopeless the full choice is made in under a third of the rounds. The probes that found
    nothing new slow the next ones (`FRUITLESS_SLOWING`, tested below): a look moved by a round
    then moves every later one, so the hold is compared without that slowing."""
    from tinydraft_mlx.engine import policy as policy_module

    monkeypatch.setattr(policy_module, "FRUITLESS_SLOWING", 0.0)
    full = Counter()
    choose = DraftLengthPolicy._choose

    def counted(self, *args):
        full[policy_module.HOLD_ROUNDS] += 1
        return choose(self, *args)

    monkeypatch.setattr(DraftLengthPolicy, "_choose", counted)
    hold = policy_module.HOLD_ROUNDS
    assert hold > 1
    runs = {}
    for rounds in (1, hold):
        monkeypatch.setattr(policy_module, "HOLD_ROUNDS", rounds)
        runs[rounds] = [looking_simulation(_near_break_even(0.0, 0.0, 0), alpha,
                                           lambda r, k: 1.0 + k / 2, generations=20, tokens=128,
                                           catch_up=0.7, seed=seed) for seed in (1, 2, 3)]
    every, held = runs[1], runs[hold]
    if alpha == 0.7:
        assert [(run.ks, run.looked) for run in every] == [(run.ks, run.looked) for run in held]
    for a, b in zip(every, held):
        assert abs((b.tokens / b.seconds) / (a.tokens / a.seconds) - 1) <= 0.01
        if alpha == 0.0:
            assert len(a.looked) == len(b.looked)
            assert all(0 <= y - x < hold for x, y in zip(a.looked, b.looked))
    if alpha == 0.0:
        assert full[hold] < sum(len(run.ks) for run in held) / 3 < full[1], full


@pytest.mark.parametrize("spoil", [1.5, 2.5])
@pytest.mark.parametrize("prompt", [0, 20])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_cost_timed_in_a_pairs_bad_first_rounds_is_timed_again_in_later_generations(seed,
                                                                                      prompt,
                                                                                      spoil):
    """A warm process (generations of 128 tokens, the loop looks before it leaps) whose pair
    timed its first k = 1 rounds at 1.5x their cost (a pair's first rounds on the demo pair,
    CPU: 2.1x a plain round where a run costs 1.6x): R(1) = 2.25 plain rounds, and at an
    acceptance of 0.9 (1.9 tokens a round) plain decoding wins on it, where k = 1 really pays
    1.27x (a round costs 1.5; k = 2 costs 2.7 and pays less). The look that would time it
    afresh was never taken: it judges a stale k at the lowest ratio measured for it, the same
    bad timings, and the probe budget, restarted every generation, never caught up with the
    look's catch-up, which grows with the plain stretch (here 1 + 0.03 plain rounds a round
    behind, faster than 2% of a plain round): every later generation decoded all its tokens
    plainly. Now the budget runs on across generations, and a budgeted probe whose look finds
    the first position promising drafts the stale k EXPLORE_TIMES times, so it is timed
    afresh. Also where the first timings were 2.5x dear (two of four pairs timed R(1) at 4.2-6.7
    ms where a run costs ~2.4, demo pair, CPU): a re-time that also asked whether the look's
    acceptance could pay at 0.8 of the lowest ratio measured never came, nor one asking that
    only after a re-timing had found the cost as before (it found the first generation's)."""
    costs = {0: 1.0, 1: 1.5, 2: 2.7, 3: 3.9, 4: 5.1}
    spoiled = [spoil]
    policy = DraftLengthPolicy(4)
    policy.accepted[0], policy.rejected[0] = 2.0, 2.0

    def cost(r: int, k: int) -> float:
        return costs[k] * (spoiled[0] if k else 1.0)

    def catch_up(behind: int) -> float:
        return 1.0 + 0.03 * behind

    looking_simulation(policy, 0.9, cost, generations=1, tokens=128, seed=seed,
                       catch_up=catch_up, prompt=prompt)
    assert policy.round_seconds[1] == pytest.approx(1.5 * spoil)  # the bad timings stand
    spoiled[0] = 1.0
    later = looking_simulation(policy, 0.9, cost, generations=6, tokens=128, seed=seed + 1,
                               catch_up=catch_up, prompt=prompt)
    assert policy.round_seconds[1] == pytest.approx(1.5)  # timed afresh
    assert sum(k > 0 for k in later.ks) >= 0.5 * len(later.ks), Counter(later.ks)
    # what the best fixed k (k = 1, 1.9 tokens a round at 1.5) would do, within 10%
    assert later.tokens / later.seconds >= 0.9 * 1.9 / 1.5, later.tokens / later.seconds


def test_a_look_before_a_generations_fill_is_priced_as_the_fill():
    """Where the draft starts a generation empty (`empty`: the prompt tokens its first
    catch-up will feed too), a look before that catch-up costs the fill, not a switch's
    catch-up on the plain rounds alone (demo pair, CPU: fills of 3.3-7.6 ms where a switch was
    priced 2.5-4): its price is at least the latest fill's time per token times the tokens it
    will feed; the fill, booked, sets that time per token and leaves the draft fed."""
    policy = _near_break_even(0.0, 8.0, 4)
    policy.looks = True
    switch = policy._switch_price()
    policy.empty = 100
    assert policy._switch_price() == switch  # no fill measured yet
    policy.update(0, 0, 1.0, catch_up=5.2, filled=True)  # fed 100 + 4 tokens in 5.2 s
    assert policy.costs.fill_per_token == pytest.approx(0.05) and policy.empty == 0
    assert policy._switch_price() < 2.0  # fed: a switch's price again
    policy.empty, policy.behind = 100, 10
    assert policy._switch_price() == pytest.approx(0.05 * 110)


def _fill(fed: int) -> float:
    """A catch-up's seconds for `fed` tokens: a fixed part and a part per token (demo pair,
    CPU, in plain rounds of ~1.7 ms: a 20-token fill 1.9 rounds, a look after 68 plain
    rounds 2.4)."""
    return 1.2 + 0.02 * fed


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculation_tried_by_a_new_pairs_first_look_restarts_the_probe_budget(seed):
    """A draft always rejected, new to a process whose plain rounds are timed (a warm process's
    second pair): its first look, which times k = 1 if the text says so, is speculation tried
    like a probe's. It did not restart the probe budget, so the round after the look, which
    found the draft hopeless, spent that budget on a whole drafting round: ten looks in twelve
    generations, every second one two rounds after the one before (the loop chooses a round
    ahead). Now only looks that the budget or the evidence call for are taken (six)."""
    policy = DraftLengthPolicy(4)
    cost = lambda r, k: 1.0 + 0.9 * k  # noqa: E731  (drafting never pays: always rejected)
    looking_simulation(policy, 0.0, cost, generations=2, seed=seed, catch_up=_fill, prompt=20)
    run = looking_simulation(policy, 0.0, cost, generations=12, seed=seed + 10,
                             catch_up=_fill, prompt=20)
    gaps = [b - a for a, b in zip(run.looked, run.looked[1:])]
    assert min(gaps) > FIRST_LOOK, run.looked
    assert run.looks <= 7, run.looked
    assert set(run.ks) == {0}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_generation_whose_draft_starts_empty_looks_after_its_first_tokens_or_drafts(seed):
    """The draft starts each generation empty (`empty`: its first catch-up, a fill, feeds the
    prompt too) and the loop's first round is plain. A warm pair whose draft became always
    rejected (after a generation at acceptance 0.7) spent the probe budget on the second
    round of every generation: a fill whose evidence is one generated token, then in-step
    draws on that thin evidence drafted rejected rounds. Now a look on an empty draft waits
    for FIRST_LOOK plain rounds (the same fill, eight tokens of evidence) unless drafting pays
    at the means: no generation looks in its first rounds and the process runs within 1% of
    plain decoding (0.985 before). Where drafting pays (acceptance 0.9, k = 2 1.23x plain
    decoding), every generation still drafts from its second round."""
    cost = lambda r, k: 1.0 + 0.9 * k  # noqa: E731
    policy = DraftLengthPolicy(4)
    looking_simulation(policy, 0.7, cost, generations=2, seed=seed, catch_up=_fill, prompt=20)
    for generation in range(12):
        run = looking_simulation(policy, 0.0, cost, generations=1, seed=seed + generation,
                                 catch_up=_fill, prompt=20)
        assert not run.looked or run.looked[0] >= FIRST_LOOK, (generation, run.looked)
        assert run.tokens / run.seconds >= 0.96, (generation, run.ks)  # one look at most
    paying = DraftLengthPolicy(4)
    cheaper = lambda r, k: 1.0 + 0.6 * k  # noqa: E731
    looking_simulation(paying, 0.9, cheaper, generations=2, seed=seed, catch_up=_fill, prompt=20)
    for generation in range(6):
        run = looking_simulation(paying, 0.9, cheaper, generations=1, seed=seed + generation,
                                 catch_up=_fill, prompt=20)
        assert run.looked[0] == 1 and run.ks[1] > 0, (generation, run.ks[:8])


@pytest.mark.parametrize("draft_ratio", [0.1, 0.25])
def test_an_always_rejected_draft_is_looked_at_on_the_budget_not_on_every_fade(draft_ratio):
    """A draft always rejected, new to a warm process (the loop looks first; the draft starts
    each generation empty): its first look found it hopeless, so k = 1 was never timed and its
    cost is the optimistic extrapolation R(0) * (1 + draft_ratio). Two rules then took a look
    each time PLAIN_DECAY faded the evidence to a mean acceptance of ~0.3, about once a
    generation: the means at that hoped cost (E(1) = 1.1 tokens for 1.1 plain rounds where the
    draft's prefill is a tenth of the target's) and the exploring of an untimed k = 1 while the
    evidence is thin. Behind the target, drafting at a hoped cost must now repay its catch-up
    over the tokens a look's finding holds for, and where the loop looks first an untimed k is
    explored once a look has found the first position promising: looks come from the probe
    budget, and the process runs within 1% of plain decoding (0.980 and 0.985 before)."""
    cost = lambda r, k: 1.0 + 0.9 * k  # noqa: E731
    policy = DraftLengthPolicy(4, draft_ratio=draft_ratio)
    looking_simulation(policy, 0.0, cost, generations=2, catch_up=_fill, prompt=20)
    run = looking_simulation(policy, 0.0, cost, generations=12, catch_up=_fill, prompt=20)
    assert set(run.ks) == {0}
    assert run.looks <= 7, run.looked
    assert run.tokens / run.seconds >= 0.99, run.looked


def _nothing_pays(r: int, k: int) -> float:
    """Round costs where k = 1 loses at acceptance 0.6 (1.6 tokens for 1.9 plain rounds)."""
    return 1.0 + 0.9 * k


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_probes_that_find_nothing_new_are_spaced_out(seed, monkeypatch):
    """A warm process where drafting never pays (acceptance 0.6, k = 1 at 1.9 plain rounds; the
    demo pair at T = 0.7 is such a case): every budgeted probe (a look, then EXPLORE_TIMES rounds
    re-timing the stale k, then drafting while in-step draws allow) confirms what the policy
    knew, and at probe_budget (2%) of the plain time they cost about 2%, with the loop's own
    overhead more than the 0.98x of plain decoding asked where nothing pays. Probes that found
    nothing new (no round that paid, no cost moved by more than PROBE_CHANGE) slow the next
    ones, the budget over 1 + FRUITLESS_SLOWING per such probe in a row, counted up to
    FRUITLESS_CAP. Over 30 generations of 128 tokens, against the same policy without the
    slowing on the same draws: after the first five, under two thirds of the looks and of the
    rounds drafted, and more tokens per second."""
    from tinydraft_mlx.engine import policy as policy_module

    runs = {}
    for slowing in (0.0, policy_module.FRUITLESS_SLOWING):
        monkeypatch.setattr(policy_module, "FRUITLESS_SLOWING", slowing)
        policy = DraftLengthPolicy(4, draft_ratio=0.25)
        run = looking_simulation(policy, 0.6, _nothing_pays, generations=30, catch_up=_fill,
                                 prompt=20, seed=seed)
        late = 5 * 128  # rounds, about: a plain round a token
        runs[slowing] = (run, sum(1 for r in run.looked if r >= late),
                         sum(1 for k in run.ks[late:] if k), policy.fruitless)
    (base, base_looks, base_drafted, _), (slow, looks, drafted, fruitless) = runs.values()
    assert fruitless == policy_module.FRUITLESS_CAP
    assert looks < 2 / 3 * base_looks, (looks, base_looks)
    assert drafted < 2 / 3 * base_drafted, (drafted, base_drafted)
    assert slow.tokens / slow.seconds > base.tokens / base.seconds


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("generations", [5, 20, 50])
def test_a_cost_that_drops_after_fruitless_probes_is_found_within_a_few_generations(
        seed, generations):
    """The price of spacing probes out: a change only a probe can find (a drafting round's cost
    falls, R(0) staying the same: k = 1 from 1.9 to 1.5 plain rounds, where at acceptance 0.6 it
    then pays 7%) after `generations` generations in which no probe found anything. The slowing
    is capped (FRUITLESS_CAP: probes at most 3x further apart), so drafting takes over within five
    generations (640 rounds) in every seed (without the slowing: within 348 rounds, median 15-89;
    with it: median ~200); uncapped, after 50 such generations it took up to 1111 rounds."""
    change = generations * 128

    def cost(r: int, k: int) -> float:
        return 1.0 + (0.5 if r >= change else 0.9) * k

    policy = DraftLengthPolicy(4, draft_ratio=0.25)
    run = looking_simulation(policy, 0.6, cost, generations=generations + 6, catch_up=_fill,
                             prompt=20, seed=seed)
    ks = run.ks
    found = next((i - change for i in range(change, len(ks) - 64)
                  if sum(1 for k in ks[i:i + 64] if k) >= 32), None)
    assert found is not None and found <= 5 * 128, found
