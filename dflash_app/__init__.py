"""The application layer: the `dflash` command, the config presets, example:// resolution and the demo.

Layers (checked by `make lint`): dflash_app -> flows -> dflash_core; dflash_core never imports the other two.
"""
