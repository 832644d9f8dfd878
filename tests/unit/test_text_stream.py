from __future__ import annotations

from worker.text_stream import TextStream


def feed_all(stream: TextStream, pieces: list[bytes]) -> list[str]:
    return [stream.feed(p) for p in pieces] + [stream.flush()]


def test_split_utf8_character_is_released_whole() -> None:
    euro = "€".encode()
    out = feed_all(TextStream(stop=[]), [b"a", euro[:1], euro[1:2], euro[2:], b"b"])
    assert out == ["a", "", "", "€", "b", ""]


def test_stop_sequence_across_tokens_is_cut() -> None:
    stream = TextStream(stop=["END"])
    out = feed_all(stream, [b"hello E", b"N", b"D and more"])
    assert "".join(out) == "hello "
    assert stream.stopped
    assert stream.text == "hello "


def test_text_that_only_looks_like_a_stop_is_released() -> None:
    stream = TextStream(stop=["END"])
    assert stream.feed(b"EN") == ""
    assert stream.feed(b"ough") == "ENough"
    assert not stream.stopped


def test_earliest_of_several_stops_wins() -> None:
    stream = TextStream(stop=["b", "a"])
    assert "".join(feed_all(stream, [b"xxab"])) == "xx"
