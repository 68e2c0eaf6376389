"""`pagedlm generate`: replies to one or more prompts, printed once each is complete."""

from __future__ import annotations

import argparse
import os
import sys

from pagedlm import LLM
from pagedlm.entrypoints.cli_args import describe_sampling, engine_kwargs, sampling_params


def run_generate(args: argparse.Namespace) -> int:
    if not args.prompt:
        hint = ""
        if args.model and not os.path.exists(args.model):
            hint = f"; {args.model!r} is not a model path: did you mean --prompt {args.model!r}?"
        args._parser.error(f"give the prompt with -p/--prompt{hint}")
    llm = LLM(**engine_kwargs(args))
    params = sampling_params(args)
    print(describe_sampling(params), file=sys.stderr)  # stdout stays the replies alone
    tokenizer = llm.get_tokenizer()
    use_chat = not args.no_chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None)
    for prompt in args.prompt:
        if use_chat:
            outputs = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
        else:
            outputs = llm.generate(prompt, params, use_tqdm=False)
        for completion in outputs[0].outputs:
            print(completion.text if tokenizer is not None else completion.token_ids)
    return 0
