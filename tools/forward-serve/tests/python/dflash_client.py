"""Ask forward-serve (started with --draft) for DFlash drafts through the official OpenAI client.

usage: dflash_client.py BASE_URL MODEL_ID
The `speculative` field is not part of OpenAI's API, so it travels in `extra_body`. Greedy
output with DFlash drafting must equal the output without. Prints one line per check and exits
non-zero on the first mismatch.
"""
import sys

import openai
from openai import OpenAI

DFLASH = {"speculative": {"drafter": "dflash", "draft_max": 8}}
PLAIN = {"speculative": False}


def main() -> int:
    base, model = sys.argv[1], sys.argv[2]
    client = OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)

    def complete(extra):
        r = client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=16, temperature=0, extra_body=extra
        )
        return r.choices[0].text

    plain = complete(PLAIN)
    assert plain, "empty completion"
    assert complete(DFLASH) == plain, (complete(DFLASH), plain)
    print("completion ok")

    def chat(extra):
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12,
            temperature=0,
            extra_body=extra,
        )
        return r.choices[0].message.content

    assert chat(DFLASH) == chat(PLAIN)
    print("chat ok")

    text = ""
    for chunk in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=16, temperature=0, stream=True, extra_body=DFLASH
    ):
        text += chunk.choices[0].text
    assert text == plain, (text, plain)
    print("stream ok")

    try:
        client.completions.create(
            model=model, prompt="x", max_tokens=2, extra_body={"speculative": {"drafter": "eagle"}}
        )
        raise AssertionError("an unknown drafter was accepted")
    except openai.BadRequestError as e:
        assert e.body and e.body.get("param") == "speculative", e.body
    print("bad drafter ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
