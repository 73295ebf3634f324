"""k="auto"'s policy, by behaviour: against simulated rounds whose acceptance and costs are known,
its throughput is compared with the best fixed choice computed independently here (a closed
form of Leviathan et al.'s expected tokens, not the policy's own), and its choices with what the
situation calls for. No constant or private name of the policy is pinned."""

from __future__ import annotations

import random

import pytest

from tinydraft_mlx.engine.policy import Acceptance, RoundCosts, choose

MAX_K = 8


def _best_fixed(alpha: float, cost) -> tuple[int, float]:
    """The best fixed k and its tokens per second: E(k) = sum_{i<=k} alpha^i (geometric)."""
    rates = {k: sum(alpha ** i for i in range(k + 1)) / cost(k) for k in range(MAX_K + 1)}
    best = max(rates, key=rates.get)
    return best, rates[best]


def _simulate(alpha: float, cost, rounds: int = 1500, seed: int = 0,
              noise: float = 0.05) -> tuple[float, list[int]]:
    """The policy's tokens per second over `rounds` simulated rounds: each drafted token is
    accepted with probability alpha while the earlier ones were; a round drafting k costs
    cost(k), measured with +-noise jitter. Returns (rate, the ks chosen)."""
    rng = random.Random(seed)
    costs, acceptance = RoundCosts(), Acceptance()
    tokens = seconds = 0.0
    chosen = []
    for _ in range(rounds):
        k = choose(costs, [acceptance], MAX_K)
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        spent = cost(k) * (1 + rng.uniform(-noise, noise))
        costs.update(k, spent)
        if k:
            acceptance.update(k, n)
        tokens += n + 1
        seconds += cost(k)
        chosen.append(k)
    return tokens / seconds, chosen


def _apple(k: int) -> float:
    return 1.0 + 0.1 * k  # verify of k + 1 ~ one step, a cheap draft (Apple silicon's shape)


def _cpu(k: int) -> float:
    return 1.0 + 0.8 * k  # verify of k + 1 ~ k + 1 steps (this CPU's shape)


@pytest.mark.parametrize("alpha, cost", [(0.9, _apple), (0.7, _apple), (0.95, _cpu),
                                         (0.6, _apple)])
