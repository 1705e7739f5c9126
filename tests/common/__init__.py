"""Test helpers shared by the test modules, organised like the code they feed.

models: the one tiny-Qwen3 factory (in memory or saved as a target); chat: tokenizers and chat data for the
tokenize stage; runs: token shards, plans, configs and torchrun for the runtime; logs: synthetic metrics logs;
flows: flow-test config and Prefect look-ups. Files are written with dflash_core.io.write_jsonl.
"""
