"""Exact tests of `IncrementalDetokenizer` on the tiny byte-level BPE test tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from tests.model_factory import make_tiny_tokenizer
from vllm.transformers_utils.tokenizer import get_tokenizer
from vllm.v1.engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "She ordered a café au lait and a croissant.",
    "日本語のテキストも少し含めます。東京は日本の首都です。",
    "Emoji make chats lively 🙂 🚀 🎉 and a flamingo 🦩 too!",
    "Mixed: naïve 日本語 🙂 ∑ → done",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = str(tmp_path_factory.mktemp("tiny_tokenizer"))
    make_tiny_tokenizer(path)
    return get_tokenizer(path)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def detok(tokenizer: Any, prompt: str | None = "Tell me:", stop: list[str] | None = None,
          include_stop: bool = False, skip_special_tokens: bool = True
          ) -> IncrementalDetokenizer:
    prompt_ids = tokenizer.encode(prompt) if prompt is not None else None
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens, stop or [],
                                  include_stop)


# ---- incremental decoding ------------------------------------------------------------------


def test_texts_split_multibyte_characters_across_tokens(tokenizer: Any) -> None:
    """The test texts really exercise partial characters (tokens decoding to U+FFFD)."""
    for text in TEXTS[1:]:
        ids = encode(tokenizer, text)
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids), text
        assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tokenizer: Any, text: str) -> None:
    ids = encode(tokenizer, text)
    d = detok(tokenizer)
    seen = []
    for token_id in ids:
        assert d.update([token_id], stop_terminated=False) is None
        seen.append(d.output_text)
        assert "\ufffd" not in d.output_text
        assert text.startswith(d.output_text)
    assert d.output_text == text
    assert d.token_ids == ids
    # Text only ever grows.
    assert all(a == b[:len(a)] for a, b in zip(seen, seen[1:], strict=False))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_chunks_of_tokens_equal_full_decode(tokenizer: Any, text: str, chunk: int) -> None:
    ids = encode(tokenizer, text)
    d = detok(tokenizer)
    for start in range(0, len(ids), chunk):
        d.update(ids[start:start + chunk], stop_terminated=False)
        assert "\ufffd" not in d.output_text
    assert d.output_text == text


@pytest.mark.parametrize("prompt", [None, "", "日本語のテキスト", "café"])
def test_prompt_priming_does_not_leak_into_the_output(tokenizer: Any,
                                                      prompt: str | None) -> None:
    text = " and then 日本語 🙂"
    d = detok(tokenizer, prompt=prompt)
    for token_id in encode(tokenizer, text):
        d.update([token_id], stop_terminated=False)
    assert d.output_text == text


def test_partial_character_is_held_until_complete(tokenizer: Any) -> None:
    ids = encode(tokenizer, "🦩")
    assert len(ids) > 1 and tokenizer.decode(ids[:1]).endswith("\ufffd")
    d = detok(tokenizer)
    for token_id in ids[:-1]:
        d.update([token_id], stop_terminated=False)
        assert d.output_text == ""
    d.update(ids[-1:], stop_terminated=False)
    assert d.output_text == "🦩"


def test_special_tokens_are_skipped_or_kept(tokenizer: Any) -> None:
    ids = encode(tokenizer, "Hello") + [tokenizer.bos_token_id] + encode(tokenizer, " world")
    skipped = detok(tokenizer)
    skipped.update(ids, stop_terminated=False)
    assert skipped.output_text == "Hello world"
    kept = detok(tokenizer, skip_special_tokens=False)
    kept.update(ids, stop_terminated=False)
    assert kept.output_text == "Hello<s> world"


def test_stop_terminated_token_is_not_decoded(tokenizer: Any) -> None:
    eos = tokenizer.eos_token_id
    ids = encode(tokenizer, "Hello world")
    d = detok(tokenizer, skip_special_tokens=False)
    d.update(ids, stop_terminated=False)
    d.update([eos], stop_terminated=True)
    assert d.output_text == "Hello world"
    assert d.token_ids == ids + [eos]
    # A stop token id that is ordinary text is dropped too, unless the stop is included.
    dot = encode(tokenizer, ".")
    assert len(dot) == 1
    d = detok(tokenizer)
    d.update(ids + dot, stop_terminated=True)
    assert d.output_text == "Hello world"
    d = detok(tokenizer, include_stop=True)
    d.update(ids + dot, stop_terminated=True)
    assert d.output_text == "Hello world."


def test_without_tokenizer_only_ids_are_tracked() -> None:
    d = IncrementalDetokenizer(None, [1, 2], True, ["x"], False)
    assert d.update([5, 6], stop_terminated=False) is None
    assert d.token_ids == [5, 6]
    assert d.output_text == ""
    assert d.decode_token(5) == ""


def test_decode_token(tokenizer: Any) -> None:
    d = detok(tokenizer)
    [token_id] = encode(tokenizer, ".")
    assert d.decode_token(token_id) == "."
    assert d.decode_token(tokenizer.eos_token_id) == "</s>"


# ---- stop strings ------------------------------------------------------------------------------


STOP_TEXT = "Hello world. STOP here"


def feed_until_stop(d: IncrementalDetokenizer, ids: list[int]) -> tuple[str | None, int]:
    """Feeds one token at a time; returns the stop string matched and tokens fed."""
    for n, token_id in enumerate(ids, 1):
        stop = d.update([token_id], stop_terminated=False)
        if stop is not None:
            return stop, n
    return None, len(ids)


def test_stop_string_spanning_tokens_truncates_and_is_excluded(tokenizer: Any) -> None:
    ids = encode(tokenizer, STOP_TEXT)
    # "STOP" is spread over several tokens in this vocabulary.
    assert not any("STOP" in tokenizer.decode([i]) for i in ids)
    d = detok(tokenizer, stop=["STOP"])
    stop, fed = feed_until_stop(d, ids)
    assert stop == "STOP"
    assert tokenizer.decode(ids[:fed]).endswith("STOP")  # found as soon as it completes
    assert d.output_text == "Hello world. "
    assert d.get_text(finished=True) == "Hello world. "


def test_stop_string_included_when_asked(tokenizer: Any) -> None:
    d = detok(tokenizer, stop=["STOP"], include_stop=True)
    stop, _ = feed_until_stop(d, encode(tokenizer, STOP_TEXT))
    assert stop == "STOP"
    assert d.output_text == "Hello world. STOP"


def test_stop_string_inside_one_token_truncates_mid_token(tokenizer: Any) -> None:
    d = detok(tokenizer, stop=["orl"])
    stop, _ = feed_until_stop(d, encode(tokenizer, STOP_TEXT))
    assert stop == "orl"
    assert d.output_text == "Hello w"


def test_earliest_stop_string_wins(tokenizer: Any) -> None:
    d = detok(tokenizer, stop=["here", "world", "llo"])
    assert d.update(encode(tokenizer, STOP_TEXT), stop_terminated=False) == "llo"
    assert d.output_text == "He"


def test_multibyte_stop_string(tokenizer: Any) -> None:
    d = detok(tokenizer, stop=["語"])
    stop, _ = feed_until_stop(d, encode(tokenizer, "日本語のテキスト"))
    assert stop == "語"
    assert d.output_text == "日本"


def test_no_stop_string_leaves_text_alone(tokenizer: Any) -> None:
    d = detok(tokenizer, stop=["absent"])
    stop, _ = feed_until_stop(d, encode(tokenizer, STOP_TEXT))
    assert stop is None
    assert d.output_text == STOP_TEXT


def test_get_text_holds_back_a_possible_partial_stop_string(tokenizer: Any) -> None:
    ids = encode(tokenizer, STOP_TEXT)
    d = detok(tokenizer, stop=["STOP", "xy"])  # longest stop has 4 chars: hold back 3
    upto_st = next(n for n in range(len(ids) + 1)
                   if tokenizer.decode(ids[:n]) == "Hello world. ST")
    d.update(ids[:upto_st], stop_terminated=False)
    assert d.output_text == "Hello world. ST"
    assert d.get_text(finished=False) == "Hello world."
    assert d.get_text(finished=True) == "Hello world. ST"
    # Short text: nothing is shown yet.
    d = detok(tokenizer, stop=["STOP"])
    d.update(encode(tokenizer, "He"), stop_terminated=False)
    assert d.get_text(finished=False) == ""


def test_get_text_does_not_hold_back_without_stop_strings_or_when_included(
        tokenizer: Any) -> None:
    ids = encode(tokenizer, "Hello world")
    for d in (detok(tokenizer), detok(tokenizer, stop=["STOP"], include_stop=True)):
        d.update(ids, stop_terminated=False)
        assert d.get_text(finished=False) == "Hello world"


# ---- flush at the end of a sequence --------------------------------------------------------


def test_flush_emits_a_held_back_partial_character_as_a_full_decode_would(
        tokenizer: Any) -> None:
    ids = encode(tokenizer, "ok 🦩")
    d = detok(tokenizer)
    d.update(ids[:-1], stop_terminated=False)
    # The token " \xf0\x9f" (space + the flamingo's first bytes) is held back.
    assert d.output_text == "ok"
    d.flush()
    assert d.output_text == tokenizer.decode(ids[:-1])
    assert d.output_text.startswith("ok \ufffd")


def test_flush_is_a_no_op_when_nothing_is_held_back(tokenizer: Any) -> None:
    d = detok(tokenizer)
    d.update(encode(tokenizer, "café 日本"), stop_terminated=False)
    d.flush()
    assert d.output_text == "café 日本"
    d.flush()
    assert d.output_text == "café 日本"


# ---- outputs nobody streams ---------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_deferred_decode_equals_incremental(tokenizer: Any, text: str) -> None:
    ids = encode(tokenizer, text) + [tokenizer.eos_token_id]
    prompt_ids = tokenizer.encode("Tell me:")
    incremental = IncrementalDetokenizer(tokenizer, prompt_ids, True, [], False)
    deferred = IncrementalDetokenizer(tokenizer, prompt_ids, True, [], False, incremental=False)
    for d in (incremental, deferred):
        for i in range(0, len(ids), 3):
            d.update(ids[i:i + 3], stop_terminated=i + 3 >= len(ids))
    assert deferred.output_text == ""  # nothing decoded before the end
    deferred.flush()
    incremental.flush()
    assert deferred.output_text == incremental.output_text == text
    assert deferred.token_ids == incremental.token_ids == ids


def test_deferred_decode_refuses_stop_strings(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="Stop strings need incremental"):
        IncrementalDetokenizer(tokenizer, None, True, ["x"], False, incremental=False)


def test_output_processor_defers_only_final_only_outputs_without_stop_strings(
        tokenizer: Any) -> None:
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.output_processor import OutputProcessor

    processor = OutputProcessor(tokenizer)
    cases = {"final": (RequestOutputKind.FINAL_ONLY, None),
             "final-stop": (RequestOutputKind.FINAL_ONLY, ["x"]),
             "delta": (RequestOutputKind.DELTA, None)}
    for req_id, (kind, stop) in cases.items():
        params = SamplingParams(stop=stop)
        params.output_kind = kind
        processor.add_request(req_id, None, [1, 2], 2, params)
    modes = {r: s.detokenizer.incremental for r, s in processor.request_states.items()}
    assert modes == {"final": False, "final-stop": True, "delta": True}


def test_stop_string_inside_a_multi_token_update_drops_the_tokens_after_it(
        tokenizer: Any) -> None:
    """Speculative decoding delivers several tokens at once: the run is cut at the token
    that completes the stop string, as one-token updates would have stopped there."""
    ids = encode(tokenizer, STOP_TEXT)
    one = detok(tokenizer, stop=["STOP"])
    _, fed = feed_until_stop(one, ids)
    assert fed < len(ids)
    several = detok(tokenizer, stop=["STOP"])
    assert several.update(ids, stop_terminated=False) == "STOP"
    assert several.token_ids == ids[:fed] == one.token_ids
    assert several.output_text == one.output_text == "Hello world. "


def test_min_tokens_defers_stop_strings(tokenizer: Any) -> None:
    """A stop string ending in the first `min_tokens` output tokens does not stop (the
    `may_stop_at` rule); one that ends in a later token does."""
    ids = encode(tokenizer, "ab ab ab")
    ends = [i for i in range(1, len(ids) + 1) if tokenizer.decode(ids[:i]).endswith("ab")]
    assert len(ends) == 3  # the stop string ends after these many tokens
    prompt_ids = tokenizer.encode("Tell me:")
    for min_tokens, expected_stop_at in ((0, ends[0]), (ends[0], ends[1]),
                                         (ends[0] - 1, ends[0])):
        d = IncrementalDetokenizer(tokenizer, prompt_ids, True, ["ab"], False,
                                   min_tokens=min_tokens)
        stopped_at = next(n for n in range(1, len(ids) + 1)
                          if d.update([ids[n - 1]], stop_terminated=False) is not None)
        assert stopped_at == expected_stop_at, min_tokens
