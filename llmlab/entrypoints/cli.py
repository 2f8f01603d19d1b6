"""The ``llmlab`` command line.

    llmlab generate "Hello, my name is" --max-tokens 32 --temperature 0.8
    llmlab generate "Hello" --model Qwen/Qwen3-0.6B --scheduling-policy fair
    llmlab generate "Hello" --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    llmlab components            # every registered policy and backend, with its one-line doc
    llmlab serve [MODEL] --port 8000 --api-key KEY     # an OpenAI-compatible server
    llmlab bench serve --base-url http://127.0.0.1:8000 --num-prompts 100

Without a model it runs llmlab's built-in story model (3.3M parameters, trained on
synthetic children's stories and shipped in the package), so the command works on an
offline machine and prints readable, if simple, text.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading


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
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="automatic prefix caching (default on)")
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                        action="store_false", help="same as --no-enable-prefix-caching")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    _add_component_args(parser)
    parser.add_argument("--cpu-linear", choices=("auto", "onednn", "plain"), default="auto",
                        help="on CPU: prepacked oneDNN linears or F.linear (default auto)")
    parser.add_argument("--cpu-fused-ops", action=argparse.BooleanOptionalAction, default=True,
                        help="on CPU: fused C++ residual+norm, rotary, SiLU x up (default on)")
    parser.add_argument("--cuda-fused-ops", action=argparse.BooleanOptionalAction, default=True,
                        help="on CUDA: the same as Triton kernels (default on)")
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch/OpenMP threads (default: $LLMLAB_CPU_THREADS, else "
                        "$OMP_NUM_THREADS, else the cores this process may use)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, vLLM\'s JSON: e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 4}\' (default off; docs/speculative.md)')
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split every layer across this many devices (default 1)")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="run this many engine replicas, each in a process of its own, "
                        "behind a router (default 1; docs/distributed.md)")
    parser.add_argument("--engine-core-process", action=argparse.BooleanOptionalAction,
                        default=False, help="run the engine in a process of its own, apart "
                        "from the server's HTTP work (default off)")
    parser.add_argument("--distributed-executor-backend", choices=("mp", "ray", "uni"),
                        default=None, help="how tensor-parallel ranks are started (default: "
                        "uni at --tensor-parallel-size 1, else mp)")
    parser.add_argument("--distributed-timeout-s", type=float, default=600.0,
                        help="how long a rank or replica may take to start, or wait on a "
                        "collective (default 600)")
    parser.add_argument("--replica-heartbeat-timeout-s", type=float, default=None,
                        help="with --data-parallel-size > 1: a replica that sends no "
                        "heartbeat for this long is unresponsive (no new requests; its "
                        "unstarted requests move to another replica, started ones fail) "
                        "until it answers again (default 10)")
    parser.add_argument("--replica-wedged-after-s", type=float, default=None,
                        help="with --data-parallel-size > 1: so is a replica whose current "
                        "step has run this long (default 60)")
    # Every other EngineConfig field, generated from it (vLLM's spellings: --enforce-eager,
    # --trust-remote-code, --max-logprobs, --[no-]enable-chunked-prefill,
    # --num-gpu-blocks-override, ...), so a new config field is a flag by itself.
    from llmlab.entrypoints.arg_utils import EngineArgs

    EngineArgs.add_cli_args(parser, skip=("model",))


# Every component kind an engine takes, the one way (docs/components.md): --KIND NAME (a
# registered name or package.module:Class) and --KIND-config JSON (its constructor's keyword
# arguments). Defaults are the EngineConfig's (None: the built-in default).
_COMPONENT_HELP = {
    "scheduling_policy": "which waiting request runs next (default fcfs)",
    "eviction_policy": "which cached KV block is evicted (default lru)",
    "attention_backend": "default auto: triton on CUDA, llmlab's C++ kernels on CPU, else torch",
    "sampler": "the sampler (default: the built-in one)",
    "router": "with --data-parallel-size > 1, which replica gets each request: round_robin "
              "(default), least_loaded, prefix_aware, session_affinity",
    "kv_press": "a KV press compacting each request's cache (snapkv, streaming_llm, knorm, ...; "
                "default off)",
}
# LLM keywords that fold into another setting (not EngineConfig fields).
_FOLDED_FLAGS = ("proposer", "proposer_config", "pooler")


def _add_component_args(parser: argparse.ArgumentParser) -> None:
    names = "a registered name (see `llmlab components`) or package.module:Class"
    for kind, what in _COMPONENT_HELP.items():
        flag = "--" + kind.replace("_", "-")
        parser.add_argument(flag, default=None, metavar="NAME", help=f"{names}: {what}")
        parser.add_argument(f"{flag}-config", default=None, metavar="JSON",
                            help=f"keyword arguments for the {kind}'s constructor, a JSON object")
    parser.add_argument("--proposer", default=None, metavar="NAME",
                        help=f"speculative decoding's drafter, {names} (the same setting as "
                        "--speculative-config's method; num_speculative_tokens 4 unless it "
                        "says otherwise)")
    parser.add_argument("--proposer-config", default=None, metavar="JSON",
                        help="keyword arguments for the proposer's constructor, a JSON object")
    parser.add_argument("--pooler", default=None, metavar="NAME",
                        help="a pooling engine's pooler (last, mean, cls, or package.module:"
                        "Class): --pooler-config's pooling_type")
    parser.add_argument("--plugins", nargs="+", default=(), metavar="NAME",
                        help=f"feature plugins, each {names} (docs/components.md)")
    parser.add_argument("--plugin-config", default=None, metavar="JSON",
                        help="per plugin (keyed by its entry in --plugins), its keyword "
                        "arguments: a JSON object of objects")


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

    model = _model_or_builtin(args.model)
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
        llm = LLM(model, **_engine_settings(args))
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


def _model_or_builtin(model: str | None) -> str:
    if model is not None:
        return model
    from llmlab.builtin import ensure_builtin_model

    path = str(ensure_builtin_model())
    print(
        f"[llmlab] no model given: using the built-in story model at {path} "
        "(a tiny model trained on simple synthetic stories)",
        file=sys.stderr,
    )
    return path


# Data-parallel settings that are build_engine keywords, not EngineConfig fields (None:
# the default).
_DATA_PARALLEL_FLAGS = ("replica_heartbeat_timeout_s", "replica_wedged_after_s")


def _engine_settings(args: argparse.Namespace) -> dict:
    """``LLM(...)`` keyword arguments from the engine flags: every ``EngineConfig`` field
    but ``model`` (each has a flag, see ``_add_engine_args``; the components among them),
    and the component flags that fold into another setting (``--proposer``, ``--pooler``)."""
    import attrs

    from llmlab.config import EngineConfig

    fields = [f.name for f in attrs.fields(EngineConfig) if f.name != "model"]
    settings = {name: getattr(args, name) for name in fields}
    for name in (*_FOLDED_FLAGS, *_DATA_PARALLEL_FLAGS):
        if getattr(args, name, None) is not None:
            settings[name] = getattr(args, name)
    return settings


def _build_app(build_app, engine, args, names, model, api_key, chat_template, origins,
               tool_parser):
    """The server's app from the serve flags."""
    return build_app(engine, served_model_names=names, model_path=model, api_key=api_key,
                     freeze_gc=True,  # this process serves this one engine for its life
                     chat_template=chat_template, allowed_origins=origins,
                     trust_request_chat_template=args.trust_request_chat_template,
                     open_metrics=args.open_metrics, open_docs=args.open_docs,
                     max_request_body_bytes=args.max_request_body_bytes,
                     max_prompts_per_request=args.max_prompts_per_request,
                     max_sequences_per_request=args.max_sequences_per_request,
                     max_queued_sequences=args.max_queued_sequences,
                     max_queued_tokens=args.max_queued_tokens,
                     return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                     enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                     response_role=args.response_role, root_path=args.root_path,
                     enable_auto_tool_choice=args.enable_auto_tool_choice,
                     tool_call_parser=tool_parser,
                     lora_modules=args.lora_modules or ())


