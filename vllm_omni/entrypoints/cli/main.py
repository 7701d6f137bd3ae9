"""`vllm-omni ...` and `vllm ... --omni` (vLLM 0.32 hands any `--omni` command line to main)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import fields
from typing import Any

logger = logging.getLogger("vllm_omni")


def _serve_parser(sub) -> argparse.ArgumentParser:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser

    parser = sub.add_parser(
        "serve",
        help="Serve a model's pipeline on an OpenAI-compatible API",
        description="Serve MODEL (a model folder) through its pipeline. Takes vLLM's serve "
        "flags. With no MODEL, serves the built-in tiny default model, made locally.",
    )
    make_arg_parser(parser)
    parser.add_argument(
        "--stage-configs-path",
        default=None,
        help="Pipeline YAML to use instead of the built-in pipeline for the model.",
    )
    parser.add_argument(
        "--cache-backend",
        choices=["none", "teacache", "block"],
        default=None,
        help="Step caching for diffusion stages (teacache: skip all blocks; block: always run "
        "the first/last blocks, skip the middle). Requests may override it.",
    )
    parser.add_argument(
        "--max-pending-requests",
        type=int,
        default=None,
        help="Most API requests waiting beyond what their stage runs at once (an LLM stage's "
        "max_num_seqs, a DiT's running limit); beyond it a request gets 503 with "
        "Retry-After at once (default: no limit).",
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="Most API requests in flight, running or waiting; beyond it a request gets 503 "
        "with Retry-After at once (default: no limit).",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="Seconds a request may take; past it the request is stopped in every stage and "
        "answered 504 (an error event in a stream), or 408 if its body has not all arrived. "
        "Default: no limit.",
    )
    parser.add_argument(
        "--stage-restarts",
        type=int,
        default=3,
        help="Times a stage whose engine dies or hangs is restarted (its requests in flight "
        "fail naming it; /health is 503 meanwhile). 0: never.",
    )
    parser.add_argument(
        "--stage-hang-timeout",
        type=float,
        default=120.0,
        help="Seconds a stage's engine may leave a liveness probe unanswered before it counts "
        "as hung and is restarted (it answers between steps). 0: only dead engines.",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="Run every stage as an actor on the Ray cluster at this address (HOST:PORT of "
        "the head node, or 'auto' for the one on this machine); needs vllm-omni[ray].",
    )
    parser.add_argument(
        "--ray-placement-timeout",
        type=float,
        default=60.0,
        help="Seconds a stage's placement on the Ray cluster may take before start-up fails "
        "naming the stage and the resources no node offers.",
    )
    parser.add_argument(
        "--max-request-body-mb",
        type=float,
        default=64.0,  # room for a few images or a minute of audio as base64
        help="Largest request body accepted (MiB); a larger one is a 413.",
    )
    parser.add_argument(
        "--public-metrics",
        action="store_true",
        help="With --api-key, serve /metrics without the key (for a scraper).",
    )
    parser.add_argument(
        "--no-playground",
        action="store_true",
        help="Do not serve the web playground at / (the API stays as it is).",
    )
    parser.add_argument(
        "--ulysses-degree", type=int, default=None,
        help="Diffusion stages: ranks the image tokens are split between, heads exchanged "
        "all-to-all (Flux). The stage's ranks are the product of the three degrees.",
    )
    parser.add_argument(
        "--ring-degree", type=int, default=None,
        help="Diffusion stages: ranks the image tokens are split between, keys and values "
        "passed around a ring (Flux).",
    )
    parser.add_argument(
        "--cfg-parallel-size", type=int, default=None, choices=[1, 2],
        help="Diffusion stages: 2 runs the two guidance branches on two groups of ranks "
        "(Flux, SD3, Qwen-Image).",
    )
    parser.add_argument(
        "--cache-config",
        default=None,
        help='JSON of cache settings, e.g. \'{"threshold": 0.1, "warmup_steps": 2}\' '
        "(see docs/design/diffusion-cache.md).",
    )
    # Videos API (/v1/videos)
    parser.add_argument(
        "--video-dir",
        default=None,
        help="Folder for finished video jobs (MP4, first frame, status); they survive a "
        "restart. Default: kept in memory only.",
    )
    parser.add_argument(
        "--max-video-jobs",
        type=int,
        default=64,
        help="Video jobs kept; a new one evicts the oldest finished one (429 when all run).",
    )
    parser.add_argument(
        "--video-job-ttl",
        type=float,
        default=3600.0,
        help="Seconds a finished video job (and its MP4) is kept after it was created.",
    )
    parser.add_argument(
        "--max-video-seconds",
        type=float,
        default=20.0,
        help="Longest video a request may ask for (num_frames / fps); longer is a 400.",
    )
    # Realtime API (WS /v1/realtime)
    parser.add_argument(
        "--max-realtime-sessions",
        type=int,
        default=64,
        help="Realtime sockets open at once; one more is closed with code 1013 (try later).",
    )
    parser.add_argument(
        "--realtime-idle-timeout",
        type=float,
        default=600.0,
        help="Seconds a realtime socket may send nothing before the server closes it.",
    )
    return parser


def cache_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """--cache-backend / --cache-config as one validated dict (None: not set)."""
    import json

    from pydantic import ValidationError

    from vllm_omni.engine.diffusion.cache import CacheConfig

    if args.cache_backend is None and args.cache_config is None:
        return None
    try:
        config = json.loads(args.cache_config or "{}")
    except json.JSONDecodeError as e:
        raise SystemExit(f"--cache-config is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise SystemExit("--cache-config must be a JSON object")
    if args.cache_backend is not None:
        config["method"] = args.cache_backend
    elif "method" not in config:
        raise SystemExit("--cache-config needs --cache-backend (or a 'method' field)")
    try:
        CacheConfig(**config)
    except ValidationError as e:
        raise SystemExit(f"--cache-config: {e}") from None
    return config


def diffusion_parallel(args: argparse.Namespace) -> dict[str, int] | None:
    """--ulysses-degree / --ring-degree / --cfg-parallel-size as given (None: none set)."""
    given = {name: getattr(args, name, None)
             for name in ("ulysses_degree", "ring_degree", "cfg_parallel_size")}
    given = {k: v for k, v in given.items() if v is not None}
    for name, value in given.items():
        if value < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return given or None


def _make_tiny_parser(sub) -> None:
    from vllm_omni.testing.tiny_models import BUILDERS

    parser = sub.add_parser("make-tiny", help="Build a tiny random-weight model folder")
    parser.add_argument("name", choices=sorted(BUILDERS))
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])


def explicit_engine_kwargs(
    args: argparse.Namespace, defaults: argparse.Namespace
) -> dict[str, Any]:
    """The engine args the user set on the command line (the rest stay per-stage)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    out = {}
    for f in fields(AsyncEngineArgs):
        if f.name != "model" and getattr(args, f.name, None) != getattr(defaults, f.name, None):
            out[f.name] = getattr(args, f.name)
    return out


