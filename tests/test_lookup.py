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


def test_hybrid_chooses_the_source_that_has_been_accepted():
    """Which source a hybrid round uses: lookup first, the model once lookup is rejected, lookup
    again after RETRY model rounds or when its latest round was accepted whole; a round without
    a match always drafts with the model."""
    from tinydraft_mlx import Hybrid
    from tinydraft_mlx.engine.drafters import HybridDraft

    seq = [1, 2, 3, 4, 5, 6, 1, 2]  # the suffix (1, 2) continues 3, 4, 5, ...
    hybrid = HybridDraft(Hybrid(lambda *a, **kw: None))
    hybrid.begin(seq, None)

    def round_(accepted: int) -> str:
        """One round: its source, given how many of its proposal were accepted."""
        start = len(seq)
        source = "lookup" if hybrid.host_proposal(3) is not None else "model"
        hybrid.rollback(start + accepted)
        return source

    assert round_(0) == "lookup"  # untried: lookup first (it costs no draft forwards)
    assert round_(2) == "model"  # rejected: the model is tried
    assert [round_(2) for _ in range(HybridDraft.RETRY - 1)] == ["model"] * (
        HybridDraft.RETRY - 1)  # lookup's record (0) is below the model's (2)
    assert round_(3) == "lookup"  # RETRY model rounds: lookup again, accepted whole
    assert round_(3) == "lookup"  # a copy goes on while it is accepted whole
    assert round_(0) == "lookup"  # ... (its recent mean 2.25 >= the model's 2)
    assert round_(1) == "model"  # now below: the model
    seq[-1] = 99  # no earlier occurrence of the suffix: the model, whatever the record
    assert hybrid.host_proposal(3) is None
