"""The promotion gate: measure the new drafter against the promoted one, promote only when stable and better."""