DEMO_NAME = "omni-demo"


def default_demo() -> tuple[str, str]:
    """The tiny chat LLM's folder (built on first use) and the demo pipeline's YAML, written
    beside it with the trained digits model's folder filled in."""
    import yaml

    from vllm_omni.config.loader import BUILTIN_DIR
    from vllm_omni.testing.digits import DIGITS_MODEL
    from vllm_omni.testing.tiny_models import DEFAULT_MODEL, get_or_make

    llm = get_or_make(DEFAULT_MODEL)
    pipeline = yaml.safe_load((BUILTIN_DIR / "demo.yaml").read_text())
    for stage in pipeline["stages"]:
        if stage["engine"] == "diffusion":
            stage["model"] = str(DIGITS_MODEL)
    path = llm.parent / "demo-pipeline.yaml"
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(yaml.safe_dump(pipeline, sort_keys=False))
    partial.replace(path)  # atomic: servers starting together never read half a file
    return str(llm), str(path)


def serve(args: argparse.Namespace, defaults: argparse.Namespace) -> None:
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args

    from vllm_omni.entrypoints.openai.api_server import run_server

    if args.model_tag is not None:
        args.model = args.model_tag
    elif args.model == defaults.model:
        args.model, pipeline = default_demo()
        args.stage_configs_path = args.stage_configs_path or pipeline
        # Its folder is a cache path: a short name reads better in answers and the playground.
        args.served_model_name = args.served_model_name or [DEMO_NAME]
        logger.info("No model given: serving the built-in demo pipeline %s (LLM %s) as %r",
                    pipeline, args.model, args.served_model_name[0])
    validate_parsed_serve_args(args)
    args.cache_config = cache_config(args)
    args.diffusion_parallel = diffusion_parallel(args)
    run_server(args, explicit_engine_kwargs(args, defaults))


def main(argv: list[str] | None = None) -> None:
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--omni"]
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s"
    )
    parser = FlexibleArgumentParser(prog="vllm-omni", description="vLLM-omni command line")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_parser = _serve_parser(sub)
    _make_tiny_parser(sub)
    args = parser.parse_args(argv)

    if args.command == "make-tiny":
        from vllm_omni.testing.tiny_models import make_tiny

        print(make_tiny(args.name, args.out_dir, seed=args.seed, dtype=args.dtype))
    elif args.command == "serve":
        cli_env_setup()
        serve(args, serve_parser.parse_args([]))


if __name__ == "__main__":
    main()
