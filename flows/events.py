"""Emit `dflash.dataset.updated` so the deployment trigger retrains on new data.

    python -m flows.events --data-uri s3://bucket/chat/2026-11-30/ [--dataset chat]
"""

from __future__ import annotations

import argparse
import json

from prefect.events import emit_event

EVENT = "dflash.dataset.updated"


def emit_dataset_updated(data_uri: str, dataset: str = "chat") -> str:
    """Emit the event whose payload carries the new data URI; returns the event id."""
    event = emit_event(event=EVENT, resource={"prefect.resource.id": f"dflash.dataset.{dataset}"},
                       payload={"data_uri": data_uri})
    if event is None:
        raise RuntimeError("the event was not emitted: is PREFECT_API_URL set to a running server?")
    return str(event.id)


def main(argv: list[str] | None = None) -> None:
    """Command line: emit the dataset-updated event."""
    parser = argparse.ArgumentParser(description=f"emit {EVENT} (triggers retraining on new data)")
    parser.add_argument("--data-uri", required=True, help="where the new chat data is (any fsspec URI)")
    parser.add_argument("--dataset", default="chat", help="dataset name, part of the event's resource id")
    args = parser.parse_args(argv)
    print(json.dumps({"event": EVENT, "id": emit_dataset_updated(args.data_uri, args.dataset)}))


if __name__ == "__main__":
    main()
