"""Penalties with the official `openai` SDK (services/pdmesh/tests/sampling_params.rs).

argv[1]: the server's base URL (the P/D router). Greedy with `frequency_penalty=0.5,
presence_penalty=0.3` must be answered (200) with text that differs from greedy without them;
the same penalties on chat and streamed must be answered too.
"""
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
model = client.models.list().data[0].id
prompt = "Once upon a time, in a small village by the sea,"

plain = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
penalised = client.completions.create(
    model=model, prompt=prompt, max_tokens=24, temperature=0, frequency_penalty=0.5, presence_penalty=0.3
)
a, b = plain.choices[0].text, penalised.choices[0].text
assert a and b, (a, b)
assert a != b, f"the penalties changed nothing: {a!r}"

streamed = "".join(
    c.choices[0].text
    for c in client.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, frequency_penalty=0.5, presence_penalty=0.3,
        stream=True,
    )
    if c.choices
)
assert streamed == b, (streamed, b)

chat = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Say hello three times."}],
    max_tokens=16,
    temperature=0,
    frequency_penalty=0.5,
    presence_penalty=0.3,
)
assert chat.choices[0].message.content, chat
print("OK", repr(a), "->", repr(b))
