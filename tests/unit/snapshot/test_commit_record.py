"""The memory tiers' commit record: one format, written and read by one class
(resilient.snapshot.commits.CommitRecord); an authenticated document that is not a
well-formed record is left out, never half-read."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resilient.snapshot.commits import LOCAL, REPLICATED, CommitRecord, commit_key, union_holders

nodes = st.lists(st.text(min_size=1, max_size=8), max_size=4, unique=True)
records = st.builds(
    CommitRecord,
    step=st.integers(0, 2**40), attempt=st.text(min_size=1, max_size=20), world=st.integers(1, 64),
    holders=st.dictionaries(st.integers(0, 63).map(str), nodes, max_size=8),
    k=st.integers(0, 8), time=st.floats(0, 2e9), epoch=st.integers(0, 1000))


@given(records)
def test_a_record_reads_back_as_written_through_json(rec):
    assert CommitRecord.from_doc(json.loads(json.dumps(rec.to_doc()))) == rec


def test_the_tier_is_named_by_the_copies_beyond_the_first():
    assert CommitRecord(3, "g-000001", 2, k=0).tier == "local"
    assert CommitRecord(3, "g-000001", 2, k=1).tier == "peer"


def test_a_record_without_time_or_k_reads_as_the_oldest_local_commit():
    rec = CommitRecord.from_doc({"step": 4, "attempt": "g-000001", "world": 2, "holders": {"0": ["a"]}})
    assert rec == CommitRecord(4, "g-000001", 2, {"0": ["a"]}, k=0, time=math.inf, epoch=0)


def test_a_malformed_document_is_no_record():
    good = {"step": 4, "attempt": "g-000001", "world": 2, "holders": {"0": ["a"], "1": ["b"]}}
    for bad in ({k: v for k, v in good.items() if k != "holders"}, {**good, "step": "four"},
                {**good, "attempt": 7}, {**good, "holders": ["a"]}, {**good, "holders": {"0": "a"}},
                {**good, "holders": {"0": [1]}}, {**good, "world": None}, {**good, "time": "noon"}):
        assert CommitRecord.from_doc(bad) is None, bad
    assert CommitRecord.from_doc({**good, "epoch": "x"}).epoch == -1   # said badly: no epoch admits it


def test_holders_are_united_each_node_once_in_the_order_first_seen():
    into = {"0": ["a"], "1": ["b"]}
    union_holders(into, {"0": ["c", "a"], "2": ["d"]})
    assert into == {"0": ["a", "c"], "1": ["b"], "2": ["d"]}


def test_a_tier_outside_the_two_records_is_refused():
    """A misspelt tier would read nothing and write where nobody looks (bench/scale.py still
    polled the records' old name, 'memory', and waited out its timeout)."""
    assert commit_key("run", LOCAL, 7) == "/resilient/run/commit/local/000000000007"
    assert commit_key("run", REPLICATED, 7) == "/resilient/run/commit/replicated/000000000007"
    with pytest.raises(ValueError, match="not 'memory'"):
        commit_key("run", "memory", 7)
