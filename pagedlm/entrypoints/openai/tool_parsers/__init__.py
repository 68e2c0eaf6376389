"""Tool calls in a model's output: the formats models write them in, an incremental parser
that turns the generated text into OpenAI `tool_calls` (whole or as stream deltas), the
grammar that forces a call with valid arguments (`tool_choice` required or a named
function), and, for a chat template that knows nothing of tools, the system prompt and
history text that teach the model the format.

    format        a call as the model writes it
    ------        ----------------------------
    hermes        <tool_call>{"name": "f", "arguments": {...}}</tool_call>   (Hermes, Qwen;
                  a JSON list of calls inside the tags is read too, as SmolLM2 writes it)
    llama3_json   {"name": "f", "parameters": {...}}; {...}   (the whole output; Llama 3.x)
    mistral       [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]   (Mistral)

    formats.py     ToolCallFormat (one per family, data not code), the registry, the choice
                   of format from a chat template, teaching text and forcing grammar
    parser.py      ToolCallParser: generated text -> content and call deltas
    json_scan.py   reading call objects out of JSON text that may still be growing
    schema.py      the rewrites a function's parameter schema gets inside a forcing grammar
"""
