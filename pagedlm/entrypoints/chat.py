"""`pagedlm chat`: an interactive terminal chat that streams each reply as it is generated."""

from __future__ import annotations

import argparse
import sys

from pagedlm import LLM
from pagedlm.engine.output_processor import RequestOutputKind
from pagedlm.entrypoints.cli_args import describe_sampling, engine_kwargs, sampling_params

HELP = "Type a message and press Enter. /clear forgets the conversation, /exit (or Ctrl-D) quits."


def run_chat(args: argparse.Namespace, stdin=None, stdout=None) -> int:
    stdin = stdin or sys.stdin
    stdout = stdout or sys.stdout
    llm = LLM(**engine_kwargs(args))
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        print("error: chat needs a tokenizer with a chat template", file=sys.stderr)
        return 2
    params = sampling_params(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    interactive = stdin.isatty()
    print(f"pagedlm chat with {engine.model_path}. {HELP}\n{describe_sampling(params)}",
          file=stdout, flush=True)
    turn = 0
    while True:
        if interactive:
            stdout.write(">>> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            if interactive:
                stdout.write("\n")
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit", "/bye"):
            return 0
        if text == "/clear":
            history.clear()
            print("(conversation cleared)", file=stdout, flush=True)
            continue
        history.append({"role": "user", "content": text})
        prompt = llm.apply_chat_template(system + history)
        ids = tokenizer(prompt, add_special_tokens=False).input_ids
        request_id = f"chat-{turn}"
        turn += 1
        reply = []
        try:
            request_params = params
            if params.max_tokens + len(ids) > engine.max_model_len:
                # Long conversations get whatever room is left rather than an error.
                request_params = params.clone()
                request_params.max_tokens = max(1, engine.max_model_len - len(ids))
            engine.add_request(request_id, prompt, request_params, prompt_token_ids=ids,
                               output_kind=RequestOutputKind.DELTA)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    delta = output.outputs[0].text
                    if delta:
                        reply.append(delta)
                        stdout.write(delta)
                        stdout.flush()
        except KeyboardInterrupt:
            engine.abort_request(request_id)
            stdout.write(" [interrupted]")
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        stdout.write("\n")
        stdout.flush()
        history.append({"role": "assistant", "content": "".join(reply)})
