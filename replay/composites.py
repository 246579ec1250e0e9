"""Vision-language MoE checkpoints as text teachers: the composite's own text causal LM.

A composite checkpoint (``config.json`` of a vision-language ``model_type`` such as
``qwen3_vl_moe``) whose type has no ``AutoModelForCausalLM`` class is loaded with its
transformers ``*ForConditionalGeneration`` class (``AutoModelForImageTextToText``'s, or
:data:`OWN_CLASSES`), so the family's own checkpoint handling (key layout, expert-weight
conversions) loads the weights; :class:`TextCausalLM` then keeps only its language model
(``model.language_model``, or :data:`TEXT_LM_PATHS`) and ``lm_head``, and drops the
vision tower (and any audio parts).

Why this and not the composite's forward: on text-only input every one of these
composites embeds the ids with the language model's own ``embed_tokens``, runs the
language model, and applies ``lm_head`` (tested per family against the composite's own
forward, with and without a cache). Their multimodal RoPE gives every text token the
same temporal, height and width position, which IS the 1D position the language model
derives from plain ``[B, T]`` position ids, so the explicit ``first_token_ordinal +
index`` positions of prefill replay and the cached positions of decode are the ones the
composite itself uses. Reading the language model directly keeps every reader of
``teacher.model`` (``model.model.layers``, ``model.config`` = the text config with its
``layer_types``, ``vocab_size``, ``max_position_embeddings``) the same as for a
``*ForCausalLM`` teacher, and the vision weights' memory is freed after loading.

``COMPOSITE_TEXT_TEACHERS`` maps each such composite ``model_type`` to the route
adapter of its text part (an existing family's where the text decoder is that family's
code); :mod:`replay.adapters_c` merges it into ``COMPOSITE_TEXT_FAMILIES``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

COMPOSITE_TEXT_TEACHERS: dict[str, str] = {
    "qwen3_vl_moe": "qwen3_vl_moe_text",
    "glm4v_moe": "glm4_moe",  # the same router and MoE block as GLM-4-MoE's
    "aria": "aria_text",  # its language model is AriaTextModel
    "minimax_m3_vl": "minimax_m3_vl_text",  # its language model is MiniMaxM3VLTextModel
    "glm5_next": "glm5_next_text",
    "step3p7": "step3p5",  # its text config's model_type
    "ernie4_5_vl_moe": "ernie4_5_vl_moe_text",
    "deepseek_ocr2": "deepseek_ocr2_text",
    "qwen3_omni_moe": "qwen3_moe",  # its thinker's text model routes as Qwen3-MoE
    "gemma4": "gemma4_text",
}
"""Composite ``model_type`` without a causal-LM class -> the ``model_type`` of the route
adapter its language model uses (its text config's family)."""


_LANGUAGE_MODEL = ("model.language_model", "lm_head")
TEXT_LM_PATHS: dict[str, tuple[str, str]] = {
    "qwen3_omni_moe": ("thinker.model", "thinker.lm_head"),
}
"""Where a composite keeps its language model and ``lm_head``, if not at
``model.language_model`` and ``lm_head``."""
OWN_CLASSES: dict[str, str] = {"qwen3_omni_moe": "Qwen3OmniMoeForConditionalGeneration"}
"""Composites without an ``AutoModelForImageTextToText`` class: their transformers class."""
LOAD_OPTIONS: dict[str, dict[str, Any]] = {"qwen3_omni_moe": {"enable_audio_output": False}}
"""Config overrides when loading: Qwen3-Omni's thinker only (no talker, no code2wav)."""
TEXT_CONFIG_HOLDER: dict[str, str] = {"qwen3_omni_moe": "thinker_config"}
"""The sub-config holding ``text_config``, if not the composite config itself."""


CAUSAL_LM_CLASSES: dict[str, str] = {"mistral4": "Mistral4ForCausalLM"}
"""Text causal LMs whose class transformers (5.17) registers for image-text-to-text only,
not under ``AutoModelForCausalLM``: their transformers class."""


def causal_lm_class(config: Any) -> Any:
    """The transformers class a text teacher of ``config`` is built with (None where
    ``AutoModelForCausalLM`` knows none)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    own = CAUSAL_LM_CLASSES.get(config.model_type)
    return getattr(transformers, own) if own else MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config),
                                                                                  None)


def _walk(module: Any, path: str) -> Any:
    for name in path.split("."):
        module = getattr(module, name)
    return module


class TextCausalLM(nn.Module):
    """The language model and ``lm_head`` of a loaded composite, called as a causal LM.

    ``model`` is the composite's text model (``.layers``, ``.config``), ``config`` its
    text config and ``generation_config`` the composite's (its eos ids).
    """

    def __init__(self, composite: Any) -> None:
        super().__init__()
        model_path, head_path = TEXT_LM_PATHS.get(composite.config.model_type, _LANGUAGE_MODEL)
        self.model = _walk(composite, model_path)
        self.lm_head = _walk(composite, head_path)
        self.config = self.model.config
        self.generation_config = composite.generation_config

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, input_ids: torch.Tensor, *, logits_to_keep: int = 0,
                **kwargs: Any) -> Any:
        """The composite's text-only forward: language model, then ``lm_head`` on the
        last ``logits_to_keep`` positions (all for 0), as its ``*ForConditionalGeneration``
        computes it."""
        from transformers.modeling_outputs import CausalLMOutputWithPast

        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden_BTH = outputs.last_hidden_state
        logits_BTV = self.lm_head(hidden_BTH[:, -logits_to_keep:, :])
        return CausalLMOutputWithPast(logits=logits_BTV, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states)


def is_composite_text_teacher(model_type: str) -> bool:
    return model_type in COMPOSITE_TEXT_TEACHERS


def composite_model_class(config: Any) -> Any:
    """The transformers class of the composite of ``config`` (its
    ``*ForConditionalGeneration``)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    own = OWN_CLASSES.get(config.model_type)
    return getattr(transformers, own) if own else MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]


def load_text_causal_lm(path: str, **from_pretrained: Any) -> TextCausalLM:
    """Load the composite checkpoint in ``path`` with its own class, keep its text LM."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    options = LOAD_OPTIONS.get(config.model_type, {})
    composite = composite_model_class(config).from_pretrained(path, **options, **from_pretrained)
    return TextCausalLM(composite)


def composite_from_config(config: Any) -> Any:
    """A randomly initialised composite of ``config`` (``teacher init --family``)."""
    return composite_model_class(config)._from_config(config)


def composite_config_fields(model_type: str, text: dict[str, Any],
                            sub_configs: dict[str, Any]) -> dict[str, Any]:
    """The composite config's keyword arguments: ``sub_configs`` with ``text`` as the
    ``text_config`` of its holder (:data:`TEXT_CONFIG_HOLDER`)."""
    holder = TEXT_CONFIG_HOLDER.get(model_type)
    if holder is None:
        return {**sub_configs, "text_config": text}
    return {**sub_configs, holder: {**sub_configs.get(holder, {}), "text_config": text}}


def text_model(model: Any) -> Any:
    """The causal LM to read routes from: a composite's :class:`TextCausalLM`, else
    ``model`` itself."""
    if is_composite_text_teacher(getattr(model.config, "model_type", "")):
        return TextCausalLM(model)
    return model
