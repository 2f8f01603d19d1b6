"""The ``llmlab`` command line.

    llmlab generate "Hello, my name is" --max-tokens 32 --temperature 0.8
    llmlab generate "Hello" --model Qwen/Qwen3-0.6B --scheduling-policy fair
    llmlab components            # every registered policy and backend, with its one-line doc

Without ``--model`` it runs llmlab's built-in tiny model (random weights, built locally on
first use), so the command works on an offline machine; its text is gibberish.
"""

from __future__ import annotations

import argparse
import sys


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local directory or hub id")
    parser.add_argument("--tokenizer", default=None)
    parser.add_argument("--revision", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    names = "a registered name (see `llmlab components`) or package.module:Class"
    parser.add_argument("--scheduling-policy", default="fcfs", help=f"{names}; default fcfs")
    parser.add_argument("--eviction-policy", default="lru", help=f"{names}; default lru")
    parser.add_argument("--attention-backend", default="torch", help=f"{names}; default torch")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--best-of", type=int, default=None)
    parser.add_argument("--stop", action="append", default=None,
                        help="a stop string (repeat the flag for several)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--logprobs", type=int, default=None,
                        help="print the top-k logprobs of each generated token")


def _generate(args: argparse.Namespace) -> int:
    from llmlab import LLM, SamplingParams

    model = args.model
    if model is None:
        from llmlab.models.tiny import ensure_builtin_model

        model = str(ensure_builtin_model())
        print(
            f"[llmlab] no --model given: using the built-in tiny model at {model} "
            "(random weights, so the text is gibberish)",
            file=sys.stderr,
        )
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.sampling_seed,
            ignore_eos=args.ignore_eos,
            n=args.n,
            best_of=args.best_of,
            stop=args.stop,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            logprobs=args.logprobs,
        )
        llm = LLM(
            model,
            tokenizer=args.tokenizer,
            revision=args.revision,
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            max_model_len=args.max_model_len,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            enable_prefix_caching=not args.no_prefix_caching,
            scheduling_policy=args.scheduling_policy,
            eviction_policy=args.eviction_policy,
            attention_backend=args.attention_backend,
        )
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    except (ValueError, TypeError, OSError) as err:
        # A bad flag value or model path is the user's to fix: one line, no traceback.
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    for out in outputs:
        print(f"Prompt: {out.prompt!r}")
        for completion in out.outputs:
            label = "Completion" if len(out.outputs) == 1 else f"Completion {completion.index}"
            reason = f"finish_reason={completion.finish_reason}"
            if completion.stop_reason is not None:
                reason += f", stop_reason={completion.stop_reason!r}"
            print(f"{label}: {completion.text!r}  ({reason})")
            for position in completion.logprobs or ():
                shown = ", ".join(
                    f"{lp.decoded_token!r}: {lp.logprob:.3f} (rank {lp.rank})"
                    for lp in position.values()
                )
                print(f"    {shown}")
    return 0


def _components(args: argparse.Namespace) -> int:
    from llmlab import registry

    try:
        rows = registry.describe(args.kind)
    except ValueError as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    width = max(len(name) for _, name, _ in rows)
    kind = None
    for row_kind, name, doc in rows:
        if row_kind != kind:
            print(f"{'' if kind is None else chr(10)}{row_kind}:")
            kind = row_kind
        print(f"  {name:<{width}}  {doc}")
    return 0


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def main(argv: list[str] | None = None) -> int:
    # allow_abbrev=False: a misspelt flag is an error, not silently another flag's prefix.
    parser = argparse.ArgumentParser(
        prog="llmlab", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate", help="generate completions for prompts", allow_abbrev=False
    )
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    _add_engine_args(gen)
    _add_sampling_args(gen)
    comps = commands.add_parser(
        "components", help="list registered components (policies, backends)", allow_abbrev=False
    )
    comps.add_argument(
        "kind", nargs="?", default=None,
        help="scheduling_policy, eviction_policy or attention_backend (default: all)",
    )
    args = parser.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    if args.command == "components":
        return _components(args)
    return 1  # unreachable: argparse rejects unknown commands


if __name__ == "__main__":
    sys.exit(main())
