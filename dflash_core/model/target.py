"""The frozen target model: loading, and capture of the hidden states the drafter is conditioned on."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import cast

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from dflash_core.errors import InputError
from dflash_core.io import missing_local_folder

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetError(InputError):
    """A target model that cannot be used (bad path, bad layer ids, unsupported layout)."""


class _StopForward(Exception):
    """Raised by the hook on the last needed layer: the remaining layers and the vocab head are never run."""


class TargetModel:
    """A frozen causal LM with the two things DFlash needs: layer outputs, and its embeddings and head."""

    def __init__(self, model: PreTrainedModel):
        self.model = model.eval().requires_grad_(False)
        self.config = model.config.get_text_config()  # a multimodal checkpoint's (Gemma 3/4) nests it
        if (why := unsupported_target(self.config)) is not None:
            raise TargetError(why)
        self.embed_tokens = cast(nn.Embedding, model.get_input_embeddings())
        self.lm_head = cast(nn.Linear, model.get_output_embeddings())
        self._layers = _decoder_layers(model)
        # forward hooks are module-global: two threads capturing at once would mix their outputs
        self._lock = threading.Lock()

    @property
    def num_layers(self) -> int:
        """L, the number of decoder layers."""
        return len(self._layers)

    @property
    def hidden_size(self) -> int:
        """H, the width of every layer output."""
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        """V, the rows of the embedding and of the head."""
        return int(self.embed_tokens.weight.shape[0])

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The weights' dtype."""
        return self.embed_tokens.weight.dtype

    def check_layer_ids(self, layer_ids: Sequence[int], served: bool = True) -> list[int]:
        """Layer ids as a list, or TargetError naming the bad ones (check_layer_ids on this target's depth)."""
        return check_layer_ids(layer_ids, self.num_layers, served)

    # no_grad, not inference_mode: inference tensors could not be saved for the drafter's backward
    @torch.no_grad()
    def capture(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layer_ids: Sequence[int]
    ) -> torch.Tensor:
        """Concatenated outputs of `layer_ids` -> [B, S, K*H]; runs no layer past the last one needed."""
        layer_ids = self.check_layer_ids(layer_ids, served=False)  # a published drafter is evaluated as it is
        wanted = sorted(set(layer_ids))
        outputs: dict[int, torch.Tensor] = {}
        with self._lock:
            handles = [
                self._layers[i].register_forward_hook(self._hook(i, wanted[-1], outputs)) for i in wanted
            ]
            try:
                self._run_base(input_ids, attention_mask)
            except _StopForward:
                pass
            finally:
                for handle in handles:
                    handle.remove()
        if self.num_layers - 1 in outputs:
            # transformers reports the last entry of hidden_states after the final norm; match it
            outputs[self.num_layers - 1] = self._final_norm(outputs[self.num_layers - 1])
        return torch.cat([outputs[i] for i in layer_ids], dim=-1)

    def _hook(self, index: int, last: int, outputs: dict[int, torch.Tensor]):
        def hook(_module: nn.Module, _args: object, output: object) -> None:
            outputs[index] = cast(torch.Tensor, output[0] if isinstance(output, tuple) else output)
            if index == last:
                raise _StopForward

        return hook

    def _run_base(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        mask = None if attention_mask is None else attention_mask.to(self.device)
        base(input_ids=input_ids.to(self.device), attention_mask=mask, use_cache=False)

    def _final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        norm = next((getattr(base, name) for name in _FINAL_NORMS if hasattr(base, name)), None)
        if norm is None:
            raise TargetError(f"{type(base).__name__}: no final norm found (looked for {', '.join(_FINAL_NORMS)}), "
                              "so the last layer's output cannot be given as transformers' hidden_states has it; "
                              "use a drafter whose target_layer_ids leave out the last layer")
        return norm(hidden)


# the final norm's name in transformers' decoders: most, Falcon-H1 and the like, LFM2
_FINAL_NORMS = ("norm", "final_layernorm", "embedding_norm")


def unsupported_target(config: PretrainedConfig) -> str | None:
    """Why a target's text config cannot feed a drafter, None when it can (read from the config alone: said before
    any data work). Gemma 3n's layers carry `altup_num_inputs` AltUp streams ([streams, batch, seq, hidden]), not
    one hidden state per token."""
    kind = getattr(config, "model_type", type(config).__name__)
    if streams := getattr(config, "altup_num_inputs", None):
        return (f"target model_type {kind!r} (Gemma 3n) is not supported: its decoder layers carry {streams} AltUp "
                "streams per token rather than one hidden state, which neither this pipeline nor the serving "
                "engines' DFlash capture; train the drafter for a target whose layers give one (Gemma 3 or 4, "
                "Qwen3, Llama, ...)")
    return None


def _decoder_layers(model: PreTrainedModel) -> nn.ModuleList:
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        raise TargetError(
            f"{type(model).__name__}: expected a decoder-only LM with `model.layers` (Qwen3/Llama layout); "
            "this architecture is not supported as a DFlash target"
        )
    return layers


def check_layer_ids(layer_ids: Sequence[int], num_layers: int, served: bool = True) -> list[int]:
    """Layer ids as a list, or TargetError naming the bad ones. `served` (a drafter to train or export, not one
    read to evaluate as it is) also holds them to what the serving engines capture: ids in increasing order, each
    once (vLLM and SGLang collect the layers in layer order, once each, and concatenate them so for `fc`), and not
    the last layer (vLLM hands its output over before the final norm, SGLang does not capture it)."""
    bad = [i for i in layer_ids if not 0 <= int(i) < num_layers]
    if not layer_ids or bad:
        raise TargetError(
            f"target_layer_ids {list(layer_ids)}: every id must be in 0..{num_layers - 1} "
            f"(the target has {num_layers} layers); bad: {bad or 'empty list'}"
        )
    ids = [int(i) for i in layer_ids]
    if served and any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        raise TargetError(f"target_layer_ids {ids}: give them in increasing order, each once; vLLM and SGLang "
                          f"capture the target's layers in layer order, once each, so a served drafter would "
                          f"get its features in another order or fewer of them")
    if served and num_layers - 1 in ids:
        raise TargetError(f"target_layer_ids {ids}: {num_layers - 1} is the target's last layer, whose "
                          f"output the serving engines do not hand over as training sees it (vLLM before the "
                          f"final norm, SGLang not at all); use an earlier layer (the default spread ends at "
                          f"L-3)")
    return ids

def target_text_config(path: str, trust_remote_code: bool = False) -> PretrainedConfig | None:
    """A target's (text model's) config alone, no weights read; None when it cannot be read here (loading the
    target reports why, with its own message)."""
    from transformers import AutoConfig

    if missing_local_folder(path):
        return None
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code).get_text_config()
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def target_dims(path: str, trust_remote_code: bool = False) -> tuple[int, int, int] | None:
    """(hidden size, vocab size, layers) of a target from its config alone, no weights read: what a drafter must
    match. None when the config cannot be read here."""
    config = target_text_config(path, trust_remote_code)
    return None if config is None else config_dims(config)


