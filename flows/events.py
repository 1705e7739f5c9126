"""Emit `dflash.dataset.updated` so the deployment trigger retrains on new data.

    python -m flows.events --data-uri s3://bucket/chat/2026-11-30/ [--dataset chat]
"""

from __future__ import annotations

import argparse
import asyncio
import json

from prefect.events import Event, get_events_client
from prefect.settings import PREFECT_API_URL

EVENT = "dflash.dataset.updated"


class EventNotSent(RuntimeError):
    """The event did not reach a Prefect server: nothing will retrain on the new data."""


def emit_dataset_updated(data_uri: str, dataset: str = "chat") -> str:
    """Send the event whose payload carries the new data URI to the server at PREFECT_API_URL and wait until it
    has it; returns the event id. EventNotSent when no server is named or it cannot be reached (prefect's
    emit_event only queues it for a background worker, and a cron job would never learn of a lost event)."""
    url = PREFECT_API_URL.value()
    if not url:
        raise EventNotSent("PREFECT_API_URL is not set: the event must reach the server whose deployment trigger "
                           "watches it (e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api)")
    event = Event(event=EVENT, resource={"prefect.resource.id": f"dflash.dataset.{dataset}"},
                  payload={"data_uri": data_uri})
    try:
        asyncio.run(_send(event))
    except Exception as exc:  # noqa: BLE001 - any failure to deliver is the same answer to the caller
        raise EventNotSent(f"the event was not sent to {url}: {type(exc).__name__}: {exc}; is the Prefect "
                           f"server running there? Nothing retrains on {data_uri} until it is sent") from exc
    return str(event.id)


async def _send(event: Event) -> None:
    async with get_events_client(reconnection_attempts=2) as client:
        await client.emit(event)


def main(argv: list[str] | None = None) -> None:
    """Command line: emit the dataset-updated event (exit 1, with the reason, when it was not sent)."""
    parser = argparse.ArgumentParser(description=f"emit {EVENT} (triggers retraining on new data)")
    parser.add_argument("--data-uri", required=True, help="where the new chat data is (any fsspec URI)")
    parser.add_argument("--dataset", default="chat", help="dataset name, part of the event's resource id")
    args = parser.parse_args(argv)
    try:
        event_id = emit_dataset_updated(args.data_uri, args.dataset)
    except EventNotSent as exc:
        parser.exit(1, f"flows.events: error: {exc}\n")
    print(json.dumps({"event": EVENT, "id": event_id}))


if __name__ == "__main__":
    main()