def test_auto_keeps_up_with_the_best_fixed_k(alpha, cost):
    """Where drafting pays, k="auto" gets within 10% of the best fixed k's throughput (the
    issue's bar for a pair it has just met; here from nothing, over 1500 rounds with 5% timing
    noise), and drafts more where acceptance is high and costs are flat."""
    rate, chosen = _simulate(alpha, cost)
    best_k, best = _best_fixed(alpha, cost)
    assert best_k > 0
    assert rate >= 0.9 * best, (rate, best, best_k)
    later = chosen[len(chosen) // 2 :]
    assert abs(sum(later) / len(later) - best_k) <= max(1.5, 0.4 * best_k), (best_k, later[:40])


@pytest.mark.parametrize("cost", [_apple, _cpu])
def test_auto_stops_drafting_where_nothing_is_accepted(cost):
    """A draft that is never accepted: after its first tries k="auto" decodes plainly, probing
    less and less often; over 1500 rounds it stays within 3% of plain decoding's throughput."""
    rate, chosen = _simulate(0.0, cost)
    assert rate >= 0.97 * 1.0, rate
    drafting = [i for i, k in enumerate(chosen) if k]
    assert len(drafting) <= 30, drafting
    gaps = [b - a for a, b in zip(drafting, drafting[1:])][-3:]
    assert gaps == sorted(gaps) and gaps[-1] >= 64, drafting


def test_auto_finds_drafting_again_when_the_text_turns_predictable():
    """Acceptance 0 for 300 rounds, then 0.95 (a file being copied): the policy's probes find
    the change and it drafts again within a few hundred rounds."""
    rng = random.Random(1)
    costs, acceptance = RoundCosts(), Acceptance()
    found = None
    for i in range(1500):
        alpha = 0.0 if i < 300 else 0.95
        k = choose(costs, [acceptance], MAX_K)
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        costs.update(k, _apple(k))
        if k:
            acceptance.update(k, n)
        if i >= 300 and k >= 2 and found is None:
            found = i
    assert found is not None and found < 300 + 600, found


def test_a_batch_drafts_for_its_rows_together():
    """One k for a batch's rows: rows that all accept drafts well get drafting, rows that never
    accept get plain rounds, and a mixed batch is judged on the sum of its rows' expected
    tokens (Leviathan's E per row): here the one good row among useless ones does not pay for
    the batch's drafting rounds."""
    def trained(alpha: float) -> Acceptance:
        a = Acceptance()
        rng = random.Random(2)
        for _ in range(200):
            n = 0
            while n < 4 and rng.random() < alpha:
                n += 1
            a.update(4, n)
        return a

    costs = RoundCosts()
    for k in range(MAX_K + 1):
        for _ in range(3):
            costs.update(k, 1.0 + 0.3 * k)
    good, bad = trained(0.95), trained(0.0)
    assert choose(costs, [good, good, good, good], MAX_K) >= 3
    assert choose(costs, [bad, bad, bad, bad], MAX_K) == 0
    assert choose(costs, [good, bad, bad, bad], MAX_K) == 0


def test_acceptance_estimates_follow_the_observed_rates():
    """Per-position estimates against the observed frequencies, counted independently here."""
    rng = random.Random(3)
    a = Acceptance()
    reached, accepted = [0, 0, 0], [0, 0, 0]
    for _ in range(400):
        n = 0
        while n < 3 and rng.random() < [0.9, 0.6, 0.3][n]:
            n += 1
        a.update(3, n)
        for i in range(min(n + 1, 3)):
            reached[i] += 1
            accepted[i] += i < n
    means = a.means()
    for i, truth in enumerate([0.9, 0.6, 0.3]):
        assert abs(means[i] - truth) < 0.15, (i, means[i], accepted[i] / reached[i])


def test_a_limit_caps_the_choice():
    costs = RoundCosts()
    for k in range(MAX_K + 1):
        for _ in range(3):
            costs.update(k, 1.0 + 0.05 * k)
    a = Acceptance()
    for _ in range(100):
        a.update(8, 8)
    assert choose(costs, [a], MAX_K) >= 6
    assert choose(costs, [a], 2) <= 2
    assert choose(costs, [a], 0) == 0


@pytest.mark.parametrize("extra", [0, 1])
def test_pipelined_plain_rounds_booked_unevenly_cost_what_they_take(extra):
    """On MLX's CPU backend a read waits for the plain round queued behind it, so pipelined
    rounds' timings alternate ~2R and ~0: R(0) must still come out ~R (their median was ~0
    when the short ones were the majority, and plain decoding then looked 20x cheaper than it
    is, so a draft accepted 90% of the time was never used)."""
    r = 0.004
    costs = RoundCosts()
    for i in range(14 + extra):
        costs.update(0, 2 * r * 0.98 if i % 2 == 0 else r * 0.02)
    assert abs(costs.cost(0) - r) < 0.1 * r, costs.cost(0)
    costs.update(0, 10 * r)  # an outlier moves it little
    assert abs(costs.cost(0) - r) < 0.15 * r, costs.cost(0)


def test_what_auto_has_learned_is_said_in_one_sentence():
    """`explain` (printed by `--verbose`): plain rounds of 4 ms, k = 1 rounds of 8 ms and a
    first draft accepted half the time (49 of 98, Beta(1, 1) prior: 0.5) make a k = 1 round emit
    1.5 tokens in twice a plain round's time, 0.75x plain: drafting does not pay. With k = 1
    rounds of 5 ms and 0.9 acceptance (89 of 98: 0.9) a round emits 1.9 tokens in 1.25x the
    time, 1.52x plain: it drafts k = 1. Before a drafting round is timed there is nothing to
    say."""
    from tinydraft_mlx.engine.policy import DraftLengthPolicy, explain

    def policy(k1_seconds: float, accepted: float) -> DraftLengthPolicy:
        p = DraftLengthPolicy()
        costs = p.round_costs(1)
        for _ in range(4):
            costs.update(0, 0.004)
            costs.update(1, k1_seconds)
        held = p.acceptance("greedy")
        held.accepted[0], held.reached[0] = accepted, 98.0
        return p

    slow = explain(policy(0.008, 49.0), "greedy")
    assert "plain round costs 4.0 ms and a k = 1 round 8.0 ms" in slow
    assert "accepted 50% of the time" in slow and "does not pay here (0.75x plain" in slow
    fast = explain(policy(0.005, 89.0), "greedy")
    assert "accepted 90%" in fast and "will draft k = 1 (1.52x plain" in fast
    assert explain(DraftLengthPolicy(), "greedy") is None


def test_drafting_chosen_on_a_slow_start_is_checked_against_plain_decoding_again():
    """Drafting that does not pay (acceptance 0.6, a verify of k + 1 costing k + 1 steps' worth
    as on this CPU) chosen because the first plain rounds ran 1.6x slower than plain rounds do
    later (the rounds after a prompt): its probes of plain decoding find it out, and over 1500
    rounds k="auto" stays within 5% of plain decoding's throughput (without them: 0.88x)."""
    rng = random.Random(2)
    costs, acceptance = RoundCosts(), Acceptance()
    tokens = seconds = 0.0
    plain_rounds = 0
    chosen = []
    for _ in range(1500):
        k = choose(costs, [acceptance], MAX_K)
        n = 0
        while n < k and rng.random() < 0.6:
            n += 1
        spent = _cpu(k) * (1.6 if k == 0 and plain_rounds < 3 else 1.0)
        plain_rounds += k == 0
        costs.update(k, spent)
        if k:
            acceptance.update(k, n)
        tokens += n + 1
        seconds += spent
        chosen.append(k)
    assert any(chosen[:100]), "the slow start made drafting look better"
    assert tokens / seconds >= 0.95, tokens / seconds
    assert chosen[-200:].count(0) > 180
