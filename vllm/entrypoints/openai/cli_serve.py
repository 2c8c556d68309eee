"""`vllm serve [MODEL]`: registers the subcommand; its flags are in `serve_args`, the server
in `api_server`."""

from __future__ import annotations

import argparse

from vllm.entrypoints.cli import subcommand
from vllm.entrypoints.openai.serve_args import add_serve_args


@subcommand("serve", add_serve_args)
def _serve(args: argparse.Namespace) -> int:
    from vllm.entrypoints.openai.api_server import run

    return run(args)
