"""The examples' ``--device`` flag: where the local blocks live (default: cuda under NCCL, else
cpu; ``fs.Mesh.create`` decides that), refused clearly where CUDA is missing."""

from __future__ import annotations

import argparse

import torch


def add_device_flag(ap: argparse.ArgumentParser, what: str = "the local blocks") -> None:
    ap.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help=f"where {what} live (default: cuda under NCCL, else cpu)",
    )


def checked_device(device: str | None) -> str | None:
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda: CUDA is not available here (torch.cuda.is_available() is False); "
            "use --device cpu"
        )
    return device


def device_args(doc: str, argv=None) -> dict:
    """``{"device": ...}`` from a command line that takes ``--device`` only."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    add_device_flag(ap)
    return {"device": checked_device(ap.parse_args(argv).device)}
