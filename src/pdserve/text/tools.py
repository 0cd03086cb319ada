"""Tool calling: the tools a chat request offers, how the model is told of
them, what constrains its output, and its tool calls read back.

- `tool_choice` none: the tools are not rendered and nothing is parsed;
- auto: the model writes calls in its family's own format, parsed after
  (`ToolFormat`: Hermes/Qwen `<tool_call>{...}</tool_call>` tags, Llama 3's
  bare `{"name": ..., "parameters": ...}` JSON, Mistral's `[TOOL_CALLS][...]`);
- required: the output is constrained to a JSON array of one or more
  `{"name", "parameters"}` objects, each one of the tools;
- a named function: the output is constrained to that function's
  parameters, and is its one call's arguments.

A template that does not render tools (SmolLM2's, Gemma 3's) gets them in a
system message, with the Hermes format to answer in; assistant messages'
tool calls and `role: tool` results are written in that format too."""

from __future__ import annotations

import enum
import json
import re
import uuid
from dataclasses import dataclass

from pdserve.text.constraint import Constraint


class ToolError(ValueError):
    """A bad `tools` or `tool_choice`; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict


class Choice(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                  # JSON text, as OpenAI's API carries it
    id: str = ""

    def wire(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and its choice among them."""
    functions: tuple[Function, ...]
    choice: Choice
    named: str | None = None        # Choice.NAMED's function

    @classmethod
    def parse(cls, tools, tool_choice) -> ToolUse | None:
        """None: no tools (a tool_choice without tools is refused)."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise ToolError("tool_choice", "tool_choice needs tools: send the tools the "
                                "model may call")
            return None
        if not isinstance(tools, list):
            raise ToolError("tools", "tools must be a list of {type: function, function: "
                            "{name, description, parameters}}")
        functions = [_function(i, t) for i, t in enumerate(tools)]
        names = [f.name for f in functions]
        if len(set(names)) != len(names):
            raise ToolError("tools", "each tool's function.name must be unique")
        if tool_choice in (None, "auto"):
            return cls(tuple(functions), Choice.AUTO)
        if tool_choice in ("none", "required"):
            return cls(tuple(functions), Choice(tool_choice))
        if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and \
                isinstance(tool_choice.get("function"), dict):
            name = tool_choice["function"].get("name")
            if name not in names:
                raise ToolError("tool_choice", f"tool_choice names function {name!r}, which "
                                f"is not among the tools ({', '.join(names)})")
            return cls(tuple(functions), Choice.NAMED, name)
        raise ToolError("tool_choice", "tool_choice must be none, auto, required or "
                        "{type: function, function: {name}}")

    @property
    def rendered(self) -> bool:
        return self.choice is not Choice.NONE

    def constraint(self) -> Constraint | None:
        """What required and named choices constrain the output to."""
        if self.choice is Choice.NAMED:
            return Constraint.json_schema(self._function(self.named).parameters)
        if self.choice is Choice.REQUIRED:
            calls = [{"type": "object", "additionalProperties": False,
                      "properties": {"name": {"enum": [f.name]}, "parameters": f.parameters},
                      "required": ["name", "parameters"]} for f in self.functions]
            return Constraint.json_schema({"type": "array", "minItems": 1,
                                           "items": {"anyOf": calls}})
        return None

    def _function(self, name) -> Function:
        return next(f for f in self.functions if f.name == name)

    def template_tools(self) -> list[dict]:
        """The tools as chat templates read them (OpenAI's shape)."""
        return [{"type": "function", "function": {"name": f.name, "description": f.description,
                                                  "parameters": f.parameters}}
                for f in self.functions]

    def calls_from(self, text: str, fmt: ToolFormat) -> tuple[str | None, list[ToolCall]]:
        """(the content left, the calls) of a finished output."""
        if self.choice is Choice.NAMED:
            return None, [ToolCall(self.named or "", text, new_call_id())]
        if self.choice is Choice.REQUIRED:
            try:
                items = json.loads(text)
            except ValueError:
                return text, []         # cut short (max_tokens): no complete call
            return None, [ToolCall(c["name"], json.dumps(c.get("parameters", {})),
                                   new_call_id()) for c in items if isinstance(c, dict)]
        if self.choice is Choice.AUTO:
            return fmt.parse(text, {f.name for f in self.functions})
        return text, []


def _function(i: int, tool) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function" or \
            not isinstance(tool.get("function"), dict):
        raise ToolError(where, f"{where} must be {{type: function, function: {{name, "
                        "description, parameters}}}")
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
        raise ToolError(where, f"{where}.function.name must be 1-64 letters, digits, '_', "
                        "'.' or '-'")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise ToolError(where, f"{where}.function.parameters must be a JSON schema object")
    return Function(name, fn.get("description") or "", params)


# ---- the model's own formats --------------------------------------------------------

class ToolFormat(enum.Enum):
    HERMES = "hermes"               # <tool_call>{"name", "arguments"}</tool_call> (Qwen, Hermes)
    LLAMA3_JSON = "llama3_json"     # {"name", "parameters"} (Llama 3.x), maybe <|python_tag|>
    MISTRAL = "mistral"             # [TOOL_CALLS][{"name", "arguments"}, ...]

    @classmethod
    def of_template(cls, template: str | None) -> ToolFormat:
        """The format a chat template teaches its model; Hermes for a
        template that renders no tools (pdserve then teaches it)."""
        t = template or ""
        if "[TOOL_CALLS]" in t:
            return cls.MISTRAL
        if "<tool_call>" in t or "tools" not in t:
            return cls.HERMES
        if "<|python_tag|>" in t or "<|eom_id|>" in t or '"parameters"' in t:
            return cls.LLAMA3_JSON
        return cls.HERMES

    @property
    def start(self) -> str:
        """Text that opens a call: output from here on is held back when
        streamed, and parsed at the end."""
        return {ToolFormat.HERMES: "<tool_call>", ToolFormat.LLAMA3_JSON: "{",
                ToolFormat.MISTRAL: "[TOOL_CALLS]"}[self]

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
        """(content, calls); text that is not a well-formed call of a known
        function stays content."""
        if self is ToolFormat.HERMES:
            bodies = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, re.S)
            calls = [c for b in bodies if (c := _call(b, names)) is not None]
            if not calls:
                return text, []
            content = text[:text.index("<tool_call>")].strip()
            return content or None, calls
        if self is ToolFormat.MISTRAL:
            at = text.find("[TOOL_CALLS]")
            if at < 0:
                return text, []
            try:
                items = json.loads(text[at + len("[TOOL_CALLS]"):].strip())
            except ValueError:
                return text, []
            calls = [c for it in (items if isinstance(items, list) else [items])
                     if (c := _call(it, names)) is not None]
            return (text[:at].strip() or None, calls) if calls else (text, [])
        body = text.strip().removeprefix("<|python_tag|>").strip()
        calls = []
        for part in body.split(";"):       # Llama 3.2 separates parallel calls with ';'
            c = _call(part.strip(), names)
            if c is None:
                return text, []
            calls.append(c)
        return None, calls


