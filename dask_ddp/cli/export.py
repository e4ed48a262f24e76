"""Runs in: the user's shell: ``dask-ddp export``, a sharded checkpoint as one ``torch.save`` or safetensors file.

One process reads every shard of a committed step (checking each CRC-32; values that are not tensors only
with torch.load(weights_only=True): a checkpoint holding anything else is refused, nothing in it runs) and
writes one file, e.g. for serving or for a tool that knows nothing of DCP::

    dask-ddp export s3://bucket/ckpt/train-1a2b3c4d model.pt
    dask-ddp export ./ckpt/train-1a2b3c4d model.safetensors --format safetensors --step 1200

Exit codes: 0 written, 1 the checkpoint could not be read or the file written (the reason on stderr),
2 usage errors.
"""

from __future__ import annotations

import argparse
import json
import sys

from dask_ddp.cli.common import EXIT_FAILED, EXIT_OK, int_at_least, usage_error

__all__ = ["add_parser", "main"]


def add_parser(commands) -> None:
    """Add the ``export`` command and its options to ``commands`` (what ``add_subparsers`` returned).

    Raises
    ------
    argparse.ArgumentError
        ``commands`` has an ``export`` command already.
    """
    parser = commands.add_parser("export", help="write a sharded checkpoint as one torch.save or safetensors file",
                                 description=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", help="the job's checkpoint folder (<checkpoint_dir>/<run_id>; any fsspec URL)")
    parser.add_argument("out", help="the file to write (path or fsspec URL)")
    parser.add_argument("--step", type=int_at_least(0), default=None, help="the step (default: the newest committed)")
    parser.add_argument("--format", choices=("torch", "safetensors"), default=None,
                        help="default: safetensors for a .safetensors name, else torch")
    parser.add_argument("--storage-options", default=None, metavar="JSON",
                        help='fsspec options of both URLs as JSON, e.g. \'{"client_kwargs": {"endpoint_url": '
                             '"http://127.0.0.1:5555"}}\' (credentials: better in the environment)')
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    """Run ``dask-ddp export``; return the exit code. Raises nothing but KeyboardInterrupt."""
    from dask_ddp.checkpoint.sharded.export import export_sharded

    try:
        options = json.loads(args.storage_options) if args.storage_options else None
    except json.JSONDecodeError as exc:
        return usage_error("export", f"--storage-options is not JSON: {exc}")
    if options is not None and not isinstance(options, dict):
        return usage_error("export", "--storage-options takes a JSON object")
    fmt = args.format or ("safetensors" if args.out.endswith(".safetensors") else "torch")
    try:
        step = export_sharded(args.directory, args.out, step=args.step, format=fmt, storage_options=options,
                              out_options=options)
    except Exception as exc:  # noqa: BLE001 - reported to the user, exit code 1
        print(f"dask-ddp export: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"dask-ddp export: step {step} of {args.directory} written to {args.out} ({fmt})")
    return EXIT_OK