def _serve(args: argparse.Namespace) -> int:
    import os

    try:
        import uvicorn

        from llmlab.entrypoints.server.app import build_app
    except ImportError as err:
        print(f"error: llmlab serve needs fastapi and uvicorn ({err}); "
              "pip install fastapi uvicorn prometheus-client", file=sys.stderr)
        return 2
    from llmlab.entrypoints.async_engine import AsyncEngine

    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        print("error: give the model once (positionally or with --model)", file=sys.stderr)
        return 2
    given = args.model_tag or args.model
    model = _model_or_builtin(given)
    names = args.served_model_name or [given or "llmlab-stories"]
    api_key = args.api_key or os.environ.get("LLMLAB_API_KEY") or None
    try:
        chat_template = _read_chat_template(args.chat_template)
        origins = _origins(args.allowed_origins)
        tool_parser = _tool_parser(args)
        engine = AsyncEngine.from_settings(model, **_engine_settings(args))
    except (ValueError, TypeError, OSError) as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    try:
        app = _build_app(build_app, engine, args, names, model, api_key, chat_template, origins,
                         tool_parser)
    except ValueError as err:  # e.g. a --lora-modules adapter that cannot run
        engine.shutdown()
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    print(f"[llmlab] serving {model} as {', '.join(names)} on http://{args.host}:{args.port}"
          f"{' (API key required)' if api_key else ''}", file=sys.stderr)
    # SIGINT/SIGTERM: uvicorn stops accepting connections; requests in flight get
    # --shutdown-grace-s to finish; then the engine stops, which ends every request left with
    # an in-band error and [DONE] (streams) or a JSON 503, so uvicorn's own (later) deadline
    # never has to cut a response.
    grace = args.shutdown_grace_s
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=grace + 5,
                            timeout_keep_alive=args.timeout_keep_alive)
    server = _graceful_server(config, engine=engine, grace_s=grace)
    # uvicorn handles the signals itself, then raises them again once it has shut down;
    # these handlers turn that (however many arrive) into a normal exit with status 0.
    _STOPPED.clear()
    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server.run()
        except (KeyboardInterrupt, _Stopped):
            pass
        finally:
            engine.shutdown()
    except (KeyboardInterrupt, _Stopped):
        pass  # one more signal while shutting down: already on the way out
    finally:
        # uvicorn re-raises the signals it caught once it is done; one still to come must
        # not turn this finished shutdown into a death by signal (exit status -2).
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
    print("[llmlab] server shut down", file=sys.stderr)
    return 0