def config_dims(config: PretrainedConfig) -> tuple[int, int, int] | None:
    """(hidden size, vocab size, layers) of a target's text config; None when it does not give them as numbers."""
    try:
        return int(config.hidden_size), int(config.vocab_size), int(config.num_hidden_layers)
    except (ValueError, AttributeError, TypeError):
        return None


def _from_pretrained(path: str, dtype: torch.dtype | str, trust_remote_code: bool) -> PreTrainedModel:
    """The model as a causal LM; a multimodal checkpoint transformers maps to no causal LM (Kimi K2.5) as the
    image-text-to-text model around its language model (its text layers, embeddings and head are the target's)."""
    from transformers import AutoModelForImageTextToText

    kwargs: dict = {"dtype": dtype, "trust_remote_code": trust_remote_code, "use_kernels": False}
    try:
        return AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        try:
            return AutoModelForImageTextToText.from_pretrained(path, **kwargs)
        except ValueError:
            raise exc from None  # neither: transformers' first answer says what it expected


def load_target(
    path: str,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> TargetModel:
    """Load a causal LM (local path or hub id) frozen, in eval mode, on `device`."""
    torch_dtype = _DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if missing_local_folder(path):
        raise TargetError(f"target '{path}': no such folder; give a local model folder or a hub id like Qwen/Qwen3-8B")
    try:
        # use_kernels: transformers 5.25 turned Hub kernels on by default (a download on load, and an error where
        # the `kernels` package is missing); the target runs transformers' own layers, as it did before
        model = _from_pretrained(path, torch_dtype, trust_remote_code)
    except (OSError, ValueError) as exc:
        raise TargetError(f"cannot load the target model from '{path}': {exc}") from exc
    # nn.Module.to moves in place; transformers' decorated `to` has a signature type checkers misread
    return TargetModel(model.to(device))  # type: ignore[arg-type]
