"""dflash-pipeline core library: tokenize, plan, train and check DFlash drafters (never imports Prefect)."""

__version__ = "0.1.0"