class _Stopped(Exception):
    """SIGTERM (or SIGINT) arrived after the server had shut down."""


_STOPPED = threading.Event()


def _stop(signum, frame) -> None:
    if _STOPPED.is_set():
        return  # a second signal: the first is already ending the process
    _STOPPED.set()
    raise _Stopped(signal.Signals(signum).name)


def _graceful_server(config, *, engine, grace_s: float):
    """uvicorn's ``Server`` for ``config`` (uvicorn is imported only to serve)."""
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, plus: the first shutdown signal starts a timer that stops the
        engine after the grace period (ending what is still in flight in-band); a second
        one stops it at once."""

        def __init__(self, config, *, engine, grace_s: float) -> None:
            super().__init__(config)
            self._engine = engine
            self._grace_s = grace_s
            self._timer: threading.Timer | None = None

        def handle_exit(self, sig, frame) -> None:
            if self._timer is None:
                self._timer = threading.Timer(self._grace_s, self._engine.shutdown)
                self._timer.daemon = True
                self._timer.start()
                super().handle_exit(sig, frame)
                return
            # A second signal: end what is in flight now, in-band, rather than let uvicorn
            # force its exit (which cuts responses and skips the app's shutdown).
            self._timer.cancel()
            threading.Thread(target=self._engine.shutdown, daemon=True).start()

    return GracefulServer(config, engine=engine, grace_s=grace_s)


def _read_chat_template(value: str | None) -> str | None:
    """A template file's contents, or the template itself when ``value`` is not a file."""
    import pathlib

    if value is None:
        return None
    path = pathlib.Path(value)
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def _tool_parser(args: argparse.Namespace):
    """``--tool-call-parser`` (``--tool-parser``) with ``--tool-parser-config``: the factory
    of a fresh parser per stream, checked before the model loads (None: none)."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME "
                         "(`llmlab components tool_parser` lists them)")
    from llmlab import registry

    if args.tool_call_parser is None:
        registry.build("tool_parser", None, args.tool_parser_config)  # refuses a lone config
        return None
    from llmlab.entrypoints.server.tool_parsers import parser_factory

    return parser_factory(
        registry.factory("tool_parser", args.tool_call_parser, args.tool_parser_config))


def _origins(values: list[str] | None) -> list[str]:
    """``--allowed-origins a b`` or vLLM's JSON list ``--allowed-origins '["*"]'``."""
    import json

    if not values:
        return []
    if len(values) == 1 and values[0].lstrip().startswith("["):
        try:
            parsed = json.loads(values[0])
        except json.JSONDecodeError as err:
            raise ValueError(f"--allowed-origins is not a JSON list: {err}") from None
        if not isinstance(parsed, list) or not all(isinstance(o, str) for o in parsed):
            raise ValueError("--allowed-origins must be a JSON list of strings")
        return parsed
    return list(values)


