"""methods/padding.py: phase groups of a left-padded batch, and the padded-batch check the method tests use."""

import pytest
import torch

from longctx_patch.methods.padding import check_left_padded, left_padding, phase_groups


def _mask(pads, S):
    m = torch.ones(len(pads), S, dtype=torch.bool)
    for r, p in enumerate(pads):
        m[r, :p] = False
    return m


def test_left_padding_counts_leading_pads_and_all_pad_rows():
    assert left_padding(_mask([0, 3, 7, 9], 9)).tolist() == [0, 3, 7, 9]


def test_one_group_without_padding_or_with_one_remainder():
    assert [(g.rows, g.trim) for g in phase_groups(None, 8)] == [(None, 0)]
    assert [(g.rows, g.trim) for g in phase_groups(_mask([1, 9, 17], 20), 8)] == [(None, 1)]


def test_groups_partition_the_rows_and_leave_whole_chunks_of_padding():
    pads, S, chunk = [0, 5, 13, 2, 21, 8], 30, 8
    m = _mask(pads, S)
    groups = phase_groups(m, chunk)
    rows = torch.cat([g.rows for g in groups]).sort().values
    assert rows.tolist() == list(range(len(pads)))
    x = torch.arange(len(pads) * S).view(len(pads), S)
    for g in groups:
        sub = g.take(m, 1)
        assert sub.shape == (len(g.rows), S - g.trim)
        assert all((pads[r] - g.trim) % chunk == 0 for r in g.rows.tolist())
        assert torch.equal(left_padding(sub), torch.tensor([pads[r] - g.trim for r in g.rows.tolist()]))
        assert torch.equal(g.take(x, 1), x[g.rows, g.trim:])


def test_holes_and_right_padding_are_refused():
    check_left_padded(_mask([0, 4], 6), "m")
    bad = torch.tensor([[True, True, False]])
    with pytest.raises(ValueError, match="left padding only"):
        check_left_padded(bad, "m")
