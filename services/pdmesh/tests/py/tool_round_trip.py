"""Tool calling round trip with the official `openai` SDK (services/pdmesh/tests/structured.rs).

argv[1]: the server's base URL. A named-function call must come back with arguments that parse
and match the schema; the tool's result is sent back and the model answers with text. The same
named call streamed must assemble to valid arguments too.
"""
import json
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused")
model = client.models.list().data[0].id
tools = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}]
named = {"type": "function", "function": {"name": "get_weather"}}


def check_args(text):
    args = json.loads(text)
    assert set(args) == {"city", "unit"}, args
    assert isinstance(args["city"], str) and len(args["city"]) <= 24, args
    assert args["unit"] in ("celsius", "fahrenheit"), args
    return args


messages = [{"role": "user", "content": "What is the weather like in Paris today?"}]
r = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=named,
                                   temperature=0, max_tokens=80)
choice = r.choices[0]
assert choice.finish_reason == "tool_calls", choice
calls = choice.message.tool_calls
assert calls and len(calls) == 1, choice.message
assert calls[0].type == "function" and calls[0].function.name == "get_weather", calls
args = check_args(calls[0].function.arguments)
print("call:", calls[0].function.name, args)

# the call and the tool's result go back; the model answers with text
messages.append(choice.message.model_dump(exclude_none=True))
messages.append({"role": "tool", "tool_call_id": calls[0].id,
                 "content": json.dumps({"city": args["city"], "temperature": 21, "sky": "sunny"})})
r2 = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice="none",
                                    temperature=0, max_tokens=40)
answer = r2.choices[0].message
assert not answer.tool_calls, answer
assert answer.content and answer.content.strip(), answer
print("answer:", answer.content)

# streamed: the deltas assemble to one call with valid arguments
stream = client.chat.completions.create(model=model, messages=messages[:1], tools=tools, tool_choice=named,
                                        temperature=0, max_tokens=80, stream=True)
name, arguments, finish = None, "", None
for chunk in stream:
    if not chunk.choices:
        continue
    c = chunk.choices[0]
    for d in c.delta.tool_calls or []:
        name = d.function.name or name
        arguments += d.function.arguments or ""
    finish = c.finish_reason or finish
assert finish == "tool_calls" and name == "get_weather", (finish, name)
check_args(arguments)

# a forced call cut by max_tokens is still a tool call (its arguments as far as they got,
# finish_reason "length"), never the call's text as content: named, plain and streamed, and
# `required` (name complete, parameters cut)
for choice_kind, limit in ((named, 5), ("required", 14)):
    r = client.chat.completions.create(model=model, messages=messages[:1], tools=tools, tool_choice=choice_kind,
                                       temperature=0, max_tokens=limit)
    c = r.choices[0]
    assert c.finish_reason == "length", (choice_kind, c)
    assert not c.message.content, (choice_kind, c.message)
    assert c.message.tool_calls and c.message.tool_calls[-1].function.name == "get_weather", (choice_kind, c.message)
    stream = client.chat.completions.create(model=model, messages=messages[:1], tools=tools, tool_choice=choice_kind,
                                            temperature=0, max_tokens=limit, stream=True)
    names, content, finish = [], "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0]
        names += [t.function.name for t in d.delta.tool_calls or [] if t.function.name]
        content += d.delta.content or ""
        finish = d.finish_reason or finish
    assert finish == "length" and names and names[-1] == "get_weather" and not content, (choice_kind, finish, names, content)
    print("cut:", choice_kind, "->", c.message.tool_calls[-1].function.arguments)
print("OK")