def _components(args: argparse.Namespace) -> int:
    from llmlab import registry

    try:
        rows = registry.describe(args.kind)
    except ValueError as err:
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 2
    width = max((len(name) for _, name, _ in rows), default=0)
    for i, kind in enumerate([args.kind] if args.kind is not None else list(registry.KINDS)):
        print(f"{chr(10) if i else ''}{kind}:")
        listed = [(name, doc) for row_kind, name, doc in rows if row_kind == kind]
        for name, doc in listed:
            print(f"  {name:<{width}}  {doc}")
        if not listed:  # e.g. plugin: none built in; yours appear once imported
            print("  (none registered)")
    return 0


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # noqa: SLF001 (argparse has no API for this)
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return action.choices[name]
    raise KeyError(name)


def _config_defaults(path: str, parser: argparse.ArgumentParser) -> dict:
    """``llmlab serve --config FILE.yaml``: a YAML mapping of flag names (``max-num-seqs``
    or ``max_num_seqs``; ``model`` for the model) to values, as defaults the command
    line's own flags override (vLLM's ``--config``). Raises ValueError naming a bad key."""
    try:
        import yaml
    except ImportError as err:
        raise ValueError(f"--config needs PyYAML ({err}); pip install pyyaml") from None
    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
    except yaml.YAMLError as err:
        raise ValueError(f"--config {path}: not valid YAML ({_one_line(err)})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"--config {path} must hold a mapping of flag names to values, got "
                         f"{type(loaded).__name__}")
    dests = {a.dest: a for a in parser._actions if a.option_strings}  # noqa: SLF001
    defaults = {}
    for key, value in loaded.items():
        name = str(key).lstrip("-").replace("-", "_")
        if name == "model":
            name = "model_tag"
        elif name not in dests or name in ("config", "help"):
            raise ValueError(f"--config {path}: unknown flag {key!r}")
        action = dests.get(name)
        if action is not None and action.nargs in ("+", "*") and not isinstance(value, list):
            value = [value]
        if action is not None and action.type is not None and isinstance(value, str):
            value = action.type(value)
        defaults[name] = value
    return defaults


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None):
        serve = _subparser(parser, args.command)
        try:
            serve.set_defaults(**_config_defaults(args.config, serve))
        except (ValueError, TypeError, OSError) as err:
            print(f"error: {_one_line(err)}", file=sys.stderr)
            return 2
        args = parser.parse_args(argv)  # the command line's flags win over the file
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "bench":
        from llmlab.loadtest import run_bench_serve

        return run_bench_serve(args)
    if args.command == "components":
        return _components(args)
    return 1  # unreachable: argparse rejects unknown commands


