"""`tfserve serve`'s Limits flags: what one request may ask of the server (messages, sequences, model swaps)
and what the server keeps for clients (stored responses, conversations). Each is a 400 (a swap: 429) past its
budget; docs/deploy.md's "Limits" table lists them beside the connection limits."""

from __future__ import annotations

from typing import Annotated

import typer

from tfserve.images import DEFAULT_MAX_REQUEST_PIXELS  # noqa: F401  (serve's default, named here with its flag)
from tfserve.server.runtime.request_limits import (DEFAULT_MAX_MESSAGES, DEFAULT_MAX_SEQS_PER_REQUEST,  # noqa: F401
                                                   DEFAULT_MODEL_SWAP_INTERVAL_S, DEFAULT_STORE_BYTES,
                                                   DEFAULT_STORED_ITEM_BYTES, RequestLimits)

LIMITS = "Limits"
MIB = 2**20

MaxMessagesOpt = Annotated[int, typer.Option(
    min=1, metavar="N", rich_help_panel=LIMITS,
    help="Messages (or Responses input items) one request may hold; more is a 400 before any is read.")]
MaxSeqsPerRequestOpt = Annotated[int, typer.Option(
    min=1, max=128, metavar="N", rich_help_panel=LIMITS,
    help="Sequences one prompt may make (`n`, `best_of`): a request's share of the running batch.")]
MaxRequestPixelsOpt = Annotated[int, typer.Option(
    min=1, metavar="PIXELS", rich_help_panel=LIMITS,
    help="Decoded pixels of all a request's images together, read from their headers before any is decoded.")]
ModelSwapIntervalOpt = Annotated[float, typer.Option(
    min=0, metavar="SECONDS", rich_help_panel=LIMITS,
    help="A request naming another model within SECONDS of the last model load gets 429 (Retry-After) instead "
         "of evicting the resident one (0: no limit).")]
PinModelOpt = Annotated[bool, typer.Option(
    "--pin-model", rich_help_panel=LIMITS,
    help="Never swap the resident model: a request naming another gets 404, as without a model store.")]
MaxStoreMibOpt = Annotated[int, typer.Option(
    min=1, metavar="MIB", rich_help_panel=LIMITS,
    help="Stored responses, and conversations, each keep at most MIB (as JSON); the oldest are dropped first.")]
MaxStoredItemMibOpt = Annotated[int, typer.Option(
    min=1, metavar="MIB", rich_help_panel=LIMITS,
    help="One stored response or conversation, at most; a request that would grow one past it is a 400.")]

DEFAULT_STORE_MIB = DEFAULT_STORE_BYTES // MIB
DEFAULT_STORED_ITEM_MIB = DEFAULT_STORED_ITEM_BYTES // MIB


def request_limits(max_messages: int, max_seqs_per_request: int, model_swap_interval: float, max_store_mib: int,
                   max_stored_item_mib: int) -> RequestLimits:
    """The Limits flags as the server's RequestLimits; a usage error naming the flag for a pair that disagrees."""
    if max_stored_item_mib > max_store_mib:
        raise typer.BadParameter(f"{max_stored_item_mib} MiB is more than --max-store-mib ({max_store_mib})",
                                 param_hint="--max-stored-item-mib")
    return RequestLimits(max_messages=max_messages, max_seqs_per_request=max_seqs_per_request,
                         model_swap_interval_s=model_swap_interval, max_store_bytes=max_store_mib * MIB,
                         max_stored_item_bytes=max_stored_item_mib * MIB)
