"""Drive forward-serve (started with --fake-engine) through the official OpenAI Python client.

usage: openai_client.py BASE_URL
The fake engine continues a prompt with its own bytes upper-cased, so every answer is known.
Prints one line per check and exits non-zero on the first mismatch.
"""
import sys

from openai import OpenAI


def main() -> int:
    base = sys.argv[1]
    client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=30)

    models = [m.id for m in client.models.list().data]
    assert models == ["fake"], models
    print("models ok")

    r = client.completions.create(model="fake", prompt="abc", max_tokens=5, temperature=0)
    assert r.choices[0].text == "ABCAB", r
    assert r.choices[0].finish_reason == "length", r
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 5 and r.usage.total_tokens == 8, r
    print("completion ok")

    text = ""
    for chunk in client.completions.create(model="fake", prompt="hi.", max_tokens=10, stream=True):
        text += chunk.choices[0].text
    assert text == "HI", text
    print("completion stream ok")

    r = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=9, temperature=0
    )
    assert r.choices[0].message.role == "assistant", r
    assert r.choices[0].message.content == "USER: HI\n", r
    print("chat ok")

    text = ""
    finish = None
    stream = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=9, stream=True
    )
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert text == "USER: HI\n" and finish == "length", (text, finish)
    print("chat stream ok")

    # Log-probabilities. The fake's logits are one 50 among 257 zeros: its pick has a
    # log-probability of about 0, any other token about -50.
    r = client.completions.create(
        model="fake", prompt="ab", max_tokens=2, temperature=0, logprobs=2, echo=True
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "abAB", r
    assert lp.tokens == ["a", "b", "A", "B"], lp
    assert lp.token_logprobs[0] is None and abs(lp.token_logprobs[1] + 50) < 1e-3, lp
    assert all(abs(x) < 1e-3 for x in lp.token_logprobs[2:]), lp
    assert lp.text_offset == [0, 1, 2, 3], lp
    assert set(lp.top_logprobs[2]) == {"A", "\x00"}, lp.top_logprobs
    print("completion logprobs ok")

    got = []
    for chunk in client.completions.create(
        model="fake", prompt="ab", max_tokens=2, temperature=0, logprobs=1, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            got += chunk.choices[0].logprobs.tokens
    assert got == ["A", "B"], got
    print("completion logprobs stream ok")

    r = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content == "USE", r
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content), content
    assert all(abs(c.logprob) < 1e-3 and c.bytes == list(c.token.encode()) for c in content), content
    print("chat logprobs ok")

    got = []
    stream = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        stream=True,
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            got += [c.token for c in chunk.choices[0].logprobs.content]
    assert "".join(got) == "USE", got
    print("chat logprobs stream ok")

    # n samples: one choice each, in order (greedy, so all equal here).
    r = client.completions.create(model="fake", prompt="ab", max_tokens=3, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and {c.text for c in r.choices} == {"ABA"}, r
    assert r.usage.prompt_tokens == 2 and r.usage.completion_tokens == 9, r
    texts = {}
    for chunk in client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {0: "USER", 1: "USER"}, texts
    print("n ok")
    try:
        client.completions.create(model="fake", prompt="a", max_tokens=2, n=17)
        raise AssertionError("n=17 accepted")
    except Exception as e:  # openai.BadRequestError
        assert getattr(e, "status_code", None) == 400, e
    try:
        client.completions.create(model="fake", prompt="a", max_tokens=0)
        raise AssertionError("max_tokens=0 accepted")
    except Exception as e:  # openai.BadRequestError
        assert getattr(e, "status_code", None) == 400, e
    print("error ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