def build_parser() -> argparse.ArgumentParser:
    """The ``llmlab`` command line's parser (every subcommand and flag)."""
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
        help="a component kind: scheduling_policy, eviction_policy, attention_backend, "
             "sampler, proposer, router, pooler, tool_parser, kv_press, plugin, model "
             "(default: all)",
    )
    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server", allow_abbrev=False
    )
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                       help="local directory or hub id (default: the built-in story model)")
    _add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="interface to bind (default 127.0.0.1; 0.0.0.0 for all)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None,
                       help="require this key on /v1 routes (default: $LLMLAB_API_KEY)")
    serve.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters to serve by name (needs --enable-lora): name=path "
                       "or JSON '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    serve.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients use for the model (default: MODEL as given)")
    serve.add_argument("--chat-template", default=None,
                       help="a Jinja chat template, or a file holding one")
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat_template in requests (off: a template is code "
                            "the server runs; vLLM's flag)")
    serve.add_argument("--open-metrics", action="store_true",
                       help="serve /metrics without the API key")
    serve.add_argument("--open-docs", action="store_true",
                       help="serve /docs, /redoc and /openapi.json without the API key")
    serve.add_argument("--timeout-keep-alive", type=float, default=65.0,
                       help="seconds an idle keep-alive connection stays open (default 65: "
                            "longer than common clients keep idle connections, so none "
                            "reuses one the server is closing; uvicorn's own is 5)")
    serve.add_argument("--shutdown-grace-s", type=float, default=30.0,
                       help="on SIGTERM/SIGINT, how long requests in flight may finish before "
                            "they end with an error (default 30)")
    serve.add_argument("--max-request-body-bytes", type=int, default=32 * 2**20,
                       help="larger request bodies get a 413 (default 32 MiB)")
    serve.add_argument("--max-prompts-per-request", type=int, default=256,
                       help="the most prompts in one completions request (default 256)")
    serve.add_argument("--max-sequences-per-request", type=int, default=1024,
                       help="the most prompts x max(n, best_of) in one request (default 1024)")
    serve.add_argument("--max-queued-sequences", type=int, default=4096,
                       help="sequences in flight (prompts x max(n, best_of), queued or "
                            "running) before new requests get a 429 with Retry-After "
                            "(default 4096)")
    serve.add_argument("--max-queued-tokens", type=int, default=None,
                       help="tokens in flight (prompt + max_tokens per sequence; without "
                            "max_tokens, the whole context) before new requests get a 429 "
                            "with Retry-After (default: max-queued-sequences x "
                            "max-model-len / 8, at least 4194304)")
    serve.add_argument("--allowed-origins", nargs="*", default=None,
                       help='CORS origins: a list, or a JSON list such as \'["*"]\'')
    serve.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's log level (default info)")
    serve.add_argument("--config", default=None, metavar="FILE.yaml",
                       help="a YAML mapping of flag names to values (max-num-seqs: 8, ...); "
                            "flags on the command line win")
    serve.add_argument("--disable-log-requests", action="store_true",
                       help="accepted for vLLM compatibility (llmlab logs no request lines)")
    serve.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprob tokens as 'token_id:N' strings (vLLM's flag)")
    serve.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                       help="serve /tokenizer_info (vLLM's flag)")
    serve.add_argument("--response-role", default="assistant",
                       help="the role of chat completion replies (default assistant)")
    serve.add_argument("--root-path", default=None,
                       help="the path prefix a proxy serves this app under (FastAPI's root_path)")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='tool_choice "auto" (the default with tools): tool calls found in '
                            "the model's text by --tool-call-parser (vLLM's flag)")
    serve.add_argument("--tool-call-parser", "--tool-parser", dest="tool_call_parser",
                       default=None, metavar="NAME",
                       help="a tool_parser component (built-in: hermes) or module:Class; "
                            "`llmlab components tool_parser` lists them (vLLM's flag; "
                            "--tool-parser is llmlab's spelling of every --KIND)")
    serve.add_argument("--tool-parser-config", default=None, metavar="JSON",
                       help="keyword arguments for the tool parser's constructor, a JSON "
                            "object")
    bench = commands.add_parser("bench", help="benchmarks", allow_abbrev=False)
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_commands.add_parser(
        "serve", help="load-test an OpenAI-compatible server (like vllm bench serve)",
        allow_abbrev=False,
    )
    from llmlab.loadtest import add_bench_serve_args

    add_bench_serve_args(bench_serve)
    return parser


if __name__ == "__main__":
    sys.exit(main())
