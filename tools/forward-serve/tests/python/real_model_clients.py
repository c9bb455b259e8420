"""The `openai` and `ollama` clients against forward-serve serving a real model.

usage: real_model_clients.py BASE_URL MODEL_ID
The answers are not known in advance, so each check compares two ways of asking: streamed against
whole, log-probabilities against the text they describe, one `n` request against single requests
with the seeds it promises, Ollama's routes against the OpenAI ones. Prints one line per check and
exits non-zero on the first mismatch.
"""
import sys

import ollama
from openai import OpenAI


def main() -> int:
    base, model = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "The three primary colors are"

    r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    c = r.choices[0]
    lp = c.logprobs
    assert "".join(lp.tokens) == c.text and len(lp.tokens) == r.usage.completion_tokens, r
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # Greedy: each token is its row's likeliest, so it heads its own top list.
        assert val <= 0 and abs(max(top.values()) - val) < 1e-6 and len(top) <= 4, (tok, val, top)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))], lp
    print("completion logprobs ok")

    streamed, tokens = "", []
    for chunk in client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=3, stream=True
    ):
        if chunk.choices:
            streamed += chunk.choices[0].text
            if chunk.choices[0].logprobs:
                tokens += chunk.choices[0].logprobs.tokens
    assert streamed == c.text and tokens == lp.tokens, (streamed, tokens)
    print("completion stream ok")

    scored = client.completions.create(
        model=model, prompt=prompt + c.text, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    slp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt + c.text, scored
    assert len(slp.tokens) == scored.usage.prompt_tokens and slp.token_logprobs[0] is None, slp
    # The echoed continuation scores what the generation reported for it (same rows, same logits).
    n_prompt = client.completions.create(
        model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=0
    ).usage.prompt_tokens
    tail = slp.token_logprobs[n_prompt:]
    if slp.tokens[n_prompt:] == lp.tokens:
        assert all(abs(a - b) < 1e-3 for a, b in zip(tail, lp.token_logprobs)), (tail, lp.token_logprobs)
    print("echo scoring ok")

    msgs = [{"role": "user", "content": "Name a fruit."}]
    r = client.chat.completions.create(
        model=model, messages=msgs, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].logprobs.content
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")
    assert joined == r.choices[0].message.content, (joined, r)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in content), content
    print("chat logprobs ok")

    many = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=10, temperature=0.9, seed=5, n=3
    )
    assert [ch.index for ch in many.choices] == [0, 1, 2], many
    for i, ch in enumerate(many.choices):
        one = client.completions.create(
            model=model, prompt="Once upon a time", max_tokens=10, temperature=0.9, seed=5 + i
        )
        assert one.choices[0].text == ch.text, (i, one.choices[0].text, ch.text)
    print("n samples ok")

    oc = ollama.Client(host=base, timeout=120)
    assert [m.model for m in oc.list().models] == [model]
    shown = oc.show(model)
    assert shown.modelinfo["general.architecture"] == shown.details.family == "llama", shown
    assert "im_start" in (shown.template or ""), shown.template
    g = oc.generate(model=model, prompt=prompt, raw=True, options={"num_predict": 8, "temperature": 0})
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert g.response == plain.choices[0].text and g.eval_count == plain.usage.completion_tokens, (g, plain)
    print("ollama generate ok")

    parts = list(oc.chat(model=model, messages=msgs, stream=True, options={"num_predict": 10, "temperature": 0}))
    text = "".join(p.message.content for p in parts)
    assert parts[-1].done and text == r.choices[0].message.content, (text, r.choices[0].message.content)
    print("ollama chat ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
