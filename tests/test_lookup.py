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