def _call(body, names: set[str]) -> ToolCall | None:
    if isinstance(body, str):
        try:
            body = json.loads(body)
        except ValueError:
            return None
    if not isinstance(body, dict) or body.get("name") not in names:
        return None
    args = body.get("arguments", body.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(body["name"], json.dumps(args), new_call_id())


# ---- rendering ---------------------------------------------------------------------------

_SYSTEM = ("You may call one or more functions to assist with the user query. The "
           "functions are given as JSON within <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
           "For each function call, answer with a JSON object with the function name and "
           "arguments within <tool_call></tool_call> tags:\n<tool_call>\n"
           '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def render_messages(messages: list[dict], use: ToolUse | None, template: str | None
                    ) -> tuple[list[dict], dict]:
    """(messages, extra template variables) for a chat with tools: the
    template's own `tools` variable where it renders tools; otherwise a
    system message with the tools and the Hermes format, and tool calls and
    results written in it. Assistant tool calls' arguments reach a template
    that renders tools as objects (Qwen's and Llama's write `| tojson`)."""
    native = bool(template) and "tools" in (template or "")
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls and native:
            m = {**m, "tool_calls": [_with_object_arguments(c) for c in calls]}
        elif calls:
            text = "\n".join("<tool_call>\n" + json.dumps(
                {"name": c["function"]["name"],
                 "arguments": _arguments(c["function"].get("arguments"))}) + "\n</tool_call>"
                for c in calls)
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = ((m.get("content") or "") + "\n" + text).strip()
        elif m.get("role") == "tool" and not native:
            m = {**m, "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        if m.get("content") is None:
            m = {**m, "content": ""}
        out.append(m)
    if use is None or not use.rendered:
        return out, {}
    if native:
        return out, {"tools": use.template_tools()}
    listing = "\n".join(json.dumps(t) for t in use.template_tools())
    system = _SYSTEM.format(tools=listing)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".strip()}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}


def _arguments(a):
    if isinstance(a, str):
        try:
            return json.loads(a)
        except ValueError:
            return a
    return a


def _with_object_arguments(call: dict) -> dict:
    fn = call.get("function") or {}
    return {**call, "function": {**fn, "arguments": _arguments(fn.get("arguments"))}}
