"""Drive forward-serve (started with --fake-engine) through the `ollama` Python client.

usage: ollama_client.py BASE_URL
The fake engine continues a prompt with its own bytes upper-cased; its chat template is
`role: content\\n` per message, so every answer is known. Prints one line per check and exits
non-zero on the first mismatch.
"""
import sys

import ollama


def main() -> int:
    client = ollama.Client(host=sys.argv[1], timeout=30)

    tags = client.list()
    assert [m.model for m in tags.models] == ["fake"], tags
    print("tags ok")

    shown = client.show("fake")
    assert shown.modelinfo["general.architecture"] == shown.details.family, shown
    print("show ok")

    r = client.generate(model="fake", prompt="abc", raw=True, options={"num_predict": 5, "temperature": 0})
    assert r.response == "ABCAB" and r.done and r.done_reason == "length", r
    assert r.prompt_eval_count == 3 and r.eval_count == 5, r
    print("generate ok")

    text = ""
    last = None
    for part in client.generate(model="fake:latest", prompt="hi.", raw=True, stream=True, options={"temperature": 0}):
        text += part.response
        last = part
    assert text == "HI" and last.done and last.done_reason == "stop", (text, last)
    print("generate stream ok")

    # Not raw: the prompt goes through the chat template as a user message.
    r = client.generate(model="fake", prompt="hi", system="s", options={"num_predict": 4, "temperature": 0})
    assert r.response == "SYST", r
    print("generate templated ok")

    r = client.chat(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        options={"num_predict": 9, "temperature": 0},
    )
    assert r.message.role == "assistant" and r.message.content == "USER: HI\n", r
    print("chat ok")

    text = ""
    for part in client.chat(
        model="fake",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        options={"num_predict": 9, "temperature": 0, "seed": 7},
    ):
        text += part.message.content
    assert text == "USER: HI\n", text
    print("chat stream ok")

    for bad in [
        lambda: client.generate(model="fake", prompt="a", options={"mirostat": 2}),
        lambda: client.generate(model="fake", prompt="a", format="json"),
    ]:
        try:
            bad()
            raise AssertionError("accepted")
        except ollama.ResponseError as e:
            assert e.status_code == 400 and e.error, e
    try:
        client.generate(model="other", prompt="a")
        raise AssertionError("unknown model accepted")
    except ollama.ResponseError as e:
        assert e.status_code == 404 and "other" in e.error, e
    print("errors ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
