"""Learned prefixes: uses, hits and misses per document prefix, bounded (pure logic: fakeredis)."""

from __future__ import annotations

import fakeredis

from shared.prefix_usage import PrefixUsage, prefix_id
from shared.schemas import DocumentFields, WarmItem


def doc(text: str) -> DocumentFields:
    return DocumentFields(document=text, instructions="Extract.")


def test_most_used_prefixes_first_with_hits_and_misses() -> None:
    usage = PrefixUsage(fakeredis.FakeRedis())
    for _ in range(3):
        usage.record(doc("A"), None, hit=True)
    usage.record(doc("B"), "tenant", hit=False)
    usage.record(doc("B"), "tenant", hit=True)
    usage.record(doc("C"), None, hit=False)
    top = usage.top(10, min_uses=2)
    assert [(p.item.document, p.namespace, p.uses, p.hits, p.misses) for p in top] == [
        ("A", None, 3, 3, 0),
        ("B", "tenant", 2, 1, 1),
    ]
    assert top[0].id == prefix_id(WarmItem(document="A", instructions="Extract."), None)


def test_the_same_document_in_another_namespace_is_another_prefix() -> None:
    assert prefix_id(doc("A"), None) != prefix_id(doc("A"), "tenant")
    assert prefix_id(doc("A"), None) == prefix_id(WarmItem(name="x", **doc("A").model_dump()), None)


def test_least_used_prefixes_are_dropped_beyond_the_bound() -> None:
    redis = fakeredis.FakeRedis()
    usage = PrefixUsage(redis, max_prefixes=2)
    for text, uses in (("A", 3), ("B", 2), ("C", 1)):
        for _ in range(uses):
            usage.record(doc(text), None, hit=False)
    assert [p.item.document for p in usage.top(10)] == ["A", "B"]
    assert len(redis.keys("granary:prefixes:*")) == 3  # the sorted set and two records
