"""The chat half of the offline API, shared by `LLM` (paged engine) and `StaticLLM` (ONNX graph)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flashllm.outputs import RequestOutput
from flashllm.sampling_params import SamplingParams

Message = dict[str, Any]


def select_chat_template(chat_template: str | None, own: Any, model_dir: Any) -> tuple[Any, Any]:
    """(the ChatTemplate to render with, the model's own template, loaded from model_dir on first need).

    chat_template: a built-in name (chatml, llama-2, llama-3), a template source string, or None
    for the model's own; a model without one raises ValueError naming the alternatives.
    """
    from flashllm.models.builtin_templates import BUILTIN_TEMPLATES
    from flashllm.models.chat_template import ChatTemplate
    from flashllm.models.tokenizer import load_chat_template

    if chat_template in BUILTIN_TEMPLATES:
        return ChatTemplate.builtin(chat_template), own
    if chat_template is not None:
        return ChatTemplate(chat_template), own
    own = own if own is not None else load_chat_template(model_dir)
    if own is None:
        raise ValueError("this model has no chat template; pass chat_template= a built-in name "
                         f"({', '.join(BUILTIN_TEMPLATES)}) or a template string")
    return own, own


class ChatMethods:
    """chat / render_chat / chat_template / has_chat_template over a class's generate and tokenizer.

    The class provides `tokenizer`, `generate(prompts, sampling_params, use_tqdm)` and
    `_template_dir()` (where the model's own chat template lives); the own template is loaded once.
    """

    tokenizer: Any
    _chat_template: Any = None

    def _template_dir(self) -> Path:
        raise NotImplementedError(f"{type(self).__name__} must say where its chat template lives")

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template (or `chat_template`) and generate;
        `chat_template_kwargs` are extra template variables (Qwen3's `enable_thinking`, ...);
        `continue_final_message` (with add_generation_prompt=False) continues each last message."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.render_chat(c, chat_template, add_generation_prompt, chat_template_kwargs,  # type: ignore[arg-type]
                                    continue_final_message) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)  # type: ignore[attr-defined]

    def render_chat(self, messages: list[Message], chat_template: str | None = None,
                    add_generation_prompt: bool = True, chat_template_kwargs: dict[str, Any] | None = None,
                    continue_final_message: bool = False) -> list[int]:
        """Token ids of a conversation rendered with the sandboxed chat template.

        `chat_template`: None = the model's own, a built-in name (chatml, llama-2, llama-3) or a
        template source string; `chat_template_kwargs`: extra variables the template reads;
        `continue_final_message`: end just after the last message's content, which the model continues
        (ValueError together with add_generation_prompt, as in vLLM).
        """
        from flashllm.models.chat_template import check_continuation, continued_end

        check_continuation(continue_final_message, add_generation_prompt)
        text = self.chat_template(chat_template).render(messages, add_generation_prompt=add_generation_prompt,
                                                        **(chat_template_kwargs or {}))
        if continue_final_message:
            text = text[:continued_end(text, messages)]
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_template(self, chat_template: str | None = None) -> Any:
        """The ChatTemplate to render with (see render_chat); the model's own is loaded once."""
        template, self._chat_template = select_chat_template(chat_template, self._chat_template,
                                                             self._template_dir())
        return template

    def has_chat_template(self) -> bool:
        """Whether the model directory ships a chat template."""
        try:
            self.chat_template()
        except ValueError:
            return False
        return True
