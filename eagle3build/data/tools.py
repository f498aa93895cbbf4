"""Tool definitions and tool calls as a chat template reads them: one form for every stage.

vLLM (0.25.0, entrypoints/openai/chat_completion/protocol.py) validates a request's `tools` as a list of
`ChatCompletionToolsParam`, OpenAI's form {"type": "function", "function": {"name", "description"?,
"parameters"?, "strict"?}}: a bare {"name", ...} is answered with HTTP 400 ('body.tools.0.function: Field
required'). It then renders the chat template with each tool's `model_dump()`: "type", then "function"
holding "name", "description" and "parameters" (None when absent), "strict" and "defer_loading" only when
set, then every other key as given (its models keep extra fields). An assistant message's tool-call
arguments reach the template parsed from their JSON string (chat_utils.py, `_postprocess_messages`).

`openai_tools` and `template_messages` produce exactly that. The split stage stores tools in this form,
the regenerate stage sends it (its hf backend renders it) and the tokens stage renders it, so the target
reads the same tool text while it answers and while the draft is trained on its answers.

Accepted tool shapes (datasets write all of them):
- OpenAI's, as is ("type" may be left out, as vLLM allows);
- a bare function {"name", "description"?, "parameters"?} (glaive / LLaMA-Factory, xLAM);
- the Responses API's flat {"type": "function", "name", ...};
- any of these as a JSON string, the whole list too, and `parameters` as a JSON string;
- Arrow rows (`hf:` datasets), whose absent struct fields read as None ("function": None is a bare one).
"""

from __future__ import annotations

import json

FUNCTION_FIELDS = ("name", "description", "parameters", "strict", "defer_loading")


class ToolError(ValueError):
    """A tool definition that cannot be put in OpenAI's form; the message names the tool and the field."""


def _parsed(value, what: str):
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ToolError(f"{what} is a string but not JSON ({e.msg} at column {e.colno})") from e


def _function(fields: dict, at: str) -> dict:
    """vLLM's FunctionDefinition as model_dump() writes it: declared fields first, then the extra ones."""
    name = fields.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(
            f"{at} has no function name (keys: {sorted(fields)}); a tool is {{\"type\": \"function\", "
            "\"function\": {\"name\", \"description\", \"parameters\"}} or the bare {\"name\", ...}"
        )
    description = fields.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{at} '{name}': 'description' must be a string, found {type(description).__name__}")
    parameters = _parsed(fields.get("parameters"), f"{at} '{name}': 'parameters'")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolError(
            f"{at} '{name}': 'parameters' must be a JSON schema object, found {type(parameters).__name__}"
        )
    out = {"name": name, "description": description, "parameters": parameters}
    for key in ("strict", "defer_loading"):
        value = fields.get(key)
        if value is not None and not isinstance(value, bool):
            raise ToolError(f"{at} '{name}': '{key}' must be true or false, found {value!r}")
        if value is not None:
            out[key] = value
    out.update((k, v) for k, v in fields.items() if k not in FUNCTION_FIELDS)
    return out


def openai_tool(tool, at: str = "tools[0]") -> dict:
    """One tool definition in OpenAI's form, as vLLM's ChatCompletionToolsParam.model_dump() writes it."""
    tool = _parsed(tool, at)
    if not isinstance(tool, dict):
        raise ToolError(f"{at} must be an object, found {type(tool).__name__}")
    kind = tool.get("type")
    if kind not in (None, "function"):
        raise ToolError(f"{at} has type {kind!r}; chat completions take only 'function' tools")
    function = _parsed(tool.get("function"), f"{at}.function")
    if function is None:  # bare or flat: the fields of the function itself
        fields = {k: v for k, v in tool.items() if k not in ("type", "function")}
        return {"type": "function", "function": _function(fields, at)}
    if not isinstance(function, dict):
        raise ToolError(f"{at}.function must be an object, found {type(function).__name__}")
    defer = tool.get("defer_loading")
    if defer is not None and function.get("defer_loading") is None:  # vLLM hands it down to the function
        function = {**function, "defer_loading": defer}
    out: dict = {"type": "function", "function": _function(function, at)}
    if defer is not None:
        out["defer_loading"] = defer
    out.update((k, v) for k, v in tool.items() if k not in ("type", "function", "defer_loading"))
    return out


def openai_tools(tools) -> list[dict] | None:
    """A conversation's `tools` in OpenAI's form (None when it has none); ToolError when one cannot be.

    Idempotent: tools already in this form come back equal, in the same key order."""
    tools = _parsed(tools, "'tools'")
    if tools in (None, "", [], {}):
        return None
    if isinstance(tools, dict):  # one tool, not in a list
        tools = [tools]
    if not isinstance(tools, list):
        raise ToolError(f"'tools' must be a list of tool definitions, found {type(tools).__name__}")
    return [openai_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]


def _template_call(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        return call  # not a function call: left to the template (vLLM would refuse the request)
    arguments = function.get("arguments")
    if arguments and not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments) if arguments else None
    except json.JSONDecodeError:
        return call  # not JSON: the template gets the text
    return {**call, "function": {**function, "arguments": {} if parsed is None else parsed}}


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as vLLM hands them to a chat template: tool-call arguments parsed from JSON ({} when
    empty), an empty tool_calls list dropped. Messages without tool calls are returned as they are."""
    if not any("tool_calls" in m for m in messages):
        return messages
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            if calls:
                message = {**message, "tool_calls": [_template_call(c) for c in calls]}
            else:
                message = {k: v for k, v in message.items() if k != "tool_calls"}
        out.append(message)
    return out
