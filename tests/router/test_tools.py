"""text/tools.py and router/openai_tools.py: tools checked by name, the
constraint required and named choices put on the output, each family's
own call format parsed, calls rendered into templates that know no tools,
and streamed deltas that concatenate to the whole call."""

import json

import pytest

from pdserve.router.openai_tools import ToolDeltas, message
from pdserve.text.tools import Choice, ToolError, ToolFormat, ToolUse, render_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search"}}


@pytest.mark.parametrize("tools, choice, param, words", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice",
     "not among the tools"),
    (None, "required", "tool_choice", "needs tools"),
    ([{"type": "function", "function": {"name": "has space"}}], "auto", "tools[0]",
     "letters, digits"),
    ([WEATHER, WEATHER], "auto", "tools", "unique"),
    ([WEATHER], "always", "tool_choice", "none, auto, required"),
])
def test_bad_tools_and_choices_are_refused_by_name(tools, choice, param, words):
    with pytest.raises(ToolError) as e:
        ToolUse.parse(tools, choice)
    assert e.value.param == param and words in str(e.value)


def test_named_and_required_choices_constrain_the_output_and_read_it_back():
    named = ToolUse.parse([WEATHER, SEARCH], {"type": "function",
                                              "function": {"name": "get_weather"}})
    schema = json.loads(named.constraint().text)
    assert schema == WEATHER["function"]["parameters"]
    _, (call,) = named.calls_from('{"city":"Paris"}', ToolFormat.HERMES)
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    req = ToolUse.parse([WEATHER, SEARCH], "required")
    schema = json.loads(req.constraint().text)
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    _, calls = req.calls_from('[{"name":"search","parameters":{}},{"name":"get_weather",'
                              '"parameters":{"city":"Rome"}}]', ToolFormat.HERMES)
    assert [c.name for c in calls] == ["search", "get_weather"]
    assert ToolUse.parse([WEATHER], "auto").constraint() is None
    assert ToolUse.parse([WEATHER], "none").choice is Choice.NONE


@pytest.mark.parametrize("fmt, text, content", [
    (ToolFormat.HERMES, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": '
                        '{"city": "Paris"}}\n</tool_call>', "Sure."),
    (ToolFormat.LLAMA3_JSON, '<|python_tag|>{"name": "get_weather", "parameters": '
                             '{"city": "Paris"}}', None),
    (ToolFormat.MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": '
                         '{"city": "Paris"}}]', None),
])
def test_each_familys_own_call_format_is_parsed_under_auto(fmt, text, content):
    use = ToolUse.parse([WEATHER], "auto")
    got, (call,) = use.calls_from(text, fmt)
    assert got == content and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.id.startswith("call_")
    assert use.calls_from("Just text.", fmt) == ("Just text.", [])
    assert use.calls_from('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
                          ToolFormat.HERMES)[1] == []


def test_formats_follow_the_templates_of_the_families_pdserve_loads():
    assert ToolFormat.of_template("{% for tool in tools %}<tool_call>") is ToolFormat.HERMES
    assert ToolFormat.of_template("{{ tools }} <|python_tag|> <|eom_id|>") is \
        ToolFormat.LLAMA3_JSON
    assert ToolFormat.of_template("{{ tools }} [TOOL_CALLS]") is ToolFormat.MISTRAL
    assert ToolFormat.of_template("<|im_start|>{{ message['content'] }}") is ToolFormat.HERMES


def test_a_template_without_tools_gets_them_in_a_system_message_and_calls_as_text():
    use = ToolUse.parse([WEATHER], "auto")
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{
                "id": "c1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "5 degrees"}]
    out, extra = render_messages(msgs, use, "{{ message['content'] }}")
    assert extra == {} and out[0]["content"].startswith("Be brief.") and \
        "get_weather" in out[0]["content"] and "<tools>" in out[0]["content"]
    assert '"arguments": {"city": "Oslo"}' in out[2]["content"] and "tool_calls" not in out[2]
    assert out[3]["content"] == "<tool_response>\n5 degrees\n</tool_response>"
    native, extra = render_messages(msgs, use, "{% for t in tools %}{% endfor %}")
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


@pytest.mark.parametrize("choice, pieces", [
    ({"type": "function", "function": {"name": "get_weather"}}, ['{"ci', 'ty":"Pa', 'ris"}']),
    ("required", ['[{"name":"get_weather",', '"parameters":{"city":"Paris"}}]']),
    ("auto", ["Let me check. <tool", '_call>{"name": "get_weather", ',
              '"arguments": {"city": "Paris"}}</tool_call>']),
])
def test_streamed_deltas_concatenate_to_the_whole_answer(choice, pieces):
    use = ToolUse.parse([WEATHER, SEARCH], choice)
    stream = ToolDeltas(use, ToolFormat.HERMES)
    deltas, finish = [], None
    for i, p in enumerate(pieces):
        out, finish = stream.push(p, "stop" if i == len(pieces) - 1 else None)
        deltas += out
    whole, whole_finish = message(use, ToolFormat.HERMES, "".join(pieces), "stop")
    assert finish == whole_finish == "tool_calls"
    content = "".join(d.get("content", "") for d in deltas)
    assert content.strip() == (whole["content"] or "")     # streamed before the mark was seen
    args = "".join(tc["function"].get("arguments", "") for d in deltas
                   for tc in d.get("tool_calls", []))
    assert json.loads(args) == json.loads(whole["tool_calls"][0]["function"]["arguments"])
    first = next(d["tool_calls"][0] for d in deltas if "tool_calls" in d)
    assert first["function"]["name"] == "get_weather" and first["id"] and first["index"] == 0


def test_under_auto_each_hermes_call_goes_out_the_moment_it_closes_and_only_once():
    use = ToolUse.parse([WEATHER, SEARCH], "auto")
    stream = ToolDeltas(use, ToolFormat.HERMES)
    first = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    bad = '\n<tool_call>{"name": "no_such_tool", "arguments": {}}</tool_call>'
    second = '\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
    out, finish = stream.push("Checking both. " + first[:30], None)
    assert out == [{"content": "Checking both. "}] and finish is None
    out, _ = stream.push(first[30:] + bad, None)     # the first closes: out at once
    assert [d["tool_calls"][0]["index"] for d in out] == [0]
    assert json.loads(out[0]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    sent_id = out[0]["tool_calls"][0]["id"]
    out, finish = stream.push(second + "</tool_call>", "stop")
    assert finish == "tool_calls"
    assert [(d["tool_calls"][0]["index"], d["tool_calls"][0]["function"]["name"])
            for d in out] == [(1, "get_weather")]
    assert out[0]["tool_calls"][0]["id"] not in ("", sent_id)
    whole, _ = message(use, ToolFormat.HERMES, "Checking both. " + first + bad + second +
                       "</tool_call>", "stop")
    assert [json.loads(c["function"]["arguments"]) for c in whole["tool_calls"]] == \
        [{"city": "Oslo"}, {"city": "Rome"}]
