"""Prompt-lookup proposals: the latest earlier occurrence of the longest matching suffix."""

import pytest

from tinydraft_mlx import ParameterError, PromptLookup


def propose(seq, k, **kw):
    return PromptLookup(**kw).index(seq).propose(k)


def test_continuation_of_the_latest_longest_match():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    seq = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # suffix (1, 2, 3) occurs at 0..2 -> continuation 4, 5, 9
    assert propose(seq, 3) == [4, 5, 9]
    # with trigrams off, the latest bigram (2, 3) is at 6..7 -> 7, 8
    assert propose(seq, 2, max_ngram=2) == [7, 8]
    assert propose(seq, 10) == seq[3:13]  # runs up to the end of the sequence


def test_no_match_and_no_self_match():
    assert propose([1, 2, 3, 4], 4) == []
    assert propose([5], 4) == []
    assert propose([7, 7], 3, min_ngram=1) == [7]  # unigram (7,) seen at 0, continuation 7
    assert propose([7, 7], 3) == []  # bigram (7, 7) has no earlier occurrence


def test_index_follows_a_growing_sequence():
    seq = [1, 2, 3]
    index = PromptLookup().index(seq)
    assert index.propose(2) == []
    seq += [1, 2]
    assert index.propose(2) == [3, 1]
    seq += [8, 1, 2]
    assert index.propose(2) == [8, 1]  # the latest occurrence wins


@pytest.mark.parametrize("kw", [dict(min_ngram=0), dict(max_ngram=1, min_ngram=2)])
def test_bad_settings(kw):
    with pytest.raises(ParameterError):
        PromptLookup(**kw)


def test_hybrid_chooses_the_source_that_gives_more_tokens_per_second(monkeypatch):
    """Which source a hybrid round uses, by its recent tokens per second (a fake clock): lookup
    first, the model once tried, then whichever has given more; lookup again after RETRY model
    rounds; a round without a match always drafts with the model."""
    import tinydraft_mlx.engine.drafters.sources as drafters
    from tinydraft_mlx import Hybrid
    from tinydraft_mlx.engine.drafters import HybridDraft

    clock = [0.0]
    monkeypatch.setattr(drafters.time, "perf_counter", lambda: clock[0])
    seq = [1, 2, 3, 4, 5, 6, 1, 2]  # the suffix (1, 2) continues 3, 4, 5, ...
    hybrid = HybridDraft(Hybrid(lambda *a, **kw: None))
    hybrid.begin(seq)

    def round_(accepted: int, seconds: float) -> str:
        """One round: its source, given how many of its proposal were accepted in what time."""
        start = len(seq)
        source = "lookup" if hybrid.host_proposal(3) is not None else "model"
        clock[0] += seconds
        hybrid.settle(start + accepted)
        return source

    assert round_(0, 0.01) == "lookup"  # untried: lookup first: 1 token in 10 ms, 100/s
    assert round_(2, 0.02) == "model"  # untried: 3 tokens in 20 ms, 150/s
    assert [round_(2, 0.02) for _ in range(HybridDraft.RETRY - 1)] == ["model"] * (
        HybridDraft.RETRY - 1)  # lookup's 100/s < the model's 150/s
    assert round_(3, 0.01) == "lookup"  # RETRY model rounds: lookup again: 250/s
    assert round_(3, 0.01) == "lookup"  # 325/s
    assert [round_(0, 0.01) for _ in range(3)] == ["lookup"] * 3  # 212.5/s, 156.25/s, 128/s
    assert round_(2, 0.02) == "model"  # below the model's 150/s
    # a model that pays less than the copies: lookup, although often rejected
    assert round_(0, 0.05) == "model"  # 2 tokens in 35 ms: 57/s
    assert round_(1, 0.01) == "lookup"
    seq[-1] = 99  # no earlier occurrence of the suffix: the model, whatever the record
    assert hybrid.host_proposal(3) is None
